"""Many runs on one fleet vs the same runs one after another: on the CPU (tiny) or one GPU (arith3).

    python benchmarks/multi_run.py                                   # CPU: tiny, N = 1 2 4, 10 steps
    python benchmarks/multi_run.py --task arith3 --phase solo --out-dir R --label h100      # GPU call 1
    python benchmarks/multi_run.py --task arith3 --phase together --out-dir R --label h100 \
        --solo-json R1/multi_run_h100.json                                                 # GPU call 2
    python benchmarks/multi_run.py --task arith3 --phase all ...                           # both at once

Tasks (`multi_run_specs.TASKS`):
- tiny: examples/tiny.yaml (embedded engine, 2 replicas, one FSDP2 trainer, CPU); N runs of one
  shape (rank 8, all-linear), seeds 1..N, the last version scored.
- arith3: examples/arith3_gpu.yaml in bf16 (trainer, two embedded replicas, one GPU), the task
  made by scripts/make_arith3_task.py (as benchmarks/gpu_learning.py makes it); N = 1 2 4 8
  runs of mixed shapes (ranks 8/16/32, all-linear or attention-only: `MIXED`), v0 and every
  10th version scored, the last run of a fleet of 4 or more submitted only once the fleet is
  busy (its own run has published v3): the "run added to a busy fleet" case.

Phases (the GPU's calls are at most 10 minutes, so the two halves can run apart; the work dir
keeps what the second needs, and `--solo-json` can bring it from elsewhere):
- solo: each spec alone, one plain `lorabus up` after another, start-up included, as a user
  would run them; each run's held-out curve scored from its exports. Spec 1 alone is also the
  N = 1 row.
- together: for each N > 1 one `lorabus up` (spec 1 is the fleet's own run) and runs 2..N
  submitted at runtime through the fleet's run requests (`RunTable.submit`, what `lorabus run
  submit` sends), timed from the launch to its exit (every run's last version exported).

Reported per N: wall time together and one after another (the sum of the solo runs' walls),
runs completed per hour and trainer steps per hour both ways, rollout tokens per second, GPU
utilisation (nvidia-smi's busy share, sampled every 0.5 s) and GPU memory (peak and mean),
peak resident memory of the fleet's processes and each service's CPU seconds (a service near
one a second is bound by its host), the static decode caches the replicas made (each a capture
on a GPU), each run's first trajectory after its submit
and mean trainer step time (together vs alone), and each run's held-out score at its last
version together vs alone, the difference in units of the solo score's standard error
(sqrt(p (1 - p) / n) over the n held-out prompts). Results are written after every run, so a
call that runs out of time leaves what it measured.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import multi_run_specs as specs
from benchmarks.gpu_monitor import GpuMonitor, combine, gpu_name

SERVICES = ("registry", "trainer", "exporter", "rollout-0", "rollout-1")
HELDOUT = 500
"""held-out prompts every score is over (the evaluator's default max_prompts covers both tasks)"""


def rss_mib(pid: int) -> float:
    """Resident memory of a process (torchrun-free here: one process each)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except FileNotFoundError:
        pass
    return 0.0


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time a process has used so far (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    except (FileNotFoundError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class ServiceUsage(threading.Thread):
    """The services' resident memory summed (its peak) and each service's CPU seconds (the
    last reading before it ended), sampled every 0.5 s: a service near one CPU second a second
    is bound by its host, not by the GPU."""

    def __init__(self, run_dir: Path):
        super().__init__(daemon=True)
        self.pids_file, self.peak, self.done = run_dir / "pids.json", 0.0, threading.Event()
        self.cpu_s: dict[str, float] = {}

    def run(self) -> None:
        while not self.done.wait(0.5):
            try:
                pids = json.loads(self.pids_file.read_text())
            except (FileNotFoundError, json.JSONDecodeError):
                continue
            ours = {name: pid for name, pid in pids.items() if name in SERVICES}
            self.peak = max(self.peak, sum(rss_mib(pid) for pid in ours.values()))
            for name, pid in ours.items():
                seconds = cpu_seconds(pid)
                if seconds is not None:
                    self.cpu_s[name] = round(seconds, 1)


# --- one `lorabus up`, with runs submitted while it runs ----------------------------------------


async def submit_runs(
    nats_url: str, task: specs.Task, fleet_overrides: list[str], files: list[tuple[Path, bool]],
    proc: subprocess.Popen, started: float,
) -> dict[str, float]:  # fmt: skip
    """Submit each run file once the fleet answers (a late one once the fleet's own run has
    published `task.late_version`); returns run -> wall-clock time its submit was accepted."""
    from services.common.bus import Bus
    from services.common.run_table import RunTable
    from services.config import runconfig
    from services.config.loader import load_config
    from services.config.schema import BusConfig

    fleet_cfg = load_config(task.config, fleet_overrides)
    fleet_raw = runconfig.fleet_tree(task.config, fleet_overrides)
    bus = await Bus.connect(BusConfig(url=nats_url), run=fleet_cfg.run, service="bench")
    table, accepted = RunTable(bus, fleet_cfg.run), {}
    try:
        pending = list(files)
        while pending:
            if proc.poll() is not None or time.monotonic() - started > task.up_timeout_s:
                names = [p.name for p, _ in pending]
                raise RuntimeError(f"fleet {fleet_cfg.run} ended before {names} were submitted")
            try:
                listing = await table.list(timeout=1.0)
            except Exception:  # the registry is not up yet
                await asyncio.sleep(0.5)
                continue
            heads = {r.run: r.head_version for r in listing.runs}
            head = heads.get(fleet_cfg.run)
            busy = head is not None and head >= task.late_version
            for path, is_late in [p for p in pending if not p[1] or busy]:
                tree, cfg = runconfig.load_run(fleet_cfg, fleet_raw, path)  # the CLI's local check
                reply = await table.submit(cfg.run, tree, timeout=10.0)
                if not reply.ok:
                    raise RuntimeError(f"submit {path.name} refused: {reply.problems}")
                accepted[cfg.run] = time.time()
                pending.remove((path, is_late))
                print(f"  submitted {cfg.run}{' (into the busy fleet)' if is_late else ''}", flush=True)
            if pending:
                await asyncio.sleep(0.2)
    finally:
        await bus.close()
    return accepted


def up(task: specs.Task, run_dir: Path, nats_url: str, overrides: list[str], files: list[tuple[Path, bool]],
       logs: Path) -> dict:  # fmt: skip
    """One `lorabus up` of `task` with `overrides`; `files`: run files (and whether late) to
    submit while it runs. Returns its wall time, peak RSS, GPU figures and submit times."""
    cmd = [sys.executable, "-m", "services.local.launcher", "--config", task.config, "--bus-url", nats_url,
           "--no-evaluate", "--timeout", str(task.up_timeout_s), "--progress-every", "10", *overrides]  # fmt: skip
    run_dir.mkdir(parents=True, exist_ok=True)
    usage = ServiceUsage(run_dir)
    log_path = logs / f"{run_dir.name}.up.log"
    with log_path.open("w") as log, GpuMonitor() as gpu:
        launched_at, started = time.time(), time.monotonic()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        usage.start()
        try:
            submitted = asyncio.run(submit_runs(nats_url, task, overrides, files, proc, started)) if files else {}
        except BaseException:
            proc.terminate()
            proc.wait(timeout=60)
            raise
        proc.wait()
        wall = time.monotonic() - started
    usage.done.set()
    usage.join()
    # the trainer's and a replica's logs always (their step, load and capture lines say where a
    # fleet's time went), the registry's too on failure
    kept = ("trainer.log", "rollout-0.log") + (() if proc.returncode == 0 else ("registry.log",))
    for name in kept:
        if (run_dir / name).exists():
            shutil.copy(run_dir / name, logs / f"{run_dir.name}.{name}")
    if proc.returncode != 0:
        raise RuntimeError(f"lorabus up {run_dir.name} failed (exit {proc.returncode}); see {log_path}")
    return {"wall_s": wall, "peak_rss_mib": usage.peak, "cpu_s": usage.cpu_s, "gpu": gpu.summary(),
            "launched_at": launched_at, "submitted_at": submitted, "decode_caches": decode_caches(run_dir),
            "joint_steps": joint_steps(run_dir)}  # fmt: skip


def decode_caches(run_dir: Path) -> int:
    """Static decode caches the replicas made (`DecodeGraphs.acquire` logs each): on a GPU each
    is a fresh capture, so many mean batches that did not share their size class."""
    return sum(log.read_text(errors="replace").count("decode: static cache ") for log in run_dir.glob("rollout-*.log"))


def joint_steps(run_dir: Path) -> dict:
    """How the fleet's trainer stepped its runs: its joint steps (it logs "runs a, b step
    together" for each) and how many runs each held on average; a fleet whose steps hold one
    run each has not been stepping together."""
    log = run_dir / "trainer.log"
    text = log.read_text(errors="replace") if log.exists() else ""
    sizes = [
        line.split(": runs ", 1)[-1].count(",") + 1 for line in text.splitlines() if line.endswith(" step together")
    ]
    return {"count": len(sizes), "runs_mean": round(sum(sizes) / len(sizes), 2) if sizes else None}


# --- what the runs left on the bus --------------------------------------------------------------


async def _read_all(bus, stream: str, subject: str, kind):
    from proto import codec

    sub = await bus.js.pull_subscribe(subject, stream=stream)
    out = []
    try:
        while True:
            try:
                msgs = await sub.fetch(500, timeout=1.0)
            except Exception:  # nothing left (a timeout)
                break
            out += [codec.decode(msg.data, kind) for msg in msgs]
    finally:
        await sub.unsubscribe()
    return out


async def run_streams(nats_url: str, runs: list[str]) -> dict[str, dict]:
    """Per run: completion tokens, trajectories, its trainer steps' mean time, and the times
    (Unix) of its way in: v0 announced, v0 servable on the last replica, its first trajectory
    started and finished (where a slow start is: the trainer, the replicas, or generation)."""
    from proto import subjects
    from proto.messages import AdapterLoaded, AdapterReady, RolloutReport, TrainerStep, Trajectory
    from services.common import streams
    from services.common.bus import Bus
    from services.config.schema import BusConfig

    bus = await Bus.connect(BusConfig(url=nats_url), run=runs[0], service="bench")
    out = {}
    try:
        for run in runs:
            trajs = await _read_all(bus, streams.TRAJECTORIES(run), subjects.trajectory_all(run), Trajectory)
            steps = await _read_all(bus, streams.TRAINER(run), subjects.trainer_step(run), TrainerStep)
            ready = await _read_all(bus, streams.ADAPTERS(run), subjects.adapter_ready_all(run), AdapterReady)
            reports = await _read_all(bus, streams.REPORTS(run), subjects.rollout_report_all(run), RolloutReport)
            v0_loads = [r.loaded_at for r in reports if isinstance(r, AdapterLoaded) and r.version == 0]
            out[run] = {
                "tokens": sum(len(c.token_ids) for t in trajs for c in t.completions),
                "trajectories": len(trajs),
                "v0_announced_at": min((e.created_at for e in ready if e.version == 0), default=None),
                "v0_servable_at": max(v0_loads, default=None),
                "first_started_at": min((t.started_at for t in trajs), default=None),
                "first_trajectory_at": min((t.finished_at for t in trajs), default=None),
                "steps": len(steps),
                "step_seconds_mean": round(sum(s.step_seconds for s in steps) / len(steps), 4) if steps else None,
                "versions_at": sorted(e.created_at for e in ready if e.version >= 1),
            }
    finally:
        await bus.close()
    return out


# --- held-out scores ----------------------------------------------------------------------------


class Scorer:
    """One evaluator (the base loaded once) for every run's exports; v0 is the base for every
    run (LoRA B = 0), scored once."""

    def __init__(self, task: specs.Task, overrides: list[str]):
        self.task, self.overrides, self._evaluator, self.v0 = task, overrides, None, None

    def _score(self, directory: Path) -> float:
        if self._evaluator is None:
            from services.clients.evaluate import Evaluator, heldout_reward
            from services.config.loader import load_config

            self._evaluator = Evaluator(load_config(self.task.config, self.overrides), heldout_reward)
        return round(self._evaluator.score(directory)[1], 4)

    def curve(self, export: Path, steps: int) -> dict[str, float]:
        """version (as a JSON key) -> score, for the versions the task scores."""
        if self.v0 is None and self.task.eval_every > 0:
            self.v0 = self._score(export / "v0")
        return {str(v): self._score(export / f"v{v}") for v in specs.versions_to_score(self.task, steps)}


def standard_error(p: float, n: int = HELDOUT) -> float:
    return math.sqrt(max(p * (1 - p), 0.0) / n)


def cleanup(run_dir: Path) -> None:
    """What a scored run leaves that nothing reads again (adapters of every version: GBs on
    the GPU's disk over 20 runs); logs stay."""
    for sub in ("store", "export", "checkpoints"):
        shutil.rmtree(run_dir / sub, ignore_errors=True)
    for child in (run_dir / "runs").glob("*") if (run_dir / "runs").exists() else []:
        cleanup(child)


# --- phases -------------------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace, task: specs.Task):
        self.args, self.task, self.steps = args, task, args.steps or task.steps
        self.begun = time.monotonic()
        self.work: Path = args.work_dir
        self.logs = args.out_dir / f"multi_run_{args.label}_logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.tag = uuid.uuid4().hex[:4]
        self.overrides = [*task.overrides, *args.overrides]
        self.scorer = Scorer(task, self.overrides)
        self.result_path = args.out_dir / f"multi_run_{args.label}.json"
        self.results: dict = {}

    def time_left(self, needed_s: float) -> bool:
        budget = self.args.budget_s
        return budget is None or time.monotonic() - self.begun + needed_s <= budget

    def save(self) -> None:
        self.result_path.write_text(json.dumps(self.results, indent=2) + "\n")
        (self.work / f"{self.args.label}.json").write_text(json.dumps(self.results, indent=2) + "\n")

    def header(self) -> dict:
        return {
            "task": self.task.name,
            "label": self.args.label,
            "device": gpu_name() or f"cpu ({os.cpu_count()} cores)",
            "steps_per_run": self.steps,
            "overrides": self.overrides,
            "base_model_sha256": model_sha(self.task, self.overrides),
            "specs": {str(i): self.task.spec(i).describe() for i in range(1, max(self.args.runs) + 1)},
        }

    def solo(self, nats_url: str) -> None:
        """Each spec alone, one after another; its curve scored from its exports."""
        solo = self.results.setdefault("solo", {})
        for i in range(1, max(self.args.runs) + 1):
            if str(i) in solo:
                continue
            if not self.time_left(self._last_wall(solo)):
                self.results.setdefault("skipped", []).append(f"solo {i}: out of --budget-s")
                break
            run = f"solo{self.tag}s{i}"
            run_dir = self.work / run
            overrides = [*self.overrides, *specs.solo_overrides(self.task, i, run, run_dir, self.steps)]
            timing = up(self.task, run_dir, nats_url, overrides, [], self.logs)
            seen = asyncio.run(run_streams(nats_url, [run]))[run]
            del seen["versions_at"]  # a fleet's measure (late_run_effect)
            curve = self.scorer.curve(run_dir / "export", self.steps)
            cleanup(run_dir)
            solo[str(i)] = {
                "run": run,
                "spec": self.task.spec(i).describe(),
                "wall_s": round(timing["wall_s"], 1),
                "peak_rss_mib": round(timing["peak_rss_mib"], 1),
                "gpu": timing["gpu"],
                "decode_caches": timing["decode_caches"],
                "cpu_s": timing["cpu_s"],
                **_seen(seen, timing["launched_at"]),
                "curve": curve,
                "final": curve[str(self.steps)],
            }
            self.results["v0"] = self.scorer.v0
            final = curve[str(self.steps)]
            print(f"solo {i} ({self.task.spec(i).describe()}): {timing['wall_s']:.0f} s, final {final}", flush=True)
            self.save()

    def _last_wall(self, done: dict) -> float:
        walls = [r["wall_s"] for r in done.values()] if done else []
        return 1.2 * max(walls) if walls else 0.0

    def together(self, nats_url: str, n: int) -> dict:
        fleet = f"fleet{self.tag}n{n}"
        root = self.work / fleet
        files = []
        for i in range(2, n + 1):
            tree = specs.run_tree(self.task, i, f"{fleet}-{i}", self.steps)
            files.append((specs.run_file(self.work / f"{fleet}-{i}.json", tree), specs.late(self.task, n, i)))
        overrides = [*self.overrides, *specs.solo_overrides(self.task, 1, fleet, root, self.steps),
                     *specs.fleet_overrides(self.task, n)]  # fmt: skip
        timing = up(self.task, root, nats_url, overrides, files, self.logs)
        runs = {1: fleet} | {i: f"{fleet}-{i}" for i in range(2, n + 1)}
        seen = asyncio.run(run_streams(nats_url, list(runs.values())))
        versions_at = {run: seen[run].pop("versions_at") for run in runs.values()}
        late = [runs[i] for i in runs if specs.late(self.task, n, i)]
        joined = seen[late[0]].get("first_trajectory_at") if late else None
        effect = late_run_effect(versions_at, late[0], joined) if late and joined is not None else None
        exports = {1: root / "export"} | {i: root / "runs" / runs[i] / "export" for i in range(2, n + 1)}
        per_run = []
        for i, run in runs.items():
            curve = self.scorer.curve(exports[i], self.steps)
            since = timing["submitted_at"].get(run, timing["launched_at"])
            per_run.append(
                {
                    "spec": i,
                    "run": run,
                    "describe": self.task.spec(i).describe(),
                    "late": specs.late(self.task, n, i),
                    "submitted_after_s": round(since - timing["launched_at"], 1),
                    **_seen(seen[run], since),
                    "curve": curve,
                }
            )
        cleanup(root)
        return {"wall_s": timing["wall_s"], "peak_rss_mib": timing["peak_rss_mib"], "gpu": timing["gpu"],
                "decode_caches": timing["decode_caches"], "cpu_s": timing["cpu_s"],
                "joint_steps": timing["joint_steps"], "late_run_effect": effect, "per_run": per_run}  # fmt: skip

    def together_rows(self, nats_url: str, solo: dict) -> None:
        rows = self.results.setdefault("rows", [])
        done = {r["runs"] for r in rows}
        for n in self.args.runs:
            if n in done:
                continue
            if n == 1:
                if "1" in solo:  # a fleet of one run is that run alone
                    rows.append(row(1, self.steps, _as_together(solo["1"]), solo))
                    self.save()
                continue
            guess = self._last_wall({str(i): solo[str(i)] for i in range(1, n + 1) if str(i) in solo}) * max(1, n / 3)
            if not self.time_left(guess):
                self.results.setdefault("skipped", []).append(f"together N={n}: out of --budget-s")
                continue
            result = self.together(nats_url, n)
            rows.append(row(n, self.steps, result, solo))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "per_run"}), flush=True)
            for r in result["per_run"]:  # each run's way in, from its submit (the fleet's own: its launch)
                print(f"  run {r['spec']}: " + ", ".join(f"{k[:-2]} {r.get(k)} s" for k in _JOIN.values()), flush=True)
            print(f"  CPU seconds {result['cpu_s']}, decode caches made {result['decode_caches']}, "
                  f"joint steps {result['joint_steps']}", flush=True)  # fmt: skip
            if (effect := result["late_run_effect"]) is not None:
                print(f"  the late run cost the others at most {effect['max_ratio']}x their version interval "
                      f"(fair share: {effect['bound']}x)", flush=True)  # fmt: skip
            self.save()


