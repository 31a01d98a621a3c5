"""Continuous batching vs the batch engine on a rollout-shaped workload, side by side in one run.

    python benchmarks/continuous_batching.py --out benchmarks/results/continuous_batching_h200.json
    python benchmarks/continuous_batching.py --tiny --out /tmp/cb.json      # CPU smoke run

The embedded engine (random bf16 weights of the Qwen2.5-1.5B shape, an r16 all-linear adapter
as the head) serves `groups` GRPO-like groups: one prompt of `prompt_len` tokens, `n` samples,
up to `max_new` new tokens, and a stop set of about 1 % of the vocabulary, so rows end at
geometric lengths (mean near 100 tokens) as real completions do. Two ways, same requests:
  batch       the work loop's rounds: `in_flight` groups per engine call, each call waiting for
              its longest row (what rollout.slab_rows = 0 does)
  continuous  a slab of `in_flight * n` rows (rollout.slab_rows), every group its own call, up
              to `in_flight` in flight, a new one sent as soon as one is answered
Reported: new tokens per second over the whole workload, the mean completion length, and the
ratio continuous / batch. The samples' tokens are compared between the two (same seeds): in
float32 they must be equal, so a faster path that generates something else fails the run; in
bf16 the share of identical samples is reported.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.adapters import random_lora
from benchmarks.embedded_engine import build_model, model_config
from benchmarks.timing import one_way, sync, tiny_or_cuda, two_ways, write_results
from proto.messages import LoraSpec
from services.common.lora_targets import HF_LINEAR
from services.rollout.engines.base import GenRequest
from services.rollout.engines.embedded import EmbeddedEngine


def workload(groups: int, n: int, prompt_len: int, max_new: int, vocab: int) -> list[GenRequest]:
    g = torch.Generator().manual_seed(3)
    stops = torch.randperm(vocab, generator=g)[: max(1, vocab // 100)].tolist()
    return [
        GenRequest(
            prompt_token_ids=torch.randint(0, vocab, (prompt_len,), generator=g).tolist(),
            n=n,
            max_new_tokens=max_new,
            temperature=1.0,
            seed=1000 + i,
            stop_token_ids=stops,
        )  # fmt: skip
        for i in range(groups)
    ]


async def run_batch(engine: EmbeddedEngine, reqs: list[GenRequest], in_flight: int) -> list:
    out = []
    for i in range(0, len(reqs), in_flight):
        out += await engine.generate(reqs[i : i + in_flight], 0)
    return out


async def run_continuous(engine: EmbeddedEngine, reqs: list[GenRequest], in_flight: int) -> list:
    gate = asyncio.Semaphore(in_flight)

    async def one(req: GenRequest):
        async with gate:
            return (await engine.generate([req], 0))[0]

    return list(await asyncio.gather(*(one(r) for r in reqs)))


async def measure(args, device: torch.device, dtype: torch.dtype) -> dict:
    cfg = model_config(args.tiny)
    reqs = workload(args.groups, args.n, args.prompt_len, args.max_new, cfg.vocab_size)
    adapter = random_lora(build_model(cfg, torch.device("cpu"), dtype), 16, seed=5, dtype=dtype, b_scale=0.02)
    spec = LoraSpec(rank=16, alpha=32.0, target_modules=list(HF_LINEAR), base_model="bench")
    results: dict = {}
    outputs = {}
    for name, slab in (("batch", 0), ("continuous", args.in_flight * args.n)):
        engine = EmbeddedEngine(
            build_model(cfg, device, dtype), eos_ids=[], pad_id=0, slots=3, cuda_graphs=device.type == "cuda",
            slab_rows=slab, slab_length=args.prompt_len + args.max_new,
        )  # fmt: skip
        await engine.load_version(0, {k: v.to(device) for k, v in adapter.items()}, spec)
        go = run_batch if slab == 0 else run_continuous
        await go(engine, reqs[: args.in_flight], args.in_flight)  # warm-up: kernels and graphs
        sync(device)
        t0 = time.perf_counter()
        out = await go(engine, reqs, args.in_flight)
        sync(device)
        seconds = time.perf_counter() - t0
        tokens = sum(len(r.token_ids) for group in out for r in group)
        results[name] = one_way(name, seconds, tokens, mean_completion=round(tokens / (args.groups * args.n), 1))
        outputs[name] = [r.token_ids for group in out for r in group]
        await engine.close()
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return two_ways(results, "continuous", "batch", outputs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tiny", action="store_true", help="tiny model on the CPU (smoke run)")
    ap.add_argument("--groups", type=int, default=None)
    ap.add_argument("--n", type=int, default=8, help="samples per group")
    ap.add_argument("--in-flight", type=int, default=8, help="groups in flight (rollout.batch_groups)")
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--max-new", type=int, default=None)
    args = ap.parse_args(argv)
    where = tiny_or_cuda(args.tiny)
    if where is None:
        return 2
    device, dtype = where
    args.groups = args.groups or (6 if args.tiny else 64)
    args.prompt_len = args.prompt_len or (16 if args.tiny else 128)
    args.max_new = args.max_new or (48 if args.tiny else 512)
    if args.tiny:
        args.n, args.in_flight = min(args.n, 4), min(args.in_flight, 2)
    res = asyncio.run(measure(args, device, dtype))
    write_results(args.out, device, args, res)
    # in float32 the two paths give the same tokens (CPU), so any other token is a wrong path; in bf16 the
    # GEMMs' reduction order follows the batch's shape and samples part at the first near-tie,
    # so there the share of identical samples is reported, not required
    if dtype == torch.float32 and not res["same_tokens"]:
        raise SystemExit("continuous batching generated other tokens than the batch engine")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
