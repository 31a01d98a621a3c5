"""Learning you can see at GPU scale: pre-train the arith3 base, then RL it with `lorabus up`.

    python benchmarks/gpu_learning.py --out-dir benchmarks/results     # CUDA, ~5 min on an H200

1. `scripts/make_arith3_task.py` (unless the model exists): three-digit addition/subtraction,
   an ~85 M-parameter Llama pre-trained until its greedy held-out accuracy first reaches 0.3.
2. `lorabus up --config examples/arith3_gpu.yaml`: trainer, two embedded replicas and the
   evaluator on the one GPU; the evaluator scores v0 and every 5th version greedily on the 500
   held-out prompts.
3. Writes gpu_learning.json (the curve, the margin over v0 and its size in standard errors)
   and gpu_learning.png.

Why a rise cannot be chance: v0 is the base model exactly (LoRA B = 0) and the evaluator decodes
greedily on a fixed held-out set, so every score is a deterministic function of the weights;
the held-out prompts are never trained on. The standard error printed is that of an accuracy
on 500 prompts, sqrt(p (1 - p) / 500): the spread a *different* held-out sample of the same
size would show, so a margin of many standard errors is a property of the model, not of which
500 problems were drawn.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TASK = REPO / "examples" / "arith3"


def run(cmd: list[str], log: Path) -> int:
    print("+", " ".join(cmd), flush=True)
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            f.write(line)
        return proc.wait()


def plot(curve: dict[int, float], rewards: dict[int, float], base: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(list(curve), list(curve.values()), "o-", label="held-out greedy accuracy (500 prompts)")
    ax.plot(list(rewards), list(rewards.values()), ".-", alpha=0.5, label="training reward (sampled, T=1)")
    se = math.sqrt(base * (1 - base) / 500)
    ax.axhspan(base - 2 * se, base + 2 * se, color="grey", alpha=0.2, label="v0 ± 2 standard errors")
    ax.set_xlabel("adapter version (trainer steps)")
    ax.set_ylabel("accuracy / reward")
    ax.set_title("lorabus up on one H200: arith3 (3-digit +/-), 85 M base, LoRA r=16")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=0, help="RL steps (0: the config's)")
    ap.add_argument("--run-dir", type=Path, default=None, help="default /tmp/lorabus-arith3[-<label>]")
    ap.add_argument("--timeout", type=float, default=420.0)
    ap.add_argument("--label", default="", help="name the files gpu_learning_<label>.* (one per engine or setting)")
    ap.add_argument("overrides", nargs="*", help="config overrides for lorabus up")
    args = ap.parse_args(argv)
    args.run_dir = args.run_dir or Path(f"/tmp/lorabus-arith3{'-' + args.label if args.label else ''}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    if not (TASK / "model" / "config.json").exists():
        rc = run([sys.executable, "scripts/make_arith3_task.py"], args.out_dir / "gpu_learning_pretrain.log")
        if rc != 0:
            return rc
    pretrain = json.loads((TASK / "pretrain_metrics.json").read_text())
    pretrain_s = time.monotonic() - started
    cmd = [
        sys.executable,
        "-m",
        "services.local.launcher",
        "--config",
        "examples/arith3_gpu.yaml",
        "--timeout",
        str(args.timeout),
        "--progress-every",
        "10",
        f"run_dir={args.run_dir}",
        *([f"total_train_steps={args.steps}"] if args.steps else []),
        *args.overrides,
    ]
    t0 = time.monotonic()
    stem = f"gpu_learning_{args.label}" if args.label else "gpu_learning"
    rc = run(cmd, args.out_dir / f"{stem}_rl.log")
    rl_s = time.monotonic() - t0
    summary = json.loads((args.run_dir / "summary.json").read_text())
    curve = {int(v): s for v, s in summary["eval_by_version"].items()}
    rewards = {int(v): r for v, r in summary["reward_by_version"].items()}
    base = curve.get(0)
    result = {
        "exit_code": rc,
        "overrides": args.overrides,
        "pretrain": pretrain,
        "pretrain_wall_s": round(pretrain_s, 1),
        "rl_wall_s": round(rl_s, 1),
        "rl_steps": summary["trainer_steps"],
        "heldout_by_version": curve,
        "train_reward_by_version": rewards,
        "trajectories": summary["trajectories"],
        "max_accepted_staleness": summary["max_accepted_staleness"],
        "eval_unscored": summary.get("eval_unscored"),
    }
    if base is not None and len(curve) > 1:
        last = max(curve)
        late = [curve[v] for v in sorted(curve)[-3:]]
        se = math.sqrt(base * (1 - base) / 500)
        result.update(
            {
                "v0": base,
                "final_version": last,
                "final": curve[last],
                "margin_final": round(curve[last] - base, 4),
                "margin_best_of_last_3": round(max(late) - base, 4),
                "standard_error_v0": round(se, 4),
                "margin_final_in_standard_errors": round((curve[last] - base) / se, 1) if se else None,
            }
        )
        try:
            plot(curve, rewards, base, args.out_dir / f"{stem}.png")
        except ImportError as exc:
            result["plot_error"] = repr(exc)
    (args.out_dir / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "pretrain"}, indent=2))
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