def late_run_effect(versions_at: dict[str, list[float]], late: str, joined_at: float, k: int = 5) -> dict:
    """What a run added to a busy fleet cost the others (issue 33: no run's step time up more
    than its fair share): per other run, the mean time between its versions over its last `k`
    intervals before the late run's first trajectory (`joined_at`) and its first `k` after.
    Rollouts are granted by share, so with n runs where there were n - 1, a run's versions may
    come up to n / (n - 1) as far apart (`bound`); `ratios` above it took more than the share.
    A run with fewer than two versions on either side is left out (`left_out`)."""
    n = len(versions_at)
    ratios, left_out = {}, []
    for run, times in versions_at.items():
        if run == late:
            continue
        before = [t for t in times if t <= joined_at][-(k + 1) :]
        after = [t for t in times if t > joined_at][: k + 1]
        if len(before) < 2 or len(after) < 2:
            left_out.append(run)
            continue
        gap_before = (before[-1] - before[0]) / (len(before) - 1)
        gap_after = (after[-1] - after[0]) / (len(after) - 1)
        ratios[run] = round(gap_after / gap_before, 3)
    bound = round(n / (n - 1), 3) if n > 1 else None
    worst = max(ratios.values(), default=None)
    return {"late_run": late, "bound": bound, "ratios": ratios, "max_ratio": worst, "left_out": left_out,
            "within_share": None if worst is None or bound is None else worst <= bound}  # fmt: skip


