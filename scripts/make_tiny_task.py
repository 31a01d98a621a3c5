"""Build the tiny task that every lorabus test and example runs on, from nothing.

Writes `examples/tiny/`:
  data/train.jsonl, data/valid.jsonl   the arith splits (`services.common.data.arith_split`)
  model/                               a tiny Llama in HF format with a byte-level tokenizer,
                                       pretrained by supervised next-token training on the
                                       train split until it has the answer format right and
                                       the arithmetic only partly: room for RL to improve it.

The tokenizer, the model's shape, the pretraining loop (`pretrain`), its evaluation and the
saved directory are shared with scripts/make_arith3_task.py.

Deterministic: fixed seeds, one CPU thread. Run from the repo root:
  .venv/bin/python scripts/make_tiny_task.py            # ~2-3 min on one core
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.common.data import Prompt, arith_split, write_jsonl
from services.common.models import decode_completion, encode_prompt
from services.common.rewards import arith_reward

SPECIALS = ["<pad>", "<bos>", "<eos>"]


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map, which the ByteLevel pre-tokenizer
    and decoder use: printable latin-1 bytes stand for themselves, the rest are shifted
    above 255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return mapping


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE with no merges: one token per byte (id = byte + 3), so any text
    round-trips, plus <pad>=0 <bos>=1 <eos>=2. A real `tokenizers` tokenizer, so vLLM loads it."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for b, ch in byte_to_unicode().items():
        vocab[ch] = len(SPECIALS) + b
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(SPECIALS)
    # Text sent to a server (vLLM's completions API) gets the same bos that encode_prompt adds.
    tk.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", 1)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        model_max_length=128,
    )


def pin_tokenizer_class(model_dir: Path) -> None:
    """transformers 5 writes `TokenizersBackend`, a name transformers 4 (which vLLM builds may
    pin) does not know; `PreTrainedTokenizerFast` loads the same tokenizer.json in both."""
    path = model_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2) + "\n")


def build_model(
    vocab_size: int, *, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, max_positions: int
) -> LlamaForCausalLM:
    # Llama rather than Qwen2: transformers 5 forces Qwen2Tokenizer (its own pre-tokenizer and
    # normalizer) onto any qwen2 checkpoint, while a llama one keeps the tokenizer.json as saved.
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        # the tiny task's head_dim 32: a size every vLLM attention backend (CPU and GPU) supports
        head_dim=hidden // heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return LlamaForCausalLM(config)


def answer_examples(tok, prompts: list[Prompt]) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids + eos) of each prompt: the loss is taken on the second part."""
    return [
        (encode_prompt(tok, p.text), tok.encode(p.answer, add_special_tokens=False) + [tok.eos_token_id])
        for p in prompts
    ]


