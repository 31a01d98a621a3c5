"""Build the GPU learning task: three-digit addition and subtraction (carries and borrows), and
the ~85 M-parameter model that starts it, pre-trained by this script on one GPU in a few minutes.

Writes `--out` (default examples/arith3/):
  data/train.jsonl, data/valid.jsonl   `a+b=` / `a-b=` (a >= b), operands 0-999, disjoint splits
                                       (500 held-out prompts)
  model/                               a Llama (hidden 768, 12 layers) with the tiny task's
                                       byte-level tokenizer, pre-trained by supervised
                                       next-token training on the train split until its greedy
                                       held-out accuracy first reaches --target: it has the
                                       format and part of the arithmetic, RL has the rest to gain
  pretrain_metrics.json                what the stop looked like

Deterministic: fixed seeds, `torch.use_deterministic_algorithms` with cuBLAS's fixed workspace,
so one kind of GPU gives the same model every time. Neither the data nor the model (340 MB) is
committed (examples/arith3/ is ignored); both are made with:
  python scripts/make_arith3_task.py                     # CUDA, ~1 min on an H100
`arguments`, `write_data` and `make_model` are what scripts/make_chain_task.py makes its task with.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch
from transformers import PreTrainedTokenizerFast

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.make_tiny_task import (
    answer_examples,
    build_model,
    build_tokenizer,
    evaluate,
    pretrain,
    save_model,
)
from services.common.data import Prompt, load_prompts, write_jsonl
from services.common.rewards import arith_reward
from services.config.schema import DatasetConfig

SEED = 4321
MAX_OPERAND = 999
VALID = 500
TRAIN = 60_000


def problem(a: int, b: int, op: str) -> Prompt:
    answer = a + b if op == "+" else a - b
    return Prompt(prompt_id=f"{'add' if op == '+' else 'sub'}-{a}-{b}", text=f"{a}{op}{b}=", answer=str(answer))


def splits() -> tuple[list[Prompt], list[Prompt]]:
    """Disjoint seeded samples of the ~1.5 M problems (sampling with rejection of repeats)."""
    rng = random.Random(SEED)
    seen: set[str] = set()
    out: list[Prompt] = []
    while len(out) < VALID + TRAIN:
        a, b = rng.randint(0, MAX_OPERAND), rng.randint(0, MAX_OPERAND)
        op = rng.choice("+-")
        if op == "-" and a < b:
            a, b = b, a
        p = problem(a, b, op)
        if p.prompt_id not in seen:
            seen.add(p.prompt_id)
            out.append(p)
    return out[VALID:], out[:VALID]


def arguments(description: str, out: Path, max_steps: int = 3000) -> argparse.ArgumentParser:
    """The command line of a GPU task maker (this one, scripts/make_chain_task.py)."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=out)
    ap.add_argument("--data-only", action="store_true", help="write the data files and stop")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--max-steps", type=int, default=max_steps)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--target", type=float, default=0.3, help="stop at the first eval with greedy accuracy >= this")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--max-seconds", type=float, default=None, help="stop at the first eval past this (a bounded call)")
    return ap


def write_data(out: Path, train: list[Prompt], valid: list[Prompt]) -> None:
    write_jsonl(out / "data" / "train.jsonl", train)
    write_jsonl(out / "data" / "valid.jsonl", valid)
    # what the services will read is what was written
    assert load_prompts(DatasetConfig(path=str(out / "data" / "valid.jsonl"), shuffle=False)) == valid


def make_model(
    args: argparse.Namespace,
    examples: Callable[[PreTrainedTokenizerFast], list[tuple[list[int], list[int]]]],
    valid: list[Prompt],
    *,
    max_positions: int,
    max_new_tokens: int = 8,
    reward: Callable[[str, str, str], float] = arith_reward,
    well_formed: Callable[[str], bool] = str.isdigit,
) -> None:
    """Pre-train the task's Llama on `examples` (prompt ids, target ids) until its greedy
    held-out accuracy (`reward` on `valid`, `max_new_tokens` new) first reaches `args.target`,
    then save it under `args.out`/model with what the stop looked like (pretrain_metrics.json)."""
    torch.manual_seed(SEED)
    torch.use_deterministic_algorithms(True)
    device = torch.device(args.device)
    started = time.monotonic()
    tok = build_tokenizer()
    model = build_model(
        len(tok),
        hidden=args.hidden,
        intermediate=args.intermediate,
        layers=args.layers,
        heads=args.heads,
        kv_heads=args.heads,
        max_positions=max_positions,
    ).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    train = examples(tok)
    print(f"model: {n_params} parameters; train {len(train)} valid {len(valid)}", flush=True)
    scoring = dict(max_new_tokens=max_new_tokens, reward=reward, well_formed=well_formed)
    steps = pretrain(
        model,
        train,
        steps=args.max_steps,
        batch=args.batch,
        lr=args.lr,
        warmup=100,
        seed=SEED,
        pad=tok.pad_token_id,
        device=device,
    )
    curve = []
    greedy = 0.0
    step = 0
    for step, loss in steps:
        if step % args.eval_every == 0:
            greedy, fmt = evaluate(model, tok, valid, sample=False, samples=1, seed=SEED, **scoring)
            curve.append({"step": step, "loss": round(loss.item(), 4), "greedy": round(greedy, 4)})
            print(
                f"step {step} loss {loss.item():.4f} greedy {greedy:.3f} format {fmt:.3f} "
                f"({time.monotonic() - started:.0f}s)",
                flush=True,
            )
            if greedy >= args.target or (args.max_seconds and time.monotonic() - started > args.max_seconds):
                break
    sampled, sampled_fmt = evaluate(model, tok, valid, sample=True, samples=4, seed=SEED, **scoring)
    save_model(model, tok, args.out / "model")
    metrics = {
        "valid_prompts": len(valid),
        "greedy_accuracy": round(greedy, 4),
        "sampled_accuracy_t1": round(sampled, 4),
        "sampled_format_rate_t1": round(sampled_fmt, 4),
        "steps": step,
        "parameters": n_params,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "seconds": round(time.monotonic() - started, 1),
        "curve": curve,
    }
    (args.out / "pretrain_metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    print(json.dumps({k: v for k, v in metrics.items() if k != "curve"}))


def main(argv: list[str] | None = None) -> int:
    args = arguments(__doc__ or "", ROOT / "examples" / "arith3").parse_args(argv)
    train, valid = splits()
    write_data(args.out, train, valid)
    if not args.data_only:
        make_model(args, lambda tok: answer_examples(tok, train), valid, max_positions=64)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