_JOIN = {"v0_announced_at": "v0_announced_s", "v0_servable_at": "v0_servable_s",
         "first_started_at": "first_started_s", "first_trajectory_at": "first_trajectory_s"}  # fmt: skip


def _seen(seen: dict, since: float) -> dict:
    """`run_streams`' figures with each time of the run's way in as seconds after `since`."""
    times = {key: seen.pop(key, None) for key in _JOIN}
    return {**seen, **{_JOIN[k]: None if t is None else round(t - since, 2) for k, t in times.items()}}


def _as_together(solo_row: dict) -> dict:
    keep = ("spec", "run", "tokens", "trajectories", "steps", "step_seconds_mean", *_JOIN.values(), "curve")
    return {"wall_s": solo_row["wall_s"], "peak_rss_mib": solo_row["peak_rss_mib"], "gpu": solo_row["gpu"],
            "decode_caches": solo_row.get("decode_caches"), "cpu_s": solo_row.get("cpu_s"),
            "per_run": [{"spec": 1, "describe": solo_row["spec"], "late": False, "submitted_after_s": 0.0,
                         **{k: solo_row[k] for k in keep if k in solo_row}}]}  # fmt: skip


def row(n: int, steps: int, together: dict, solo: dict) -> dict:
    """One N's figures: together against the same runs alone, one after another."""
    alone = [solo.get(str(i)) for i in range(1, n + 1)]
    complete = all(alone)
    seq_wall = sum(r["wall_s"] for r in alone if r) if complete else None
    tokens = sum(r["tokens"] for r in together["per_run"])
    out = {
        "runs": n,
        "together_wall_s": round(together["wall_s"], 1),
        "sequential_wall_s": round(seq_wall, 1) if seq_wall else None,
        "together_over_sequential": round(together["wall_s"] / seq_wall, 3) if seq_wall else None,
        "together_runs_per_hour": round(n / together["wall_s"] * 3600, 1),
        "sequential_runs_per_hour": round(n / seq_wall * 3600, 1) if seq_wall else None,
        "runs_per_hour_gain": round(seq_wall / together["wall_s"], 2) if seq_wall else None,
        "together_steps_per_hour": round(n * steps / together["wall_s"] * 3600, 1),
        "sequential_steps_per_hour": round(n * steps / seq_wall * 3600, 1) if seq_wall else None,
        "together_rollout_tokens_per_s": round(tokens / together["wall_s"], 1),
        "sequential_rollout_tokens_per_s": round(sum(r["tokens"] for r in alone) / seq_wall, 1) if seq_wall else None,
        "together_peak_rss_mib": round(together["peak_rss_mib"], 1),
        "solo_peak_rss_mib": round(max(r["peak_rss_mib"] for r in alone), 1) if complete else None,
        "together_gpu": together["gpu"],
        "sequential_gpu": combine([r["gpu"] for r in alone]) if complete else None,
        "together_decode_caches": together.get("decode_caches"),
        "together_cpu_s": together.get("cpu_s"),
        "together_joint_steps": together.get("joint_steps"),
        "late_run_effect": together.get("late_run_effect"),
        "solo_decode_caches": [r.get("decode_caches") if r else None for r in alone],
        "together_scores": [r["curve"][str(steps)] for r in together["per_run"]],
        "solo_scores": [r["final"] if r else None for r in alone],
        "per_run": [],
    }
    for r in together["per_run"]:
        mine = solo.get(str(r["spec"]))
        final = r["curve"][str(steps)]
        entry = {**r, "final_together": final}
        if mine:
            se = standard_error(mine["final"])
            entry |= {
                "final_solo": mine["final"],
                "solo_standard_error": round(se, 4),
                "difference_in_standard_errors": round((final - mine["final"]) / se, 2) if se else None,
                "solo_step_seconds_mean": mine.get("step_seconds_mean"),
                "solo_curve": mine["curve"],
            }
        out["per_run"].append(entry)
    return out


