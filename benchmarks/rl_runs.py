"""One measured `lorabus up`: what benchmarks/sync_async.py (k x seeds) and
benchmarks/lora_sweep.py (rank x learning rate) run per cell, and how a cell is read back.

A run is started as a user starts it (`python -m services.local.launcher`, every service its own
process) in a fresh run directory, and read back afterwards from what the system records anyway:

  held-out curve     EvalResult per version (the evaluator's greedy score on the fixed held-out
                     set) at AdapterReady.created_at, the trainer's announcement of the version
  training           TrainerStep.step_seconds (the train step's own clock, ending in a GPU sync:
                     the loss and grad norm are read back), ending at TrainerStep.trained_at
                     where the trainer stamps it (the update's end); from trainers that do not,
                     at TrainerStep.finished_at less the publish time the trainer logs ("vN
                     announced in X ms"), so the adapter's copy out (milliseconds for a LoRA)
                     falls inside it
  publish            from there to AdapterReady.created_at: the version's canary where the
                     trainer computes one, the adapter's copy out, serialise, object store put
  load               from AdapterReady.created_at to the last replica's AdapterLoaded.loaded_at
  generation         each rollout batch's Trajectory.started_at..finished_at (taken grants to
                     generated tokens back on the host), per replica
  evaluator          the evaluator's log lines "vN heldout_reward=S (T s)"

Busy fractions are over the training window (v0's announcement to the last version's): the
fraction of wall-clock in which each side has work in flight on the GPU, not SM utilisation
(the trainer, both replicas and the evaluator time-share one GPU). The per-step breakdown
attributes every instant between two announcements to one thing, first that applies: training
and generation at once (overlap), training, generation, transfer (publish or load), idle; so the
parts of a step add up to the step's wall-clock. Idle is what no recorded activity covers: the
registry's admission and decisions, the trainer gathering its batch, grants not yet taken.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import gpu_learning
from proto import messages as m
from services.common import streams
from services.common.bus import Bus
from services.config.schema import BusConfig
from services.local.nats_server import start_nats_server


@dataclass(frozen=True)
class Task:
    config: str
    overrides: tuple[str, ...]
    """what every run of the task gets before the command line's overrides"""
    steps: int
    timeout_s: float
    """the launcher's --timeout per run"""
    maker: str | None = None
    """the script that makes the task's data and model (run once, `ensure_task`)"""
    made: str | None = None
    """the directory it makes them in"""


BF16 = ("actor.dtype=bfloat16", "rollout.dtype=bfloat16")
TASKS = {
    "tiny": Task("examples/tiny.yaml", (), 40, 1200.0),
    # bf16: 0.598 -> 0.744 in 80 steps, 37 s of `lorabus up` on an H100
    # (results/gpu_learning_embedded_bf16_h100.json)
    "arith3": Task("examples/arith3_gpu.yaml", BF16, 80, 300.0, "scripts/make_arith3_task.py", "examples/arith3"),
    # arith3's runs on scripts/make_chain_task.py's task: worked sums of 2-5 numbers, 18-64 new
    # tokens a rollout where arith3's are 3-4, so generation is most of a step
    "chain": Task(
        "examples/arith3_gpu.yaml",
        (
            *BF16,
            "experiment_name=chain",
            "actor.path=examples/chain/model",
            "train_dataset.path=examples/chain/data/train.jsonl",
            "valid_dataset.path=examples/chain/data/valid.jsonl",
            "train_dataset.reward_fn=services.common.rewards:numeric_final_answer",
            "gconfig.max_new_tokens=80",
        ),
        80,
        600.0,
        "scripts/make_chain_task.py",
        "examples/chain",
    ),  # fmt: skip
}
CATEGORIES = ("generation", "transfer", "training", "overlap", "idle")


