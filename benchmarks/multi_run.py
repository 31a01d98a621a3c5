"""Many runs on one fleet vs the same runs one after another, on this machine's CPU.

    python benchmarks/multi_run.py [--steps 10] [--runs 1 2 4] [--out benchmarks/results/multi_run_cpu.json]

The tiny task (examples/tiny.yaml: embedded engine, 2 rollout replicas, one FSDP2 trainer).
N runs of the same shape (rank 8, all-linear, exact-match reward), seeds 1..N, each `--steps`
trainer steps:

- together: one `lorabus up` (the first run is the fleet's own), the other N-1 submitted with
  `lorabus run submit` as soon as the fleet answers; timed from the launch to its exit (every
  run's last version exported).
- sequential: N plain `lorabus up`, one after another, of the same runs (the N = 1 "together"
  row is the first of them); timed end to end, start-up included, as a user would run them.

Reported per N: wall time of each mode and their ratio (target: N = 4 together <= 0.5 x
sequential), trainer steps per hour, rollout tokens per second (completion tokens of every
trajectory of every run, over the wall time), the peak resident memory of the fleet's processes
(trainer + rollouts + registry + exporter, sampled every 0.5 s; target: N = 4 grows over N = 1
by the adapters only, i.e. within the noise of a run's processes) and each run's held-out score
(greedy, 500 prompts) at its last version, together and solo.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIG = "examples/tiny.yaml"
SERVICES = ("registry", "trainer", "exporter", "rollout-0", "rollout-1")


def rss_mib(pid: int) -> float:
    """Resident memory of a process and its children (torchrun-free here: one process each)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except FileNotFoundError:
        pass
    return 0.0


class PeakMemory(threading.Thread):
    """Sum of the services' resident memory, sampled every 0.5 s; keeps the peak."""

    def __init__(self, run_dir: Path):
        super().__init__(daemon=True)
        self.pids_file, self.peak, self.done = run_dir / "pids.json", 0.0, threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.5):
            try:
                pids = json.loads(self.pids_file.read_text())
            except (FileNotFoundError, json.JSONDecodeError):
                continue
            self.peak = max(self.peak, sum(rss_mib(pid) for name, pid in pids.items() if name in SERVICES))


