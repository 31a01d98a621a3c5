"""One LoRA GRPO step of the FSDP2 engine at 7B and 32B scale on one GPU, against full FT.

    python benchmarks/trainer_scale.py --out-dir OUT          # CUDA (H200), bf16
    python benchmarks/trainer_scale.py --tiny --out-dir /tmp  # CPU smoke run

Qwen2.5-7B- and Qwen2.5-32B-shaped models (their configs, random weights) are built on the
meta device and materialised on the GPU in bf16; LoRA r=16 on all linear layers, fp32
adapter masters and Adam state, gradient checkpointing on; one batch of 8 groups x 4 samples
x 1024 tokens (128 prompt + 896 completion), micro-batches of `--mb-tokens`. Per shape: step
time (median of the measured steps after one warm-up), tokens/s, peak GPU memory, and the
memory full fine-tuning with Adam would need at 16 bytes per parameter (fp32 master, fp32
gradient, two fp32 Adam moments). `--full-ft` also tries a measured full-FT step of the 7B
shape in the same engine (every parameter trainable, fp32 masters, bf16 autocast); an
out-of-memory is recorded as such. Writes `trainer_scale.json` and `trainer_scale.md` to
`--out-dir` after every shape, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.timing import device_name, sync
from proto.messages import Completion, Trajectory
from services.config.schema import (
    ActorConfig,
    LorabusConfig,
    OptimizerConfig,
)
from services.trainer.engines.fsdp2 import FSDP2Engine

QWEN = dict(
    vocab_size=152064, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False
)
SHAPES = {
    "qwen2.5-7b": dict(
        QWEN,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
    ),
    "qwen2.5-32b": dict(
        QWEN,
        hidden_size=5120,
        intermediate_size=27648,
        num_hidden_layers=64,
        num_attention_heads=40,
        num_key_value_heads=8,
        rms_norm_eps=1e-5,
    ),
    "tiny": dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
    ),
}
FULL_FT_BYTES_PER_PARAM = 16


def build_on_meta(shape: dict, device: torch.device) -> torch.nn.Module:
    """Random-weight model: built on meta, storage allocated on `device` in bf16, weights drawn
    there (normal 0.02, norms 1), rotary buffers recomputed."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**shape)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=g)
    rotary = model.model.rotary_emb
    model.model.rotary_emb = type(rotary)(config=config).to(device)
    return model