def ensure_task(task: str, overrides: list[str], log_dir: Path) -> None:
    """Make the task (its `maker`) unless it is there. With `actor.path=` overridden on the
    command line (a CPU check on the tiny model) only its data files are made."""
    spec = TASKS[task]
    if spec.maker is None or spec.made is None:
        return
    data_only = any(o.startswith("actor.path=") for o in overrides)
    if (ROOT / spec.made / ("data/valid.jsonl" if data_only else "model/config.json")).exists():
        return
    log_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, spec.maker, *(["--data-only"] if data_only else [])]
    if gpu_learning.run(cmd, log_dir / f"{task}_task.log") != 0:
        raise SystemExit(f"making the {task} task failed: {log_dir / f'{task}_task.log'}")


def launch(config: str, overrides: list[str], run_dir: Path, timeout_s: float, log: Path) -> dict:
    """Run `lorabus up` to the end in a fresh `run_dir` (an old one would be resumed, or
    recognised as finished); its output goes to `log`."""
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "services.local.launcher", "--config", config, "--timeout", str(timeout_s),
           "--progress-every", "10", f"run_dir={run_dir}", *overrides]  # fmt: skip
    launched_at, t0 = time.time(), time.monotonic()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
    return {"rc": rc, "wall_s": time.monotonic() - t0, "launched_at": launched_at, "cmd": cmd}


@dataclass
class Record:
    run: str
    ready: dict[int, float]
    steps: list[m.TrainerStep]
    scores: dict[int, float]
    loaded: dict[tuple[str, int], float]
    """(replica, version) -> first loaded_at"""
    load_began: dict[tuple[str, int], float]
    """(replica, version) -> when that first load began (loaded_at less its load_seconds)"""
    batches: set[tuple[str, float, float]]
    """(replica, started_at, finished_at) of every generated batch"""
    verdicts: dict[str, int]


async def read_streams(run_dir: Path, run: str) -> Record:
    server = start_nats_server(run_dir / "nats")
    bus = await Bus.connect(BusConfig(url=server.url), run=run, service="bench")
    try:
        ready: list[m.AdapterReady] = await bus.read_all(streams.ADAPTERS(run), m.AdapterReady)
        steps: list[m.TrainerStep] = await bus.read_all(streams.TRAINER(run), m.TrainerStep)
        evals: list[m.EvalResult] = await bus.read_all(streams.EVALS(run), m.EvalResult)
        decisions: list[m.TrajectoryDecision] = await bus.read_all(streams.DECISIONS(run), m.TrajectoryDecision)
        reports: list[m.RolloutReport] = await bus.read_all(streams.REPORTS(run), m.RolloutReport)
        trajectories: list[m.Trajectory] = await bus.read_all(streams.TRAJECTORIES(run), m.Trajectory)
    finally:
        await bus.close()
        server.close()
    first: dict[str, str] = {}
    for d in decisions:
        first.setdefault(d.trajectory_id, d.verdict)
    verdicts: dict[str, int] = {}
    for v in first.values():
        verdicts[v] = verdicts.get(v, 0) + 1
    loaded: dict[tuple[str, int], float] = {}
    load_began: dict[tuple[str, int], float] = {}
    for r in reports:
        if isinstance(r, m.AdapterLoaded) and (r.replica, r.version) not in loaded:
            loaded[(r.replica, r.version)] = r.loaded_at
            load_began[(r.replica, r.version)] = r.loaded_at - r.load_seconds
    return Record(
        run=run,
        ready={e.version: e.created_at for e in ready},
        steps=list({s.step: s for s in steps}.values()),
        scores={e.version: e.score for e in evals if e.evaluator == "heldout"},
        loaded=loaded,
        load_began=load_began,
        batches={(t.replica, t.started_at, t.finished_at) for t in trajectories},
        verdicts=verdicts,
    )


ANNOUNCED = re.compile(r"v(\d+) announced in ([\d.]+) ms")
EVALUATED = re.compile(r"^(\d\d):(\d\d):(\d\d)\.(\d{3}) .* v(\d+) \S+=[-\d.]+ \(([\d.]+) s\)")