def model_sha(task: specs.Task, overrides: list[str]) -> str | None:
    """sha256 of the base model's weights: the solo and together halves must share one base."""
    from services.config.loader import load_config

    path = Path(load_config(task.config, overrides).actor.path)
    path = path if path.is_absolute() else ROOT / path
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files:
        return None
    digest = hashlib.sha256()
    for f in files:
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 24), b""):
                digest.update(chunk)
    return digest.hexdigest()


def make_task(task: specs.Task, args: argparse.Namespace) -> None:
    """The arith3 task as benchmarks/gpu_learning.py makes it (unless its model exists)."""
    if task.name != "arith3":
        return
    from benchmarks.gpu_learning import TASK, run

    out = Path(args.task_dir) if args.task_dir else TASK
    if (out / "model" / "config.json").exists():
        return
    cmd = [sys.executable, "scripts/make_arith3_task.py", "--out", str(out), *args.pretrain_args.split()]
    started = time.monotonic()
    if run(cmd, args.out_dir / f"multi_run_{args.label}_pretrain.log") != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed; see multi_run_{args.label}_pretrain.log")
    print(f"task made in {time.monotonic() - started:.0f} s", flush=True)


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, specs.Task]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", choices=sorted(specs.TASKS), default="tiny")
    ap.add_argument("--phase", choices=("all", "solo", "together"), default="all")
    ap.add_argument("--steps", type=int, default=0, help="trainer steps per run (0: the task's)")
    ap.add_argument("--runs", type=int, nargs="+", default=None, help="fleet sizes (default: the task's)")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks/results")
    ap.add_argument("--label", default="", help="names the files multi_run_<label>.* (default cpu / gpu)")
    ap.add_argument("--work-dir", type=Path, default=None, help="default /tmp/lorabus-multi-run-<task>")
    ap.add_argument(
        "--solo-json",
        type=Path,
        default=None,
        help="the solo phase's result (default: the work dir's, from an earlier --phase solo)",
    )
    ap.add_argument("--budget-s", type=float, default=None, help="start no run that would end past this")
    ap.add_argument("--task-dir", default=None, help="arith3: where the task is made (default examples/arith3)")
    ap.add_argument("--pretrain-args", default="", help="arith3: extra arguments of scripts/make_arith3_task.py")
    ap.add_argument(
        "--late-from",
        type=int,
        default=None,
        help="fleets of this many runs or more submit their last run into the busy fleet (default: the task's)",
    )
    ap.add_argument("overrides", nargs="*", help="config overrides for every lorabus up (and the scorer)")
    args = ap.parse_args(argv)
    task = specs.TASKS[args.task]
    if args.late_from is not None:
        task = dataclasses.replace(task, late_from=args.late_from)
    args.runs = args.runs or list(task.runs)
    args.label = args.label or ("cpu" if args.task == "tiny" else "gpu")
    args.work_dir = args.work_dir or Path(f"/tmp/lorabus-multi-run-{args.task}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    return args, task


def main(argv: list[str] | None = None) -> int:
    args, task = parse(argv)
    from services.local.nats_server import start_nats_server

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    make_task(task, args)
    bench = Bench(args, task)
    bench.results = bench.header()
    if args.phase == "together":
        path = args.solo_json or args.work_dir / f"{args.label}.json"
        earlier = json.loads(path.read_text()) if path.exists() else {}
        bench.results["solo"] = earlier.get("solo", {})
        bench.results["v0"] = bench.scorer.v0 = earlier.get("v0")
        bench.results["solo_from"] = str(path) if earlier else "none: rows have no sequential figures"
        if earlier.get("base_model_sha256") != bench.results["base_model_sha256"]:
            bench.results["warning"] = "the solo runs had another base model (sha256 differs)"
    nats = start_nats_server(args.work_dir / f"nats-{bench.tag}")
    try:
        if args.phase in ("all", "solo"):
            bench.solo(nats.url)
        if args.phase in ("all", "together"):
            bench.together_rows(nats.url, bench.results.get("solo", {}))
    finally:
        nats.stop()
        bench.save()
    if args.task == "tiny":
        bench.results.setdefault("base_score", 0.376)
    bench.save()
    print(table(bench.results))
    if task.eval_every > 0:
        try:
            plot(bench.results, args.out_dir / f"multi_run_{args.label}.png")
        except ImportError as exc:
            print(f"no plot: {exc!r}")
    return 0


def table(results: dict) -> str:
    lines = [
        f"{'runs':>4} {'together s':>10} {'seq s':>7} {'ratio':>6} {'runs/h tog':>10} {'runs/h seq':>10} "
        f"{'tok/s tog':>9} {'tok/s seq':>9} {'GPU% tog':>8} {'GPU% seq':>8} {'GPU MiB tog':>11}  "
        "final scores together | solo"
    ]

    def gpu(g: dict | None, key: str) -> str:
        return "-" if not g else str(g[key])

    for r in results.get("rows", []):
        lines.append(
            f"{r['runs']:>4} {r['together_wall_s']:>10} {r['sequential_wall_s'] or '-':>7} "
            f"{r['together_over_sequential'] or '-':>6} {r['together_runs_per_hour']:>10} "
            f"{r['sequential_runs_per_hour'] or '-':>10} {r['together_rollout_tokens_per_s']:>9} "
            f"{r['sequential_rollout_tokens_per_s'] or '-':>9} {gpu(r['together_gpu'], 'util_mean_pct'):>8} "
            f"{gpu(r['sequential_gpu'], 'util_mean_pct'):>8} {gpu(r['together_gpu'], 'mem_peak_mib'):>11}  "
            f"{r['together_scores']} | {r['solo_scores']}"
        )
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    """One panel per spec: its held-out curve alone (dashed) and in each fleet that ran it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    solo, rows, v0 = results.get("solo", {}), results.get("rows", []), results.get("v0")
    n_specs = max([len(solo)] + [r["runs"] for r in rows] + [1])
    cols = min(4, n_specs)
    fig, axes = plt.subplots(math.ceil(n_specs / cols), cols, figsize=(3.2 * cols, 2.6 * math.ceil(n_specs / cols)),
                             squeeze=False, sharey=True)  # fmt: skip
    for i in range(1, n_specs + 1):
        ax = axes[(i - 1) // cols][(i - 1) % cols]
        start = {0: v0} if v0 is not None else {}
        if str(i) in solo:
            curve = start | {int(k): v for k, v in solo[str(i)]["curve"].items()}
            ax.plot(list(curve), list(curve.values()), "k--", label="alone")
        for r in rows:
            for p in r["per_run"]:
                if p["spec"] == i and r["runs"] > 1:
                    curve = start | {int(k): v for k, v in p["curve"].items()}
                    ax.plot(list(curve), list(curve.values()), "o-", ms=3, label=f"fleet of {r['runs']}")
        ax.set_title(results.get("specs", {}).get(str(i), f"run {i}"), fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.supxlabel("adapter version (trainer steps)")
    fig.supylabel("held-out greedy accuracy")
    fig.suptitle(f"{results['task']} on {results['device']}: each run in a fleet vs alone", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
