"""The decode step's sampler two ways, side by side: torch (`sampling.sample`'s torch path) and
the fused Triton kernel (`sample_kernel.sample_fused`), on the same logits.

    python benchmarks/sampler.py --out benchmarks/results/sampler_h100.json     # CUDA
    TRITON_INTERPRET=1 python benchmarks/sampler.py --tiny --out /tmp/s.json    # CPU smoke run

Random bf16 logits [batch, vocab] (Qwen2.5's vocabulary, 151,936; scaled so the distribution is
peaked as a model's is), every row sampled at T = 1 and, as a second case, greedily. Reported per
batch: the median ms of each way over `--reps` calls, the speed-up, the share of rows whose
token the two ways agree on (they share the hash and the float32 scaling; the logs may differ
in the last bit, so a near-tie can part) and the largest logprob gap.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.timing import device_name, median_ms, timed
from services.rollout import sample_kernel, sampling


def torch_way(logits, temperature, seeds, step, vocab_hash):
    """`sampling.sample` as it runs without the kernel (no truncation)."""
    scaled = logits.float() / torch.where(temperature <= 0, 1.0, temperature)[:, None]
    logp = scaled.log_softmax(-1)
    drawn = (scaled + sampling.gumbel_noise(seeds, step, vocab_hash)).argmax(-1)
    tokens = torch.where(temperature <= 0, scaled.argmax(-1), drawn)
    return tokens, logp.gather(-1, tokens[:, None])[:, 0]


def fused_way(logits, temperature, seeds, step, vocab_hash):
    return sample_kernel.sample_fused(logits, temperature, sampling.row_keys(seeds, step))


def measure(batch: int, vocab: int, temp: float, reps: int, device: torch.device, dtype: torch.dtype) -> dict:
    g = torch.Generator().manual_seed(batch)
    logits = (torch.randn(batch, vocab, generator=g) * 4).to(device=device, dtype=dtype)
    temperature = torch.full((batch,), temp, device=device)
    seeds = torch.arange(batch, device=device)
    vocab_hash = sampling.vocab_hashes(vocab, device)
    out: dict = {"batch": batch, "temperature": temp}
    results = {}
    for name, fn in (("torch", torch_way), ("fused", fused_way)):
        results[name] = fn(logits, temperature, seeds, 7, vocab_hash)  # warm-up (compiles the kernel)
        out[f"{name}_ms"] = round(median_ms(timed(lambda: fn(logits, temperature, seeds, 7, vocab_hash), device)
                                            for _ in range(reps)), 4)  # fmt: skip
    out["speedup"] = round(out["torch_ms"] / out["fused_ms"], 2)
    (tt, tl), (ft, fl) = results["torch"], results["fused"]
    out["same_token_share"] = round((tt == ft).float().mean().item(), 4)
    same = tt == ft
    out["max_logprob_gap"] = float((tl[same] - fl[same]).abs().max()) if bool(same.any()) else None
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tiny", action="store_true", help="CPU under TRITON_INTERPRET=1, small shapes")
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args(argv)
    device = torch.device("cpu" if args.tiny else "cuda")
    if not sampling.fused_sampler_available(device):
        print("the fused sampler needs Triton on CUDA (or TRITON_INTERPRET=1 with --tiny)", file=sys.stderr)
        return 2
    dtype = torch.float32 if args.tiny else torch.bfloat16
    batches, vocab, reps = ([2, 4], 3000, 2) if args.tiny else (args.batches, args.vocab, args.reps)
    res = {"device": device_name(device), "torch": torch.__version__, "vocab": vocab, "dtype": str(dtype), "runs": []}
    print(
        "| batch | T | torch ms | fused ms | speed-up | same token | max logprob gap |\n|---|---|---|---|---|---|---|"
    )
    for temp in (1.0, 0.0):
        for batch in batches:
            r = measure(batch, vocab, temp, reps, device, dtype)
            res["runs"].append(r)
            print(f"| {batch} | {temp} | {r['torch_ms']} | {r['fused_ms']} | {r['speedup']} | "
                  f"{r['same_token_share']:.2%} | {r['max_logprob_gap']} |", flush=True)  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
