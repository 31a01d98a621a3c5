"""A fleet replica's decode: its runs' calls of a round made at once against the same calls made
apart, side by side in one run.

    python benchmarks/fleet_decode.py --out benchmarks/results/fleet_decode_h200.json
    python benchmarks/fleet_decode.py --tiny --out benchmarks/results/fleet_decode_cpu.json

One embedded engine (random weights of the Qwen2.5-1.5B shape in bf16 on a GPU, graphed; a tiny
model in float32 on the CPU, on the same static path run eagerly) holds `runs` runs of
`versions` versions each (`run_engines`, as a fleet's replica does). A round is what the work
loop hands the engine: up to `groups` grants spread at random over the runs and their versions,
one engine call per (run, version), each group `n` samples of a `prompt_len`-token prompt and up
to `max_new` new tokens. Two ways, same seeded rounds:
  together  the calls of a round in one pass of the event loop (what the work loop does): the
            engine decodes them as one batch
  apart     each call a millisecond after the one before, so each decodes on its own beside the
            others: what every call did before the engine batched a pass's calls
Reported per way: new tokens per second, forward steps, and the static caches made (on a GPU each
is a fresh CUDA-graph capture) over the timed rounds, after `warmup` rounds. The samples' tokens
are compared between the two: in float32 they must be equal; in bf16 the share of identical
samples is reported (the GEMMs' reduction order follows the batch's shape).
"""

from __future__ import annotations

import argparse
import asyncio
import random
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
from services.rollout.engines.base import Engine, GenRequest
from services.rollout.engines.embedded import EmbeddedEngine
from services.rollout.run_engines import RunEngines
from services.rollout.sampling import DecodeGraphs

RANK = 16

Round = list[tuple[int, int, list[GenRequest]]]
"""(run, version, its requests): one engine call each"""


def rounds(args: argparse.Namespace, vocab: int) -> list[Round]:
    """Seeded rounds: between half of `groups` and `groups` grants each, on random runs and versions."""
    rng = random.Random(7)
    out = []
    for _ in range(args.warmup + args.rounds):
        calls: dict[tuple[int, int], list[GenRequest]] = {}
        for _ in range(rng.randint(max(1, args.groups // 2), args.groups)):
            req = GenRequest(
                prompt_token_ids=[rng.randrange(vocab) for _ in range(args.prompt_len)],
                n=args.n,
                max_new_tokens=args.max_new,
                seed=rng.randrange(1 << 30),
            )
            calls.setdefault((rng.randrange(args.runs), rng.randrange(args.versions)), []).append(req)
        out.append([(run, version, reqs) for (run, version), reqs in calls.items()])
    return out


async def serve(views: list[Engine], work: Round, apart: bool) -> list:
    if not apart:
        return list(await asyncio.gather(*(views[r].generate(reqs, v) for r, v, reqs in work)))
    tasks = []
    for r, v, reqs in work:
        tasks.append(asyncio.create_task(views[r].generate(reqs, v)))
        await asyncio.sleep(0.001)  # past the pass that would have joined it to the others
    return list(await asyncio.gather(*tasks))


async def measure(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict:
    cfg = model_config(args.tiny)
    work = rounds(args, cfg.vocab_size)
    template = build_model(cfg, torch.device("cpu"), dtype)
    adapters = [
        [random_lora(template, RANK, seed=100 * r + v, dtype=dtype, b_scale=0.02) for v in range(args.versions)]
        for r in range(args.runs)
    ]
    del template
    spec = LoraSpec(rank=RANK, alpha=2.0 * RANK, target_modules=list(HF_LINEAR), base_model="bench")
    slots = args.runs * args.versions + 1
    results: dict = {}
    tokens_of: dict[str, list] = {}
    for way in ("together", "apart"):
        engine = EmbeddedEngine(build_model(cfg, device, dtype), eos_ids=[], pad_id=0, slots=slots,
                                cuda_graphs=device.type == "cuda")  # fmt: skip
        if engine.graphs is None:  # the CPU: the static path a GPU graphs, run eagerly
            engine.graphs = DecodeGraphs(engine.model, capture=False, pad_batches=True)
        graphs = engine.graphs
        fleet = RunEngines(engine, "run0", slots=slots, rank=RANK)
        views = [fleet.view(f"run{r}", "bench") for r in range(args.runs)]
        for r, view in enumerate(views):
            for v, tensors in enumerate(adapters[r]):
                await view.load_version(v, {k: t.to(device) for k, t in tensors.items()}, spec)
        for round_ in work[: args.warmup]:
            await serve(views, round_, apart=way == "apart")
        sync(device)
        caches, steps, t0 = graphs.caches_made, engine.steps, time.perf_counter()
        outs = [await serve(views, round_, apart=way == "apart") for round_ in work[args.warmup :]]
        sync(device)
        seconds = time.perf_counter() - t0
        tokens_of[way] = [s.token_ids for out in outs for call in out for group in call for s in group]
        tokens = sum(map(len, tokens_of[way]))
        results[way] = one_way(way, seconds, tokens, forward_steps=engine.steps - steps,
                               caches_made=graphs.caches_made - caches)  # fmt: skip
        await engine.close()
        del engine, graphs, fleet, views
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return two_ways(results, "together", "apart", tokens_of)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tiny", action="store_true", help="tiny model on the CPU")
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--versions", type=int, default=3, help="versions per run (max_head_offpolicyness + 1)")
    ap.add_argument("--groups", type=int, default=8, help="grants in flight per replica (rollout.batch_groups)")
    ap.add_argument("--n", type=int, default=8, help="samples per group")
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--max-new", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args(argv)
    where = tiny_or_cuda(args.tiny)
    if where is None:
        return 2
    device, dtype = where
    args.prompt_len = args.prompt_len or (12 if args.tiny else 128)
    args.max_new = args.max_new or (8 if args.tiny else 64)
    args.rounds = args.rounds or (30 if args.tiny else 40)
    res = asyncio.run(measure(args, device, dtype))
    write_results(args.out, device, args, res)
    if dtype == torch.float32 and not res["same_tokens"]:
        raise SystemExit("the calls decoded together generated other tokens than the calls decoded apart")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
