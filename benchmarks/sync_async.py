"""Synchronous vs asynchronous RL: wall-clock to a fixed held-out score, k = 0, 1, 2, 4.

    python benchmarks/sync_async.py [--steps 40] [--targets 0.43 0.48 0.5] [--ks 0 1 2 4]
        [--out benchmarks/results/sync_async.json]

One `lorabus up` per k on the tiny task (examples/tiny.yaml, every service its own process,
the evaluator on), one after the other on this machine in one invocation, so the four are
measured side by side. k = `rollout.max_head_offpolicyness`: 0 is synchronous (a version's
samples all come from it; the rollouts wait while the trainer steps), larger k lets the
rollouts run ahead of the trainer by up to k versions.

Time to score: from the announcement of v0 to the announcement of the first version whose
greedy held-out score (the evaluator's, on the fixed 500-prompt set) reaches each target; both
times are the trainer's `AdapterReady.created_at`, read back from the run's streams, so the
evaluator's own lag and the processes' start-up are not counted. Also reported: steps to the
target, seconds per step, the best score, rejected-stale trajectories. Writes the JSON and a
PNG (held-out score against wall-clock, one line per k) beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from proto import messages as m
from services.common import streams
from services.common.bus import Bus
from services.config.schema import BusConfig
from services.local.nats_server import start_nats_server

RUN = "tiny-trial0"


def run_up(k: int, steps: int, run_dir: Path) -> float:
    cmd = [sys.executable, "-m", "services.local.launcher", "--config", "examples/tiny.yaml",
           "--timeout", "1200", "--progress-every", "30", f"run_dir={run_dir}",
           f"total_train_steps={steps}", f"rollout.max_head_offpolicyness={k}"]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"k={k}: lorabus up failed:\n{proc.stdout[-3000:]}")
    return time.monotonic() - t0


async def read(run_dir: Path) -> tuple[dict[int, float], dict[int, float], dict[str, int]]:
    """(version -> announced at, version -> held-out score, verdict counts) from the streams."""
    server = start_nats_server(run_dir / "nats")
    bus = await Bus.connect(BusConfig(url=server.url), run=RUN, service="bench")
    try:
        ready: list[m.AdapterReady] = await bus.read_all(streams.ADAPTERS(RUN), m.AdapterReady)
        evals: list[m.EvalResult] = await bus.read_all(streams.EVALS(RUN), m.EvalResult)
        decisions: list[m.TrajectoryDecision] = await bus.read_all(streams.DECISIONS(RUN), m.TrajectoryDecision)
    finally:
        await bus.close()
        server.close()
    first: dict[str, str] = {}
    for d in decisions:
        first.setdefault(d.trajectory_id, d.verdict)
    verdicts: dict[str, int] = {}
    for v in first.values():
        verdicts[v] = verdicts.get(v, 0) + 1
    return {e.version: e.created_at for e in ready}, {e.version: e.score for e in evals}, verdicts


def measure(k: int, steps: int, targets: list[float], scratch: Path) -> dict:
    run_dir = scratch / f"k{k}"
    wall = run_up(k, steps, run_dir)
    announced, scores, verdicts = asyncio.run(read(run_dir))
    t0 = announced[0]
    span = announced[max(announced)] - t0
    to_target = {}
    for target in targets:
        reached = next((v for v in sorted(scores) if scores[v] >= target and v in announced), None)
        to_target[str(target)] = {
            "seconds": None if reached is None else round(announced[reached] - t0, 2),
            "steps": reached,
        }
    return {
        "k": k,
        "to_target": to_target,
        "best_score": max(scores.values()),
        "v0_score": scores[0],
        "s_per_step": round(span / max(max(announced), 1), 3),
        "launcher_wall_s": round(wall, 1),
        "trajectories": verdicts,
        "curve": [[round(announced[v] - t0, 2), scores[v]] for v in sorted(scores) if v in announced],
    }


def plot(results: list[dict], targets: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in results:
        xs, ys = zip(*r["curve"])
        ax.plot(xs, ys, marker=".", label=f"k = {r['k']}" + (" (synchronous)" if r["k"] == 0 else ""))
    for target in targets:
        ax.axhline(target, color="grey", linestyle="--", linewidth=0.8)
    ax.set_xlabel("seconds since v0 was announced")
    ax.set_ylabel("held-out score (greedy, 500 prompts)")
    ax.set_title("tiny task: held-out score against wall-clock, by max_head_offpolicyness")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--targets", type=float, nargs="+", default=[0.43, 0.48, 0.5])
    p.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2, 4])
    p.add_argument("--out", default="benchmarks/results/sync_async.json")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="sync-async-") as tmp:
        results = [measure(k, args.steps, args.targets, Path(tmp)) for k in args.ks]
    print(f"\nseconds (steps) to a held-out score on the tiny task ({args.steps} steps per run)")
    print(
        f"{'k':>3} "
        + " ".join(f"{'>= ' + str(t):>12}" for t in args.targets)
        + f" {'s/step':>7} {'best':>6} {'stale':>6}"
    )
    for r in results:
        cells = []
        for t in args.targets:
            hit = r["to_target"][str(t)]
            cells.append("-" if hit["seconds"] is None else f"{hit['seconds']:.1f} ({hit['steps']})")
        stale = r["trajectories"].get("rejected-stale", 0)
        print(f"{r['k']:>3} " + " ".join(f"{c:>12}" for c in cells)
              + f" {r['s_per_step']:>7.2f} {r['best_score']:>6.3f} {stale:>6}")  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "benchmark": "sync_async",
        "task": "examples/tiny.yaml",
        "steps": args.steps,
        "targets": args.targets,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_avg_1m": os.getloadavg()[0]},
        "results": results,
    }
    out.write_text(json.dumps(doc, indent=2))
    plot(results, args.targets, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