def log_times(run_dir: Path, anchor: float) -> tuple[dict[int, float], list[tuple[float, float]]]:
    """(version -> publish seconds from the trainer's log, evaluator intervals from its log).
    Log lines are stamped with the local time of day; `anchor` (a time.time() of the run) gives
    the date."""
    trainer = run_dir / "trainer.log"
    text = trainer.read_text(errors="replace") if trainer.exists() else ""
    publish = {int(v): float(ms) / 1e3 for v, ms in ANNOUNCED.findall(text)}
    base = dt.datetime.fromtimestamp(anchor)
    evals = []
    log = run_dir / "evaluator.log"
    for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
        hit = EVALUATED.match(line)
        if hit:
            h, mi, s, ms, _, took = hit.groups()
            at = base.replace(hour=int(h), minute=int(mi), second=int(s), microsecond=int(ms) * 1000)
            if (at - base).total_seconds() < -12 * 3600:  # the run crossed midnight
                at += dt.timedelta(days=1)
            end = at.timestamp()
            evals.append((end - float(took), end))
    return publish, evals


def union(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Seconds of [lo, hi] covered by any of `intervals`."""
    total, reach = 0.0, lo
    for a, b in sorted(intervals):
        a, b = max(a, reach), min(b, hi)
        if b > a:
            total += b - a
            reach = b
    return total


def attribute(lo: float, hi: float, train: list, gen: list, transfer: list) -> dict[str, float]:
    """Every instant of [lo, hi] given to the first category that applies (module docstring)."""
    near = [[(a, b) for a, b in side if b > lo and a < hi] for side in (train, gen, transfer)]
    cuts = sorted({lo, hi, *(x for side in near for iv in side for x in iv if lo < x < hi)})
    out = dict.fromkeys(CATEGORIES, 0.0)
    for a, b in zip(cuts, cuts[1:]):
        mid = (a + b) / 2
        t, g, x = (any(s <= mid < e for s, e in side) for side in near)
        out["overlap" if t and g else "training" if t else "generation" if g else "transfer" if x else "idle"] += b - a
    return out


def timeline(rec: Record, publish_s: dict[int, float], evals: list[tuple[float, float]]) -> dict:
    """Busy fractions over the training window and the per-step breakdown (module docstring)."""
    train, publish = [], []
    for s in rec.steps:
        created = rec.ready.get(s.version, s.finished_at)
        # getattr: trained_at is newer than some trainers whose streams this may read
        end = getattr(s, "trained_at", None) or s.finished_at - publish_s.get(s.version, 0.0)
        end = min(end, created)
        train.append((end - s.step_seconds, end))
        publish.append((end, created))
    replicas = sorted({r for r, _, _ in rec.batches})
    gen = [(a, b) for _, a, b in rec.batches]
    loads = {}  # version -> seconds from its announcement until every replica had loaded it
    for v, created in rec.ready.items():
        times = [rec.loaded[(r, v)] for r in replicas if (r, v) in rec.loaded]
        if times:
            loads[v] = max(times) - created
    transfer = publish + [(rec.ready[v], rec.ready[v] + s) for v, s in loads.items()]
    versions = sorted(rec.ready)
    lo, hi = rec.ready[versions[0]], rec.ready[versions[-1]]
    window = max(hi - lo, 1e-9)
    whole = attribute(lo, hi, train, gen, transfer)
    busy = {
        "window_s": round(window, 3),
        "trainer": round((whole["training"] + whole["overlap"]) / window, 3),
        "rollouts": round((whole["generation"] + whole["overlap"]) / window, 3),
        "both": round(whole["overlap"] / window, 3),
        "neither": round((whole["transfer"] + whole["idle"]) / window, 3),
        "evaluator": round(union(evals, lo, hi) / window, 3),
        **{f"rollout:{r}": round(union([(a, b) for q, a, b in rec.batches if q == r], lo, hi) / window, 3)
           for r in replicas},
    }  # fmt: skip
    canary = {s.version: getattr(s, "canary_seconds", None) for s in rec.steps}
    per_step = []
    for v, nxt in zip(versions, versions[1:]):
        parts = attribute(rec.ready[v], rec.ready[nxt], train, gen, transfer)
        per_step.append({
            "from_version": v,
            "seconds": round(rec.ready[nxt] - rec.ready[v], 4),
            **{k: round(x, 4) for k, x in parts.items()},
            "publish_s": round(publish_s.get(nxt, 0.0), 4),
            "canary_s": None if canary.get(nxt) is None else round(canary[nxt], 4),
            "load_s": round(loads[v], 4) if v in loads else None,
            **arrival(rec, v, replicas),
        })  # fmt: skip
    mean_step = (
        {k: round(statistics.fmean(s[k] for s in per_step), 4) for k in ("seconds", *CATEGORIES)} if per_step else {}
    )
    return {"busy": busy, "mean_step": mean_step, "per_step": per_step}


def arrival(rec: Record, version: int, replicas: list[str]) -> dict[str, float | None]:
    """How `version` reached the replicas, in seconds after its announcement, each the slowest
    replica's: `delivery_s` until its load began (the event's way to the replica and the
    replica's turn to take it), `loaded_s` until it was servable, `first_batch_s` until a batch
    began after that (the grant and the replica's next turn). None where a replica never did."""
    created = rec.ready[version]
    began = [rec.load_began.get((r, version)) for r in replicas]
    loaded = [rec.loaded.get((r, version)) for r in replicas]
    first = [
        None if at is None else min((a for q, a, _ in rec.batches if q == r and a >= at), default=None)
        for r, at in zip(replicas, loaded)
    ]

    def slowest(times: list[float | None]) -> float | None:
        return None if not times or None in times else round(max(times) - created, 4)

    return {"delivery_s": slowest(began), "loaded_s": slowest(loaded), "first_batch_s": slowest(first)}


def time_to(curve: list[list[float]], target: float) -> tuple[float | None, int | None]:
    """(seconds, version) of the first scored version at or above `target`."""
    for seconds, version, score in curve:
        if score >= target:
            return seconds, int(version)
    return None, None


def measure(task: str, overrides: list[str], run_dir: Path, log: Path, timeout_s: float | None = None) -> dict:
    """One `lorabus up` of `task` with `overrides`, read back (module docstring)."""
    spec = TASKS[task]
    started = launch(spec.config, [*spec.overrides, *overrides], run_dir, timeout_s or spec.timeout_s, log)
    out = {"config": spec.config, "overrides": [*spec.overrides, *overrides], "rc": started["rc"],
           "wall_s": round(started["wall_s"], 1)}  # fmt: skip
    summary = run_dir / "summary.json"
    if started["rc"] != 0 or not summary.exists():
        lines = log.read_text(errors="replace").splitlines() if log.exists() else []
        return {**out, "error": "lorabus up failed", "log_tail": lines[-40:]}
    rec = asyncio.run(read_streams(run_dir, json.loads(summary.read_text())["run"]))
    publish_s, evals = log_times(run_dir, rec.ready[0])
    t0, last = rec.ready[0], max(rec.ready)
    curve = [[round(rec.ready[v] - t0, 3), v, rec.scores[v]] for v in sorted(rec.scores) if v in rec.ready]
    final_version = max(rec.scores)
    return {
        **out,
        "startup_s": round(t0 - started["launched_at"], 1),
        "training_s": round(rec.ready[last] - t0, 2),
        "steps": len(rec.steps),
        "s_per_step": round((rec.ready[last] - t0) / max(last, 1), 4),
        "v0_score": rec.scores.get(0),
        "final_version": final_version,
        "final_score": rec.scores[final_version],
        "best_score": max(rec.scores.values()),
        "best_version": max(rec.scores, key=lambda v: (rec.scores[v], -v)),
        "trajectories": rec.verdicts,
        "curve": curve,
        **timeline(rec, publish_s, evals),
    }


def spread(values: list[float]) -> dict:
    """Mean, sample standard deviation, min and max over seeds (sd 0 for one value)."""
    if not values:
        return {"n": 0, "mean": None, "sd": None, "min": None, "max": None}
    return {
        "n": len(values),
        "mean": round(statistics.fmean(values), 4),
        "sd": round(statistics.stdev(values), 4) if len(values) > 1 else 0.0,
        "min": round(min(values), 4),
        "max": round(max(values), 4),
    }


def heldout_se(p: float, n: int = 500) -> float:
    """Standard error of an accuracy on n held-out prompts."""
    return math.sqrt(max(p * (1 - p), 0.0) / n)


def run_cells(cells: list[tuple[str, list[str]]], task: str, runs_dir: Path, settings: dict,
              max_wall_s: float | None, timeout_s: float | None = None) -> None:  # fmt: skip
    """Measure each (name, overrides) cell into runs_dir/<name>.json, one after the other.
    A cell already recorded there with the same `settings` and no error is not run again (a
    device call that ran out of time is continued by the next); once `max_wall_s` has passed
    since the first cell, no further cell is started."""
    runs_dir.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    for name, overrides in cells:
        path = runs_dir / f"{name}.json"
        if path.exists():
            old = json.loads(path.read_text())
            if old.get("settings") == settings and "error" not in old:
                print(f"{name}: recorded already ({path})", flush=True)
                continue
        if max_wall_s is not None and time.monotonic() - began > max_wall_s:
            print(f"{name}: not started (--max-wall-s {max_wall_s:.0f} passed)", flush=True)
            continue
        print(f"{name}: lorabus up {' '.join(overrides)}", flush=True)
        run_dir = Path("/tmp/lorabus-bench") / name
        result = measure(task, overrides, run_dir, runs_dir / f"{name}.log", timeout_s)
        if "error" in result:  # the services' own logs, for the post-mortem
            (runs_dir / f"{name}_logs").mkdir(exist_ok=True)
            for log in run_dir.glob("*.log"):
                shutil.copy(log, runs_dir / f"{name}_logs" / log.name)
        # a run's store, exports and checkpoints are hundreds of MB on arith3: twelve would fill the disk
        shutil.rmtree(run_dir, ignore_errors=True)
        record = {"name": name, "settings": settings, "machine": machine(), **result}
        path.write_text(json.dumps(record, indent=1) + "\n")
        brief = result.get("error") or (
            f"final {result['final_score']:.3f} best {result['best_score']:.3f}, {result['training_s']:.1f} s "
            f"training, {result['wall_s']:.1f} s in all"
        )
        print(f"{name}: {brief}", flush=True)


def machines(runs: list[dict]) -> list[dict]:
    """The distinct machines `runs` ran on (their GPUs and platform)."""
    seen: list[dict] = []
    for r in runs:
        where = {k: r.get("machine", {}).get(k) for k in ("gpus", "platform", "cpus")}
        if where not in seen:
            seen.append(where)
    return seen


def plot_or_say(draw, *args) -> None:
    """Draw the figure; without matplotlib say so (the JSON is written already; `--report-only`
    on a machine that has it draws it again)."""
    try:
        draw(*args)
    except ImportError as exc:
        print(f"no figure: {exc}")


def recorded(runs_dir: Path, settings: dict) -> list[dict]:
    """The cells in runs_dir recorded with `settings`, without errors."""
    out = []
    for path in sorted(runs_dir.glob("*.json")) if runs_dir.exists() else []:
        doc = json.loads(path.read_text())
        if doc.get("settings") == settings and "error" not in doc:
            out.append(doc)
    return out


def machine() -> dict:
    """Where a run ran (each run records its own: the report may be made on another machine)."""
    info = {"cpus": os.cpu_count(), "platform": platform.platform(), "load_avg_1m": os.getloadavg()[0]}
    try:
        gpus = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=20).stdout.split("\n")  # fmt: skip
        info["gpus"] = [g.strip() for g in gpus if g.strip()]
    except (OSError, subprocess.SubprocessError):
        info["gpus"] = []
    return info