def up(run_dir: Path, nats_url: str, run: str, seed: int, steps: int, extra: list[str], submit: list[Path]) -> dict:
    """One `lorabus up`; `submit`: run files to submit once the fleet answers. Returns timings."""
    overrides = [f"run={run}", f"run_dir={run_dir}", f"total_train_steps={steps}", f"seed={seed}", *extra]
    cmd = [sys.executable, "-m", "services.local.launcher", "--config", CONFIG, "--bus-url", nats_url,
           "--no-evaluate", "--timeout", "3000", "--progress-every", "30", *overrides]  # fmt: skip
    run_dir.mkdir(parents=True, exist_ok=True)
    memory = PeakMemory(run_dir)
    started = time.monotonic()
    with (run_dir.parent / f"{run}.up.log").open("w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        memory.start()
        fleet_args = ["--config", CONFIG, f"bus.url={nats_url}", *overrides]
        for path in submit:
            while True:
                done = subprocess.run([sys.executable, "-m", "services.cli", "run", "submit", str(path), *fleet_args],
                                      cwd=ROOT, capture_output=True, text=True)  # fmt: skip
                if done.returncode == 0:
                    break
                if proc.poll() is not None or time.monotonic() - started > 600:
                    raise RuntimeError(f"submit {path} failed: {done.stderr}")
                time.sleep(1.0)
        proc.wait()
    memory.done.set()
    if proc.returncode != 0:
        raise RuntimeError(f"lorabus up {run} failed; see {run_dir.parent / f'{run}.up.log'}")
    return {"wall_s": time.monotonic() - started, "peak_rss_mib": memory.peak}


async def completion_tokens(nats_url: str, runs: list[str]) -> int:
    from proto import codec, subjects
    from proto.messages import Trajectory
    from services.common import streams
    from services.common.bus import Bus
    from services.config.schema import BusConfig

    bus = await Bus.connect(BusConfig(url=nats_url), run=runs[0], service="bench")
    total = 0
    try:
        for run in runs:
            sub = await bus.js.pull_subscribe(subjects.trajectory_all(run), stream=streams.TRAJECTORIES(run))
            while True:
                try:
                    msgs = await sub.fetch(500, timeout=1.0)
                except Exception:
                    break
                for msg in msgs:
                    traj = codec.decode(msg.data, Trajectory)
                    total += sum(len(c.token_ids) for c in traj.completions)
            await sub.unsubscribe()
    finally:
        await bus.close()
    return total


def final_scores(exports: dict[str, Path], version: int) -> dict[str, float]:
    from services.clients.evaluate import Evaluator, heldout_reward
    from services.config.loader import load_config

    evaluator = Evaluator(load_config(CONFIG), heldout_reward)
    return {run: round(evaluator.score(path / f"v{version}")[1], 4) for run, path in exports.items()}


def run_file(path: Path, run: str, seed: int, steps: int) -> Path:
    path.write_text(json.dumps({"run": run, "seed": seed, "total_train_steps": steps}))
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--runs", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/multi_run_cpu.json"))
    args = ap.parse_args()
    from services.local.nats_server import start_nats_server

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    tag = uuid.uuid4().hex[:4]
    results: dict = {"steps_per_run": args.steps, "cpu_count": os.cpu_count(), "rows": []}
    with tempfile.TemporaryDirectory(prefix="multi_run_") as tmp:
        root = Path(tmp)
        nats = start_nats_server(root / "nats")
        try:
            solo: dict[int, dict] = {}
            for seed in range(1, max(args.runs) + 1):
                run = f"solo{tag}s{seed}"
                timing = up(root / run, nats.url, run, seed, args.steps, [], [])
                tokens = asyncio.run(completion_tokens(nats.url, [run]))
                score = final_scores({run: root / run / "export"}, args.steps)[run]
                solo[seed] = {**timing, "tokens": tokens, "score": score}
                print(f"solo seed {seed}: {timing['wall_s']:.0f} s, {tokens} tokens, score {score}", flush=True)
            for n in args.runs:
                fleet = f"fleet{tag}n{n}"
                # room for every run's keep window: 4 slots each (max_head_offpolicyness 2)
                extra = [f"fleet.lora_slots={4 * n}", f"fleet.max_runs={max(n, 1)}"]
                files = [run_file(root / f"{fleet}-{s}.json", f"{fleet}-{s}", s, args.steps) for s in range(2, n + 1)]
                timing = up(root / fleet, nats.url, fleet, 1, args.steps, extra, files)
                runs = [fleet] + [f"{fleet}-{s}" for s in range(2, n + 1)]
                tokens = asyncio.run(completion_tokens(nats.url, runs))
                exports = {fleet: root / fleet / "export"} | {
                    f"{fleet}-{s}": root / fleet / "runs" / f"{fleet}-{s}" / "export" for s in range(2, n + 1)
                }
                scores = final_scores(exports, args.steps)
                seq_wall = sum(solo[s]["wall_s"] for s in range(1, n + 1))
                seq_tokens = sum(solo[s]["tokens"] for s in range(1, n + 1))
                row = {
                    "runs": n,
                    "together_wall_s": round(timing["wall_s"], 1),
                    "sequential_wall_s": round(seq_wall, 1),
                    "together_over_sequential": round(timing["wall_s"] / seq_wall, 3),
                    "together_steps_per_hour": round(n * args.steps / timing["wall_s"] * 3600, 1),
                    "sequential_steps_per_hour": round(n * args.steps / seq_wall * 3600, 1),
                    "together_rollout_tokens_per_s": round(tokens / timing["wall_s"], 1),
                    "sequential_rollout_tokens_per_s": round(seq_tokens / seq_wall, 1),
                    "together_peak_rss_mib": round(timing["peak_rss_mib"], 1),
                    "solo_peak_rss_mib": round(max(solo[s]["peak_rss_mib"] for s in range(1, n + 1)), 1),
                    "together_scores": list(scores.values()),
                    "solo_scores": [solo[s]["score"] for s in range(1, n + 1)],
                }
                results["rows"].append(row)
                print(json.dumps(row), flush=True)
        finally:
            nats.stop()
    results["base_score"] = 0.376
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(table(results))
    return 0


def table(results: dict) -> str:
    lines = [
        f"{'runs':>4} {'together s':>10} {'sequential s':>12} {'ratio':>6} {'steps/h tog':>11} {'steps/h seq':>11} "
        f"{'tok/s tog':>9} {'tok/s seq':>9} {'RSS MiB tog':>11} {'RSS MiB solo':>12}  scores together | solo"
    ]
    for r in results["rows"]:
        lines.append(
            f"{r['runs']:>4} {r['together_wall_s']:>10} {r['sequential_wall_s']:>12} "
            f"{r['together_over_sequential']:>6} "
            f"{r['together_steps_per_hour']:>11} {r['sequential_steps_per_hour']:>11} "
            f"{r['together_rollout_tokens_per_s']:>9} {r['sequential_rollout_tokens_per_s']:>9} "
            f"{r['together_peak_rss_mib']:>11} {r['solo_peak_rss_mib']:>12}  "
            f"{r['together_scores']} | {r['solo_scores']}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
