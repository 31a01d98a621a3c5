"""The whole `lorabus up` loop on one GPU: trainer, two embedded replicas and the evaluator.

    python benchmarks/gpu_loop.py --out-dir benchmarks/results            # CUDA: tiny, 1.5B, 7B
    python benchmarks/gpu_loop.py --shapes tiny --cpu --steps 3 --out-dir /tmp/loop   # smoke

Each run is `python -m services.local.launcher` as a user starts it (examples/tiny.yaml with
device overrides), on a nats-server this script starts so that it can watch the run's events.
Shapes: the tiny task's own model, and Llama models with Qwen2.5-1.5B / -7B dimensions and
random bf16 weights built from a config (`benchmarks/shapes.py`; nothing downloaded), all with
the tiny task's byte-level tokenizer and prompts. Reported per run:
- trainer: step time (median, first step excluded) and tokens/s as the trainer counts them;
- rollout: completion tokens/s per replica while generating, and over the run;
- GPU memory per process (peak, `nvidia-smi --query-compute-apps`);
- adapter propagation from "the trainer holds the new adapter" to "every replica serves it",
  by stage: the trainer's announce (serialize, store, event; its checkpoint follows the event)
  from trainer.log, the event's trip to each replica, and the replica's fetch / parse / h2d /
  copy / merge from the rollout logs;
- the evaluator on the GPU: scores per version, and how long `lorabus up` waited for it.
Writes gpu_loop.json and gpu_loop.md into --out-dir.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.shapes import write_model_dir
from proto import messages as m
from proto import subjects

RUNS = {
    # shape: (model dir or None for examples/tiny/model, steps, extra overrides)
    "tiny": (None, 12, ["actor.dtype=float32", "rollout.dtype=float32"]),
    "qwen2.5-1.5b": (
        "qwen2.5-1.5b",
        8,
        ["gconfig.max_new_tokens=64", "actor.lora_rank=16", "actor.lora_alpha=32", "evaluator.max_prompts=128"],
    ),
    "qwen2.5-7b": (
        "qwen2.5-7b",
        5,
        [
            "gconfig.max_new_tokens=64",
            "actor.lora_rank=16",
            "actor.lora_alpha=32",
            "evaluator.max_prompts=64",
            "evaluator.versions=newest",
            "actor.gradient_checkpointing=true",
        ],
    ),
}
GPU = [
    "actor.device=cuda",
    "rollout.device=cuda",
    "evaluator.device=cuda",
    "actor.dtype=bfloat16",
    "rollout.dtype=bfloat16",
]
SERVABLE = re.compile(
    r"^(?P<clock>\S+) INFO (?P<proc>\S+) \S+: rollout (?P<replica>\S+): \S+-v(?P<v>\d+) servable in "
    r"(?P<total>[\d.]+) ms \(fetch (?P<fetch>[\d.]+), parse (?P<parse>[\d.]+), h2d (?P<h2d>[\d.]+), "
    r"copy (?P<copy>[\d.]+), merge (?P<merge>[\d.]+) ms(?:; verify (?P<verify>[\d.]+) ms beside them)?\)"
)
PUBLISHED = re.compile(
    r"v(?P<v>\d+) announced in (?P<announce>[\d.]+) ms; checkpoint and step event (?P<after>[\d.]+) ms after"
)


class Watch:
    """What the benchmark reads off the bus during one run."""

    def __init__(self) -> None:
        self.steps: list[m.TrainerStep] = []
        self.trajectories: list[m.Trajectory] = []
        self.ready: dict[int, m.AdapterReady] = {}
        self.loaded: list[m.AdapterLoaded] = []

    async def attach(self, url: str, run: str):
        from services.common.bus import Bus
        from services.config.schema import BusConfig

        bus = await Bus.connect(BusConfig(url=url), run=run, service="gpu-loop-bench")

        async def on_step(msg, _):
            self.steps.append(msg)

        async def on_traj(msg, _):
            self.trajectories.append(msg)

        async def on_ready(msg, _):
            self.ready[msg.version] = msg

        async def on_report(msg, _):
            if isinstance(msg, m.AdapterLoaded):
                self.loaded.append(msg)

        await bus.subscribe(subjects.trainer_step(run), m.TrainerStep, on_step)
        await bus.subscribe(subjects.trajectory_all(run), m.Trajectory, on_traj)
        await bus.subscribe(subjects.adapter_ready_all(run), m.AdapterReady, on_ready)
        await bus.subscribe(subjects.rollout_report_all(run), m.RolloutReport, on_report)
        return bus


def gpu_memory_by_pid() -> tuple[dict[int, int], int]:
    """({pid: MiB}, MiB used on the GPU in all)."""
    try:
        apps = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
        total = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}, 0
    per = {}
    for line in apps.splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip().isdigit() and mib.strip().isdigit():
            per[int(pid)] = int(mib)
    used = int(total.split()[0]) if total.split() and total.split()[0].isdigit() else 0
    return per, used


def med(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 3) if xs else None


async def run_one(name: str, args: argparse.Namespace, nats_url: str, work: Path) -> dict:
    model_dir, steps, extra = RUNS[name]
    steps = args.steps or steps
    run_dir = work / f"run-{name}"
    overrides = [
        f"run_dir={run_dir}",
        f"total_train_steps={steps}",
        "experiment_name=gpuloop",
        f"trial_name={name.replace('.', '_')}",
        "evaluator.max_wait_s=60",
        *extra,
    ]
    if model_dir is not None:
        t0 = time.perf_counter()
        path = write_model_dir(model_dir, work / "models" / model_dir)
        print(f"{name}: model directory ready in {time.perf_counter() - t0:.1f}s", flush=True)
        overrides.append(f"actor.path={path}")
    if not args.cpu:
        overrides += [o for o in GPU if not (name == "tiny" and "dtype" in o)]
    run = f"gpuloop-{name.replace('.', '_')}"
    watch = Watch()
    bus = await watch.attach(nats_url, run)
    cmd = [
        sys.executable,
        "-m",
        "services.local.launcher",
        "--config",
        "examples/tiny.yaml",
        "--bus-url",
        nats_url,
        "--timeout",
        str(args.run_timeout),
        "--progress-every",
        "5",
        *overrides,
    ]
    started = time.monotonic()
    proc = await asyncio.create_subprocess_exec(*cmd, cwd=REPO, stdout=sys.stdout, stderr=sys.stderr)
    peak: dict[str, int] = {}
    peak_total = 0
    while proc.returncode is None:
        per, used = await asyncio.to_thread(gpu_memory_by_pid)
        peak_total = max(peak_total, used)
        pids_file = run_dir / "pids.json"
        if pids_file.exists():
            try:
                pids = json.loads(pids_file.read_text())
            except json.JSONDecodeError:
                pids = {}
            for child, pid in pids.items():
                if pid in per:
                    peak[child] = max(peak.get(child, 0), per[pid])
        try:
            await asyncio.wait_for(proc.wait(), 1.0)
        except TimeoutError:
            pass
    wall = time.monotonic() - started
    await asyncio.sleep(0.5)
    await bus.close()
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    return report(name, steps, proc.returncode, wall, watch, run_dir, summary, peak, peak_total)


def report(name, steps, rc, wall, watch: Watch, run_dir: Path, summary, peak, peak_total) -> dict:
    later = [s for s in watch.steps if s.step > 0] or watch.steps
    step_s = [s.step_seconds for s in later]
    tokens = sum(s.tokens for s in later)
    replicas: dict[str, dict] = {}
    for t in watch.trajectories:
        r = replicas.setdefault(t.replica, {"tokens": 0, "batches": set(), "first": t.started_at, "last": 0.0})
        r["tokens"] += sum(len(c.token_ids) for c in t.completions)
        r["batches"].add((t.started_at, t.finished_at))
        r["first"] = min(r["first"], t.started_at)
        r["last"] = max(r["last"], t.finished_at)
    rollout = {}
    for rep, r in sorted(replicas.items()):
        busy = sum(end - start for start, end in r["batches"])
        span = max(r["last"] - r["first"], 1e-9)
        rollout[rep] = {
            "completion_tokens": r["tokens"],
            "tok_per_s_generating": round(r["tokens"] / max(busy, 1e-9), 1),
            "tok_per_s_over_run": round(r["tokens"] / span, 1),
            "batches": len(r["batches"]),
        }
    # propagation: event -> servable on each replica; the slowest replica decides "every replica"
    trip, every = [], []
    for v, ev in watch.ready.items():
        if v == 0:
            continue  # v0 loads while replicas start up
        loads = [x for x in watch.loaded if x.version == v]
        for x in loads:
            trip.append(x.loaded_at - ev.created_at)
        if len(loads) >= 2:
            every.append(max(x.loaded_at for x in loads) - ev.created_at)
    stages: dict[str, list[float]] = {}
    for log in sorted(run_dir.glob("rollout-*.log")):
        for line in log.read_text(errors="replace").splitlines():
            hit = SERVABLE.match(line)
            if hit and int(hit["v"]) > 0:
                for k in ("total", "fetch", "parse", "h2d", "copy", "merge", "verify"):
                    if hit[k] is not None:
                        stages.setdefault(k, []).append(float(hit[k]))
    trainer_stages: dict[str, list[float]] = {}
    trainer_log = run_dir / "trainer.log"
    if trainer_log.exists():
        for hit in PUBLISHED.finditer(trainer_log.read_text(errors="replace")):
            for k in ("announce", "after"):
                trainer_stages.setdefault(k, []).append(float(hit[k]))
    return {
        "run": name,
        "exit_code": rc,
        "wall_s": round(wall, 1),
        "trainer_steps": len(watch.steps),
        "steps_planned": steps,
        "trainer_step_s_median": med(step_s),
        "trainer_tokens_per_s": round(tokens / sum(step_s), 1) if step_s and sum(step_s) else None,
        "rollout": rollout,
        "gpu_memory_peak_mib": peak,
        "gpu_memory_peak_total_mib": peak_total,
        "propagation_ms_median": {
            "trainer_publish": {k: med(v) for k, v in trainer_stages.items()},
            "event_to_servable_per_replica": med([x * 1e3 for x in trip]),
            "event_to_every_replica": med([x * 1e3 for x in every]),
            "replica_stages": {k: med(v) for k, v in stages.items()},
        },
        "eval_by_version": summary.get("eval_by_version", {}),
        "eval_unscored": summary.get("eval_unscored"),
        "eval_waited_s": summary.get("eval_waited_s"),
        "trajectories": summary.get("trajectories"),
    }


def markdown(results: list[dict], device: str) -> str:
    lines = [
        f"# `lorabus up` on one GPU ({device})",
        "",
        "Trainer + 2 embedded replicas + evaluator, all on the one GPU (`benchmarks/gpu_loop.py`).",
        "",
        "| run | steps | wall s | trainer step s (median) | trainer tok/s | rollout tok/s per replica "
        "(generating) | GPU MiB per process (peak) | event → every replica ms | replica load ms "
        "(fetch/parse/h2d/copy/merge) | trainer: announce ms (serialize, store, event); checkpoint after | eval |",
        "|" + "---|" * 11,
    ]
    for r in results:
        p = r["propagation_ms_median"]
        st = p["replica_stages"]
        ts = p["trainer_publish"]
        rollout = ", ".join(f"{k}: {v['tok_per_s_generating']:.0f}" for k, v in r["rollout"].items()) or "-"
        mem = ", ".join(f"{k}: {v}" for k, v in sorted(r["gpu_memory_peak_mib"].items())) or (
            f"all: {r['gpu_memory_peak_total_mib']}"
        )
        stages = (
            f"{st.get('total')} ({st.get('fetch')}/{st.get('parse')}/{st.get('h2d')}/{st.get('copy')}/"
            f"{st.get('merge')}; verify {st.get('verify')})"
            if st
            else "-"
        )
        trainer = f"{ts.get('announce')}; {ts.get('after')}" if ts else "-"
        evals = r["eval_by_version"]
        ev = ", ".join(f"v{k}: {v:.3f}" for k, v in list(evals.items())[:6]) or "-"
        if r["eval_unscored"]:
            ev += f"; unscored {r['eval_unscored']} after {r['eval_waited_s']} s"
        lines.append(
            f"| {r['run']} | {r['trainer_steps']}/{r['steps_planned']} | {r['wall_s']} | "
            f"{r['trainer_step_s_median']} | {r['trainer_tokens_per_s']} | {rollout} | {mem} | "
            f"{p['event_to_every_replica']} | {stages} | {trainer} | {ev} |"
        )
    return "\n".join(lines) + "\n"


async def main_async(args: argparse.Namespace) -> int:
    from services.local.nats_server import start_nats_server

    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    nats = start_nats_server(work / "nats")
    device = "cpu"
    if not args.cpu:
        import torch

        device = torch.cuda.get_device_name()
    results = []
    try:
        for name in args.shapes.split(","):
            try:
                results.append(await run_one(name, args, nats.url, work))
            except Exception as exc:  # keep the other runs' figures
                results.append({"run": name, "error": repr(exc)})
            print(json.dumps(results[-1], indent=2), flush=True)
            args.out_dir.mkdir(parents=True, exist_ok=True)
            (args.out_dir / "gpu_loop.json").write_text(json.dumps({"device": device, "runs": results}, indent=2))
    finally:
        nats.stop()
    ok = [r for r in results if "error" not in r]
    (args.out_dir / "gpu_loop.md").write_text(markdown(ok, device))
    print(markdown(ok, device))
    return 0 if all(r.get("exit_code") == 0 for r in results) else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="tiny,qwen2.5-1.5b,qwen2.5-7b")
    ap.add_argument("--steps", type=int, default=0, help="trainer steps per run (0: each run's own)")
    ap.add_argument("--cpu", action="store_true", help="leave the configs on the CPU (smoke run)")
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--work-dir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "lorabus-gpu-loop")
    ap.add_argument("--run-timeout", type=float, default=400.0)
    return asyncio.run(main_async(ap.parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
