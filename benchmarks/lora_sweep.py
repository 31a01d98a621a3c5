"""LoRA rank x learning rate: final and best held-out score of RL on one task, per cell.

    python benchmarks/lora_sweep.py --task arith3 [--ranks 1 8 32] [--lrs 3e-5 1e-4 3e-4]
        [--steps 80] [--seed 1] [--alpha 32] [--max-wall-s 540] [--report-only] [override ...]
    python benchmarks/lora_sweep.py --task tiny --ranks 1 8 --lrs 1e-3 --steps 3     # CPU check

One `lorabus up` per (rank, learning rate), one after the other, everything else as the task
has it (arith3: examples/arith3_gpu.yaml in bf16, k = 2, 80 steps, the evaluator greedy on the
500 held-out prompts every 5th version and at the last). lora_alpha stays the config's for every
rank (32 on arith3), so the adapter's scale alpha/r shrinks as r grows: with B starting at zero
and Adam's normalised steps, the first updates of B A then move the weights by about the same
amount at every rank, and the learning rate means the same thing across a row.

The default learning rates centre on arith3's working 1e-4 (0.600 -> 0.742 in fp32, 0.598 ->
0.744 in bf16, r = 16) a half-decade either side; at 1e-3 an arith3 run collapsed (held-out
0.58 at v5, 0.10 at v80: results/gpu_learning_h200_lr1e-3.json), so 1e-3 is left to --lrs.

Reported per cell: v0, final and best held-out score (and the version of the best), training
seconds. A cell is marked `*` when its final score is within two standard errors of the best
cell's final: the standard error of the difference of two accuracies on the same 500 prompts
taken as if independent, sqrt(2 p (1 - p) / 500) at the best cell's p (about 0.028 at 0.74),
i.e. settings this one held-out set cannot tell apart from the best. Writes the JSON and a
heatmap PNG of the final scores; each cell is also written to <out>_runs/ as it ends, and a
rerun with the same settings skips the recorded ones (benchmarks/sync_async.py does the same).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import rl_runs

DEFAULTS = {
    "tiny": {"lrs": [3e-4, 1e-3, 3e-3], "out": "benchmarks/results/lora_sweep_tiny.json"},
    "arith3": {"lrs": [3e-5, 1e-4, 3e-4], "out": "benchmarks/results/lora_sweep_arith3.json"},
}


def cell_name(rank: int, lr: float) -> str:
    return f"r{rank}_lr{lr:g}"


def table(grid: dict, ranks: list[int], lrs: list[float], task: str, steps: int) -> None:
    print(f"\n{task}: held-out score after {steps} steps, final / best (version of the best); "
          f"* = within 2 standard errors of the best final {grid['best_final']:.3f}")  # fmt: skip
    head = ["rank \\ lr", *(f"{lr:g}" for lr in lrs)]
    rows = []
    for r in ranks:
        row = [str(r)]
        for lr in lrs:
            c = grid["cells"].get(cell_name(r, lr))
            row.append("not run" if c is None else
                       f"{c['final_score']:.3f} / {c['best_score']:.3f} (v{c['best_version']})"
                       + (" *" if c["matches_best"] else ""))  # fmt: skip
        rows.append(row)
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    for row in [head, *rows]:
        print("  ".join(f"{x:>{w}}" for x, w in zip(row, widths)))


def plot(grid: dict, ranks: list[int], lrs: list[float], task: str, steps: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = [[math.nan] * len(lrs) for _ in ranks]
    for i, r in enumerate(ranks):
        for j, lr in enumerate(lrs):
            c = grid["cells"].get(cell_name(r, lr))
            if c is not None:
                values[i][j] = c["final_score"]
    fig, ax = plt.subplots(figsize=(1.6 * len(lrs) + 2.5, 0.9 * len(ranks) + 1.8))
    im = ax.imshow(values, cmap="viridis", aspect="auto")
    for i, r in enumerate(ranks):
        for j, lr in enumerate(lrs):
            c = grid["cells"].get(cell_name(r, lr))
            text = "-" if c is None else f"{c['final_score']:.3f}" + ("*" if c["matches_best"] else "")
            light = c is not None and im.norm(c["final_score"]) > 0.6  # viridis is yellow at the top
            ax.text(j, i, text, ha="center", va="center", color="k" if light else "white")
    ax.set_xticks(range(len(lrs)), [f"{lr:g}" for lr in lrs])
    ax.set_yticks(range(len(ranks)), [str(r) for r in ranks])
    ax.set_xlabel("learning rate")
    ax.set_ylabel("LoRA rank")
    ax.set_title(f"{task}: final held-out score after {steps} steps\n(* within 2 SE of the best)", fontsize=9)
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", choices=sorted(rl_runs.TASKS), default="arith3")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--lrs", type=float, nargs="+", default=None)
    p.add_argument("--steps", type=int, default=None, help="trainer steps per run (default: the task's)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--alpha", type=float, default=None, help="lora_alpha for every rank (default: the config's)")
    p.add_argument("--out", default=None)
    p.add_argument("--timeout", type=float, default=None, help="lorabus up's --timeout per run")
    p.add_argument("--max-wall-s", type=float, default=None, help="start no run after this many seconds")
    p.add_argument("--report-only", action="store_true", help="tabulate the recorded cells, run nothing")
    p.add_argument("overrides", nargs="*", help="config overrides for every run (after the task's)")
    args = p.parse_args()
    d = DEFAULTS[args.task]
    lrs = args.lrs or d["lrs"]
    steps = args.steps or rl_runs.TASKS[args.task].steps
    out = Path(args.out or d["out"])
    runs_dir = out.with_name(out.stem + "_runs")
    alpha = [f"actor.lora_alpha={args.alpha:g}"] if args.alpha else []
    settings = {"task": args.task, "steps": steps, "seed": args.seed, "overrides": [*alpha, *args.overrides]}
    cells = {
        cell_name(r, lr): [f"total_train_steps={steps}", f"seed={args.seed}", f"actor.seed={args.seed}",
                           f"actor.lora_rank={r}", f"actor.optimizer.lr={lr:g}", *alpha, *args.overrides]
        for r in args.ranks for lr in lrs
    }  # fmt: skip
    if not args.report_only:
        rl_runs.ensure_task(args.task, args.overrides, runs_dir)
        rl_runs.run_cells(list(cells.items()), args.task, runs_dir, settings, args.max_wall_s, args.timeout)
    runs = {r["name"]: r for r in rl_runs.recorded(runs_dir, settings) if r["name"] in cells}
    if not runs:
        raise SystemExit(f"no cell recorded in {runs_dir} with settings {settings}")
    best = max(runs.values(), key=lambda r: r["final_score"])
    p_best = best["final_score"]
    margin = 2 * math.sqrt(2 * p_best * (1 - p_best) / 500)
    grid: dict = {
        "best_cell": best["name"],
        "best_final": p_best,
        "two_se_of_difference": round(margin, 4),
        "cells": {},
    }
    for name, r in runs.items():
        grid["cells"][name] = {
            "rank": int(name.split("_")[0][1:]),
            "lr": float(name.split("_lr")[1]),
            "v0_score": r["v0_score"],
            "final_score": r["final_score"],
            "final_version": r["final_version"],
            "best_score": r["best_score"],
            "best_version": r["best_version"],
            "matches_best": p_best - r["final_score"] <= margin,
            "training_s": r["training_s"],
            "wall_s": r["wall_s"],
            "curve": [[v, s] for _, v, s in r["curve"]],
        }
    table(grid, args.ranks, lrs, args.task, steps)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "benchmark": "lora_sweep",
        "task": args.task,
        "config": rl_runs.TASKS[args.task].config,
        "task_overrides": list(rl_runs.TASKS[args.task].overrides),
        "settings": settings,
        "ranks": args.ranks,
        "lrs": lrs,
        "machines": rl_runs.machines(list(runs.values())),
        **grid,
    }
    out.write_text(json.dumps(doc, indent=1) + "\n")
    rl_runs.plot_or_say(plot, grid, args.ranks, lrs, args.task, steps, out.with_suffix(".png"))
    print(f"wrote {out}, {out.with_suffix('.png')} (runs in {runs_dir})")


if __name__ == "__main__":
    main()