def make_batch(groups: int, samples: int, prompt: int, completion: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    uniform = -math.log(vocab)
    out = []
    for i in range(groups):
        comps = [
            Completion(
                token_ids=torch.randint(0, vocab, (completion,), generator=g).tolist(),
                logprobs=[uniform] * completion,
                versions=[0] * completion,
                reward=float(j % 2),
            )
            for j in range(samples)
        ]
        out.append(
            Trajectory(
                run="bench",
                trajectory_id=f"s{seed}g{i}",
                grant_id="x",
                replica="r",
                prompt_id=str(i),
                prompt_token_ids=torch.randint(0, vocab, (prompt,), generator=g).tolist(),
                completions=comps,
                started_at=0.0,
                finished_at=0.0,
            )
        )
    return out


def measure(name: str, shape: dict, args, device: torch.device, full_ft: bool) -> dict:
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    mb_tokens = args.mb_tokens
    if device.type == "cuda" and "32b" in name and torch.cuda.get_device_properties(0).total_memory < 100 * 2**30:
        mb_tokens = min(mb_tokens, 2048)  # an 80 GB card: smaller logits per micro-batch
    cfg = LorabusConfig(
        total_train_steps=100,
        actor=ActorConfig(
            path=name,
            dtype=dtype,
            device=str(device),
            lora_rank=args.rank,
            lora_alpha=2.0 * args.rank,
            mb_spec_max_tokens=mb_tokens,
            gradient_checkpointing=True,
            optimizer=OptimizerConfig(lr=1e-5),
        ),
    )
    t0 = time.perf_counter()
    base = build_on_meta(shape, device)
    base_params = sum(p.numel() for p in base.parameters())
    engine = FSDP2Engine(cfg, base)
    del base
    if full_ft:  # the same step, every weight trainable with fp32 masters
        for p in engine.model.parameters():
            p.data = p.data.float()
            p.requires_grad_(True)
        engine.params = list(engine.model.parameters())
        engine.optimizer = torch.optim.AdamW(engine.params, lr=1e-5)
    trainable = sum(p.numel() for p in engine.params)
    build_s = time.perf_counter() - t0
    row = {
        "model": name,
        "mode": "full-ft" if full_ft else f"lora r={args.rank}",
        "mb_tokens": mb_tokens,
        "base_params": base_params,
        "trainable_params": trainable,
        "build_seconds": build_s,
        "full_ft_adam_gib_computed": base_params * FULL_FT_BYTES_PER_PARAM / 2**30,
    }
    if device.type == "cuda":
        torch.cuda.synchronize()
        row["memory_after_build_gib"] = torch.cuda.memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
    times, tokens = [], 0
    try:
        for i in range(args.warmup + args.steps):
            batch = make_batch(
                args.groups, args.samples, args.prompt_tokens, args.completion_tokens, shape["vocab_size"], seed=i
            )
            sync(device)
            t = time.perf_counter()
            stats = engine.train_step(batch, head_version=i)
            sync(device)
            if i >= args.warmup:
                times.append(time.perf_counter() - t)
            tokens = stats.tokens
            assert math.isfinite(stats.loss), f"step {i}: loss {stats.loss}"
    except torch.OutOfMemoryError as exc:
        row["error"] = f"out of memory: {str(exc).splitlines()[0]}"
    seq_tokens = args.groups * args.samples * (args.prompt_tokens + args.completion_tokens)
    if times:
        step = statistics.median(times)
        row.update(
            step_seconds_median=step,
            step_seconds=times,
            completion_tokens=tokens,
            tokens_per_step=seq_tokens,
            tokens_per_second=seq_tokens / step,
            completion_tokens_per_second=tokens / step,
        )
    if device.type == "cuda":
        row["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        row["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    del engine
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def table(result: dict) -> str:
    lines = [
        f"Trainer step on {result['device']} (torch {result['torch']}): one GRPO step, "
        f"{result['batch']}, gradient checkpointing on, bf16 compute, fp32 adapter masters.",
        "",
        "| model | mode | trainable params | step (s) | tokens/s | peak GPU mem (GiB) | full FT + Adam, 16 B/param "
        "(GiB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        step = (
            f"{r['step_seconds_median']:.2f}"
            if "step_seconds_median" in r
            else ("out of memory" if r.get("error", "").startswith("out of memory") else r.get("error", "-"))
        )
        tps = f"{r['tokens_per_second']:,.0f}" if "tokens_per_second" in r else "-"
        peak = f"{r['peak_memory_gib']:.1f}" if "peak_memory_gib" in r else "-"
        lines.append(
            f"| {r['model']} | {r['mode']} | {r['trainable_params'] / 1e6:,.1f} M | {step} | "
            f"{tps} | {peak} | {r['full_ft_adam_gib_computed']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--shapes", default="qwen2.5-7b,qwen2.5-32b")
    p.add_argument("--full-ft", action="store_true", help="also try a full-FT step of the 7B shape")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--completion-tokens", type=int, default=896)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--mb-tokens", type=int, default=4096)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--out-dir", type=Path, required=True)
    args = p.parse_args(argv)
    if args.tiny:
        device, shapes = torch.device("cpu"), ["tiny"]
        args.groups, args.samples, args.prompt_tokens, args.completion_tokens = 2, 2, 8, 24
        args.steps, args.mb_tokens = 1, 64
    elif not torch.cuda.is_available():
        print("no CUDA device; use --tiny for a CPU smoke run", file=sys.stderr)
        return 2
    else:
        device, shapes = torch.device("cuda"), args.shapes.split(",")
    result = {
        "device": device_name(device),
        "torch": torch.__version__,
        "batch": f"{args.groups} groups x {args.samples} samples x "
        f"{args.prompt_tokens + args.completion_tokens} tokens "
        f"(micro-batches of {args.mb_tokens} tokens)",
        "rows": [],
    }
    if device.type == "cuda":
        result["gpu_memory_gib"] = torch.cuda.get_device_properties(0).total_memory / 2**30
    args.out_dir.mkdir(parents=True, exist_ok=True)
    runs = [(s, False) for s in shapes]
    if args.full_ft or args.tiny:
        runs.append((shapes[0], True))
    for name, full in runs:
        row = measure(name, SHAPES[name], args, device, full)
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        (args.out_dir / "trainer_scale.json").write_text(json.dumps(result, indent=2) + "\n")
        (args.out_dir / "trainer_scale.md").write_text(table(result))
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