def make_batch(examples: list[tuple[list[int], list[int]]], pad: int):
    """Right-padded (prompt + answer) sequences; loss only on the answer tokens."""
    length = max(len(p) + len(a) for p, a in examples)
    ids = torch.full((len(examples), length), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for row, (p, a) in enumerate(examples):
        seq = p + a
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
        labels[row, len(p) : len(seq)] = torch.tensor(a)
    return ids, mask, labels


def pretrain(
    model: LlamaForCausalLM,
    examples: list[tuple[list[int], list[int]]],
    *,
    steps: int,
    batch: int,
    lr: float,
    warmup: int,
    seed: int,
    pad: int,
    device: torch.device,
) -> Iterator[tuple[int, torch.Tensor]]:
    """Supervised next-token training on `examples`, `batch` drawn at random (seeded) per step;
    yields (step, loss) after each step, so the caller evaluates, logs or stops in between.
    bf16 autocast on CUDA, none on the CPU."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    # Constant after warmup, no decay: stopping while the learning rate is still high leaves
    # the model unsure between close answers (sampling well below greedy), which RL sharpens.
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    gen = torch.Generator().manual_seed(seed)
    model.train()
    for step in range(1, steps + 1):
        picks = torch.randint(len(examples), (batch,), generator=gen).tolist()
        ids, mask, labels = make_batch([examples[i] for i in picks], pad)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(input_ids=ids.to(device), attention_mask=mask.to(device), labels=labels.to(device)).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        yield step, loss


def save_model(model: LlamaForCausalLM, tok, model_dir: Path) -> None:
    """The model (moved to the CPU) and the tokenizer as one loadable HF directory."""
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model.cpu().save_pretrained(model_dir, safe_serialization=True)
    tok.save_pretrained(model_dir)
    pin_tokenizer_class(model_dir)


@torch.no_grad()
def evaluate(
    model,
    tok,
    prompts: list[Prompt],
    *,
    sample: bool,
    samples: int,
    seed: int,
    max_new_tokens: int = 8,
    reward: Callable[[str, str, str], float] = arith_reward,
    well_formed: Callable[[str], bool] = str.isdigit,
):
    """Accuracy (`reward` 1 and an eos) and the share of completions that are `well_formed`
    (default: a bare integer) followed by eos. Prompts are generated in groups of equal length,
    so no padding is involved."""
    model.eval()
    torch.manual_seed(seed)
    by_len: dict[int, list[Prompt]] = {}
    for p in prompts:
        by_len.setdefault(len(encode_prompt(tok, p.text)), []).append(p)
    correct = formatted = total = 0
    for group in by_len.values():
        ids = torch.tensor([encode_prompt(tok, p.text) for p in group], device=model.device)
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=sample,
            temperature=1.0 if sample else None,
            top_k=0 if sample else None,
            top_p=1.0 if sample else None,
            num_return_sequences=samples if sample else 1,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        reps = samples if sample else 1
        for row in range(out.shape[0]):
            p = group[row // reps]
            new = out[row, ids.shape[1] :].tolist()
            text = decode_completion(tok, new)
            ended = tok.eos_token_id in new
            correct += reward(p.text, text, p.answer) == 1.0 and ended
            formatted += ended and well_formed(text)
            total += 1
    model.train()
    return correct / total, formatted / total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("examples/tiny"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--intermediate", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--eval-every", type=int, default=0, help="0: only at the end")
    ap.add_argument("--eval-samples", type=int, default=4, help="sampled completions per prompt")
    args = ap.parse_args(argv)

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    started = time.monotonic()

    train, valid = arith_split("train"), arith_split("valid")
    write_jsonl(args.out / "data" / "train.jsonl", train)
    write_jsonl(args.out / "data" / "valid.jsonl", valid)

    tok = build_tokenizer()
    model = build_model(
        len(tok),
        hidden=args.hidden,
        intermediate=args.intermediate,
        layers=args.layers,
        heads=args.heads,
        kv_heads=args.kv_heads,
        max_positions=128,
    )
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params} parameters, vocab {len(tok)}; train {len(train)} valid {len(valid)}")

    steps = pretrain(
        model,
        answer_examples(tok, train),
        steps=args.steps,
        batch=args.batch,
        lr=args.lr,
        warmup=max(1, args.steps // 20),
        seed=args.seed,
        pad=tok.pad_token_id,
        device=torch.device("cpu"),
    )
    for step, loss in steps:
        if step % 100 == 0:
            print(f"step {step} loss {loss.item():.4f} ({time.monotonic() - started:.0f}s)", flush=True)
        if args.eval_every and step % args.eval_every == 0 and step < args.steps:
            g, _ = evaluate(model, tok, valid, sample=False, samples=1, seed=args.seed)
            s, f = evaluate(model, tok, valid[:200], sample=True, samples=2, seed=args.seed)
            print(f"  eval step {step}: greedy {g:.3f} sampled {s:.3f} format {f:.3f}", flush=True)

    greedy, greedy_fmt = evaluate(model, tok, valid, sample=False, samples=1, seed=args.seed)
    sampled, sampled_fmt = evaluate(model, tok, valid, sample=True, samples=args.eval_samples, seed=args.seed)
    save_model(model, tok, args.out / "model")
    metrics = {
        "valid_prompts": len(valid),
        "greedy_accuracy": round(greedy, 4),
        "greedy_format_rate": round(greedy_fmt, 4),
        "sampled_accuracy_t1": round(sampled, 4),
        "sampled_format_rate_t1": round(sampled_fmt, 4),
        "sampled_per_prompt": args.eval_samples,
        "final_loss": round(loss.item(), 4),
        "steps": args.steps,
        "parameters": n_params,
        "seconds": round(time.monotonic() - started, 1),
    }
    (args.out / "pretrain_metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    print(json.dumps(metrics))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
