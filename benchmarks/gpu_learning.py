"""Learning you can see at GPU scale: pre-train the arith3 base, then RL it with `lorabus up`.

    python benchmarks/gpu_learning.py --out-dir benchmarks/results     # CUDA, ~5 min on an H200
    python benchmarks/gpu_learning.py --out-dir R --engine sglang --server-site /tmp/ssite --label sglang_bf16 \
        actor.dtype=bfloat16 rollout.dtype=bfloat16                       # SGLang rollouts (one server)
    python benchmarks/gpu_learning.py --out-dir /tmp/gl --tiny --engine vllm --steps 10   # CPU check

`--engine vllm|sglang` runs the rollouts on one server that `lorabus up` starts (one replica,
16 groups per batch: what the two embedded replicas generate); `--server-site` is the `pip
--target` site of that engine (the carried parts, benchmarks/device/), put on the server's
PYTHONPATH only. `--tiny` runs examples/tiny.yaml (tiny_vllm.yaml for vLLM) on the CPU, no
pre-training: a check of this script and the launcher's path, not of learning at scale.

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
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TASK = REPO / "examples" / "arith3"
ENGINE_OVERRIDES = {
    "embedded": [],
    "vllm": ["rollout.engine=vllm", "rollout.replicas=1", "rollout.batch_groups=16"],
    "sglang": ["rollout.engine=sglang", "rollout.replicas=1", "rollout.batch_groups=16"],
}
SGLANG_ARGS = [
    "--attention-backend", "triton", "--mem-fraction-static", '"0.3"', "--cuda-graph-backend-prefill", "disabled",
]  # fmt: skip
"""the carried site has no FlashAttention 3 (benchmarks/device/sglang-site.sh); the trainer and
the evaluator share the GPU, so the server takes 30 % of it (arith3_gpu.yaml does so for vLLM);
prefill graphs cost 82 s of start-up on the H200 (sglang_smoke_h200.log) for prompts of a few
dozen tokens here, so only decode is graphed (as --enforce-eager saves vLLM's start)"""


def sglang_override(overrides: list[str]) -> str:
    """sglang.extra_args for the run: its dtype the rollouts' (rollout.dtype=... if given)."""
    dtype = next((o.split("=", 1)[1] for o in overrides if o.startswith("rollout.dtype=")), "auto")
    return f"sglang.extra_args=[--dtype, {dtype}, {', '.join(SGLANG_ARGS)}]"


TINY_OVERRIDES = {
    "embedded": [],
    "vllm": [],
    "sglang": ["rollout.engine=sglang", "rollout.replicas=1", "sglang.max_lora_rank=8"],
}
VIA = re.compile(r"loaded \S+-v(\d+) via (xccl|object)")


def load_paths(run_dir: Path) -> dict:
    """How each replica's versions arrived (xccl or object, from its log) and the trainer's
    XCCL group lines: what tells a broadcast that silently fell back (docs/xccl.md)."""
    via: dict[str, dict[str, int]] = {}
    for log in sorted(run_dir.glob("rollout-*.log")):
        counts = {"xccl": 0, "object": 0}
        for _, path in VIA.findall(log.read_text(errors="replace")):
            counts[path] += 1
        via[log.stem] = counts
    trainer = run_dir / "trainer.log"
    lines = [x for x in trainer.read_text(errors="replace").splitlines() if "xccl" in x] if trainer.exists() else []
    return {
        "loads_by_path": via,
        "trainer_xccl_lines": lines[:12] + (["..."] + lines[-4:] if len(lines) > 16 else lines[12:]),
    }


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
    ap.add_argument("--engine", choices=sorted(ENGINE_OVERRIDES), default="embedded", help="the rollout engine")
    ap.add_argument("--server-site", default=None, help="pip --target site of vLLM/SGLang (the server's only)")
    ap.add_argument("--sglang-python", default=None, help="a python that has SGLang (default python3)")
    ap.add_argument("--tiny", action="store_true", help="examples/tiny.yaml on the CPU, no pre-training")
    ap.add_argument("overrides", nargs="*", help="config overrides for lorabus up")
    args = ap.parse_args(argv)
    args.run_dir = args.run_dir or Path(f"/tmp/lorabus-arith3{'-' + args.label if args.label else ''}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    if args.tiny:
        config = "examples/tiny_vllm.yaml" if args.engine == "vllm" else "examples/tiny.yaml"
        engine_overrides, pretrain = TINY_OVERRIDES[args.engine], {}
    else:
        if not (TASK / "model" / "config.json").exists():
            rc = run([sys.executable, "scripts/make_arith3_task.py"], args.out_dir / "gpu_learning_pretrain.log")
            if rc != 0:
                return rc
        config, engine_overrides = "examples/arith3_gpu.yaml", ENGINE_OVERRIDES[args.engine]
        if args.engine == "sglang":
            engine_overrides = [*engine_overrides, sglang_override(args.overrides)]
        pretrain = json.loads((TASK / "pretrain_metrics.json").read_text())
    pretrain_s = time.monotonic() - started
    server_flags = [f"--server-site={args.server_site}"] if args.server_site else []
    server_flags += [f"--sglang-python={args.sglang_python}"] if args.sglang_python else []
    cmd = [
        sys.executable,
        "-m",
        "services.local.launcher",
        "--config",
        config,
        *server_flags,
        "--timeout",
        str(args.timeout),
        "--progress-every",
        "10",
        f"run_dir={args.run_dir}",
        *([f"total_train_steps={args.steps}"] if args.steps else []),
        *engine_overrides,
        *args.overrides,
    ]
    t0 = time.monotonic()
    stem = f"gpu_learning_{args.label}" if args.label else "gpu_learning"
    rc = run(cmd, args.out_dir / f"{stem}_rl.log")
    rl_s = time.monotonic() - t0
    summary_path = args.run_dir / "summary.json"
    if not summary_path.exists():  # the launcher stopped before the run (a server never came up)
        result = {"exit_code": rc, "engine": args.engine, "error": f"no summary; see {stem}_rl.log"}
        (args.out_dir / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result, indent=2))
        return rc or 1
    summary = json.loads(summary_path.read_text())
    curve = {int(v): s for v, s in summary["eval_by_version"].items()}
    rewards = {int(v): r for v, r in summary["reward_by_version"].items()}
    base = curve.get(0)
    result = {
        "exit_code": rc,
        "engine": args.engine,
        "overrides": [*engine_overrides, *args.overrides],
        "pretrain": pretrain,
        "pretrain_wall_s": round(pretrain_s, 1),
        "rl_wall_s": round(rl_s, 1),
        "rl_steps": summary["trainer_steps"],
        "heldout_by_version": curve,
        "train_reward_by_version": rewards,
        "trajectories": summary["trajectories"],
        "max_accepted_staleness": summary["max_accepted_staleness"],
        "eval_unscored": summary.get("eval_unscored"),
        "restarts": summary.get("restarts"),
        # issue 28: the k3 KL and |Δ logprob| of behaviour against trainer logprobs (on-policy tokens:
        # each version's own gap; run with rollout.merge_head=false for the unmerged embedded figure),
        # and the canary's seconds on both sides and its share of each version's time to servable
        "train_infer_mismatch": summary.get("train_infer_mismatch"),
        "canary": summary.get("canary"),
        **load_paths(args.run_dir),
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
