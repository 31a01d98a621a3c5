"""Several runs' train steps on one shared base: one after another against one joint step.

    python benchmarks/joint_step.py --out benchmarks/results/joint_step_h100.json    # CUDA, bf16
    python benchmarks/joint_step.py --small --out benchmarks/results/joint_step_cpu.json

A fleet's trainer holds one base model and one peft adapter per run (`FSDP2Engine.sibling`).
For N = 1, 2, 4, 8 runs (mixed ranks 8/16/32, all-linear and attention-only, as
`benchmarks/multi_run.py` mixes them) it times, side by side in one process, the N runs'
`train_step`s one after another and one `train_together` of the same batches, from the same
starting adapters, and checks the joint step's adapters against the solo steps' (max |diff|);
then the N runs' canaries one after another against one joint decode (`canary_together`);
on a GPU also the peak memory of each.
The batch per run is the arith3 task's GPU step by default (8 groups x 4 samples, ~24 prompt
+ 8 completion tokens: a step of short sequences, where a run's own work is small next to the
fixed cost of a pass through the base), and can be made longer. Random weights and tokens: a
step's cost does not depend on what the tokens are.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.shapes import SHAPES
from benchmarks.timing import device_name, sync
from benchmarks.trainer_step import build_base, make_batch
from services.common import adapter_io
from services.config.schema import ActorConfig, GenerationConfig, LorabusConfig, OptimizerConfig
from services.trainer.engines.fsdp2 import FSDP2Engine

SMALL = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=4096, max_position_embeddings=512)  # fmt: skip
QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                  max_position_embeddings=4096)  # fmt: skip
QWEN25_15B = dict(SHAPES["qwen2.5-1.5b"], max_position_embeddings=4096)
RUN_SHAPES = [(8, ["all-linear"]), (16, ["q_proj", "k_proj", "v_proj", "o_proj"]), (32, ["all-linear"]),
              (16, ["all-linear"])]  # fmt: skip


def run_config(i: int, dtype: str, device: str, mb_tokens: int) -> LorabusConfig:
    rank, targets = RUN_SHAPES[i % len(RUN_SHAPES)]
    return LorabusConfig(
        run=f"run{i}",
        gconfig=GenerationConfig(temperature=1.0, n_samples=4),
        actor=ActorConfig(
            path="bench",
            dtype=dtype,
            device=device,
            lora_rank=rank,
            lora_alpha=2.0 * rank,
            target_modules=targets,
            mb_spec_max_tokens=mb_tokens,
            seed=i,
            optimizer=OptimizerConfig(lr=1e-4),
        ),  # fmt: skip
    )


def fleet(base, n: int, dtype: str, device: str, mb_tokens: int) -> list[FSDP2Engine]:
    first = FSDP2Engine(run_config(0, dtype, device, mb_tokens), base)
    return [first] + [first.sibling(run_config(i, dtype, device, mb_tokens), f"run{i}") for i in range(1, n)]


def snapshot(engines: list[FSDP2Engine]) -> list[tuple]:
    """Each engine's adapter, optimizer, schedule and step count, to start both timings alike."""
    return [([p.detach().clone() for p in e.params], copy.deepcopy(e.optimizer.state_dict()),
             copy.deepcopy(e.scheduler.state_dict()), e.step) for e in engines]  # fmt: skip


def restore(engines: list[FSDP2Engine], saved: list[tuple]) -> None:
    for e, (params, optim, schedule, step) in zip(engines, saved):
        with torch.no_grad():
            for p, x in zip(e.params, params):
                p.copy_(x)
        e.optimizer.load_state_dict(copy.deepcopy(optim))
        e.scheduler.load_state_dict(schedule)
        e.step = step


def reset_peak(dev: torch.device) -> None:
    sync(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)


def peak_gib(dev: torch.device) -> float:
    """The GPU's peak allocation since `reset_peak` (0 on the CPU)."""
    return torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else 0.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="a small model in float32 on the CPU")
    p.add_argument("--shape", default="qwen2.5-0.5b", choices=["qwen2.5-0.5b", "qwen2.5-1.5b"])
    p.add_argument("--runs", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=24)
    p.add_argument("--completion-tokens", type=int, default=8)
    p.add_argument("--mb-tokens", type=int, default=16384, help="actor.mb_spec_max_tokens of every run")
    p.add_argument("--steps", type=int, default=3, help="timed steps per N (after one warm-up)")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if args.small:
        shape, dtype, device, name = SMALL, "float32", "cpu", "small"
    else:
        if not torch.cuda.is_available():
            print("no CUDA device; use --small for a CPU run", file=sys.stderr)
            return 2
        shape = QWEN25_05B if args.shape == "qwen2.5-0.5b" else QWEN25_15B
        dtype, device, name = "bfloat16", "cuda", f"{args.shape}-shape"
    dev = torch.device(device)
    batch = dict(groups=args.groups, samples=args.samples, prompt=args.prompt_tokens,
                 completion=args.completion_tokens, vocab=shape["vocab_size"])  # fmt: skip
    rows = []
    for n in args.runs:
        engines = fleet(build_base(shape, adapter_io.DTYPES[dtype], dev), n, dtype, device, args.mb_tokens)
        solo_s, joint_s, diffs, peaks = [], [], [], {"one_after_another": 0.0, "joint": 0.0}
        canary_s, canary_joint_s, canary_diffs = [], [], []
        for step in range(1 + args.steps):
            batches = [make_batch(seed=1000 * step + i, **batch) for i in range(n)]
            before = snapshot(engines)
            reset_peak(dev)
            t0 = time.perf_counter()
            for e, b in zip(engines, batches):
                e.train_step(b, head_version=step)
            sync(dev)
            t1 = time.perf_counter()
            peaks["one_after_another"] = max(peaks["one_after_another"], peak_gib(dev))
            alone = [e.adapter_state() for e in engines]
            restore(engines, before)
            reset_peak(dev)
            t2 = time.perf_counter()
            engines[0].train_together([(e, b, step) for e, b in zip(engines, batches)])
            sync(dev)
            t3 = time.perf_counter()
            peaks["joint"] = max(peaks["joint"], peak_gib(dev))
            together = [e.adapter_state() for e in engines]
            diffs.append(max(float((a[k].float() - t[k].float()).abs().max()) for a, t in zip(alone, together)
                             for k in a))  # fmt: skip
            t4 = time.perf_counter()
            own = [e.canary() for e in engines]
            sync(dev)
            t5 = time.perf_counter()
            joint_canaries = engines[0].canary_together(engines)
            sync(dev)
            t6 = time.perf_counter()
            pairs = [(p, q) for a, b in zip(own, joint_canaries) for p, q in zip(a.sequences, b.sequences)]
            canary_diffs.append(max(abs(x - y) for p, q in pairs for x, y in zip(p.logprobs, q.logprobs)))
            if step:  # the first is a warm-up
                solo_s.append(t1 - t0)
                joint_s.append(t3 - t2)
                canary_s.append(t5 - t4)
                canary_joint_s.append(t6 - t5)
        del engines
        rows.append({
            "runs": n,
            "one_after_another_s": statistics.median(solo_s),
            "joint_s": statistics.median(joint_s),
            "speedup": statistics.median(solo_s) / statistics.median(joint_s),
            "max_adapter_diff": max(diffs),
            "canaries_one_after_another_s": statistics.median(canary_s),
            "canaries_together_s": statistics.median(canary_joint_s),
            "max_canary_logprob_diff": max(canary_diffs),
            "peak_gib": peaks if dev.type == "cuda" else None,
        })  # fmt: skip
        r = rows[-1]
        print(f"{n} runs: one after another {r['one_after_another_s'] * 1e3:8.1f} ms, joint "
              f"{r['joint_s'] * 1e3:8.1f} ms, {r['speedup']:.2f}x, max |adapter diff| {r['max_adapter_diff']:.2e}; "
              f"canaries {r['canaries_one_after_another_s'] * 1e3:.1f} ms one by one, "
              f"{r['canaries_together_s'] * 1e3:.1f} ms in one decode", flush=True)  # fmt: skip
    result = {
        "device": device_name(dev),
        "torch": torch.__version__,
        "model": name,
        "dtype": dtype,
        "run_shapes": [{"rank": r, "targets": t} for r, t in RUN_SHAPES],
        "batch_per_run": batch | {"mb_spec_max_tokens": args.mb_tokens},
        "steps": args.steps,
        "rows": rows,
    }
    print(
        "| runs | one after another | joint step | speed-up | max \\|adapter diff\\| | peak GiB (alone / joint) "
        "| canaries one by one / together |"
    )
    print("|---:|---:|---:|---:|---:|---|---|")
    for r in rows:
        p = r["peak_gib"]
        peak = "-" if p is None else f"{p['one_after_another']:.1f} / {p['joint']:.1f}"
        print(f"| {r['runs']} | {r['one_after_another_s'] * 1e3:.1f} ms | {r['joint_s'] * 1e3:.1f} ms | "
              f"{r['speedup']:.2f}x | {r['max_adapter_diff']:.1e} | {peak} | "
              f"{r['canaries_one_after_another_s'] * 1e3:.1f} / {r['canaries_together_s'] * 1e3:.1f} ms |")  # fmt: skip
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
