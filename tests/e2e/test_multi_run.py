"""Many runs on one fleet, end to end: one `lorabus up` on the tiny task, two more runs
submitted while it trains (`lorabus run submit`), one of them stopped midway (`lorabus run
stop`). Ranks 8, 4 and 2 (the last on q/v only), rewards exact-match and final-number.

What is asserted and why it cannot pass by chance:
- Each run that was not stopped learned: its held-out greedy accuracy (the 500 fixed `valid`
  prompts, scored from its own exported PEFT directories loaded with plain peft, so the exports
  are proven loadable too) rises by MARGIN over v0, the untrained adapter (B = 0: the base
  model, 37.6%). Greedy decoding on a fixed set has no sampling noise: a rise is a changed
  model (tests/e2e/test_up.py). The rise within STEPS steps is what a solo run shows
  (examples/areal_tiny.yaml: 0.376 -> 0.434 in 10 steps).
- No trajectory crosses runs: every trajectory on a run's stream names that run and was decided
  once, by that run's registry, on a grant that registry issued (none invalid, which a grant of
  another run would be), and no trajectory appears in two runs.
- The stopped run stopped: the run table says so, its head stayed below its steps, and its
  exports end where its training did.
- Every run has its own XCCL group (`actor.weight_update_mode: xccl`): both replicas loaded
  versions of each submitted run by broadcast ("via xccl" in their logs).
- The runs step together (`fleet.step_together: always`, what `auto` does on a GPU): the trainer
  trained batches of several runs in one step, and each run still learned on its own.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import uuid
from pathlib import Path

import msgspec
import pytest
import yaml

from proto import codec, subjects
from proto.messages import Trajectory, TrajectoryDecision
from services.common import streams
from services.common.bus import Bus
from services.common.run_table import RunTable
from services.config.loader import load_config
from services.config.schema import BusConfig
from tests.fixtures.waiting import until
from tests.integration.test_registry_service import stream_messages

ROOT = Path(__file__).resolve().parents[2]
STEPS = 16
MARGIN = 0.04
CONFIG = "examples/tiny.yaml"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def lorabus_run(*args: str) -> str:
    cmd = [sys.executable, "-m", "services.cli", "run", *args]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def heldout(evaluator, export: Path, versions: list[int], rank: int) -> dict[int, float]:
    """Greedy held-out accuracy of each exported version, loaded with plain peft."""
    scores = {}
    for v in versions:
        assert json.loads((export / f"v{v}" / "adapter_config.json").read_text())["r"] == rank
        scores[v] = evaluator.score(export / f"v{v}")[1]
    return scores


async def stream(bus: Bus, run: str, kind: str, subject: str, msg_type):
    return [codec.decode(raw, msg_type) for raw in await stream_messages(bus, getattr(streams, kind)(run), subject)]


def test_three_runs_share_one_fleet(tmp_path, nats_url):
    fleet = f"mr{uuid.uuid4().hex[:6]}"
    run_dir = tmp_path / "fleet"
    overrides = [f"run={fleet}", f"run_dir={run_dir}", f"total_train_steps={STEPS}", "fleet.lora_slots=12",
                 "fleet.max_lora_rank=8", "actor.weight_update_mode=xccl",
                 "fleet.step_together=always"]  # fmt: skip
    a, b = f"{fleet}-a", f"{fleet}-b"
    files = {
        a: {"run": a, "total_train_steps": STEPS, "gconfig": {"lora_name": "four"},
            "actor": {"lora_rank": 4, "lora_alpha": 8},
            "train_dataset": {"reward_fn": "services.common.rewards:numeric_final_answer"}},
        b: {"run": b, "total_train_steps": STEPS, "gconfig": {"lora_name": "two"}, "fleet": {"share": 2},
            "actor": {"lora_rank": 2, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"]}},
    }  # fmt: skip
    for run, tree in files.items():
        (tmp_path / f"{run}.yaml").write_text(yaml.safe_dump(tree))
    fleet_args = ["--config", CONFIG, f"bus.url={nats_url}", *overrides]
    cmd = [sys.executable, "-m", "services.local.launcher", "--config", CONFIG, "--bus-url", nats_url,
           "--no-evaluate", "--timeout", "700", "--progress-every", "10", *overrides]  # fmt: skip
    log = (tmp_path / "up.log").open("w")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True)
    exports = {fleet: run_dir / "export", a: run_dir / "runs" / a / "export", b: run_dir / "runs" / b / "export"}
    try:
        until(lambda: (exports[fleet] / "v2").is_dir(), 300, "the fleet's v2 to be exported", interval=0.5)
        assert f"run {a} submitted to fleet {fleet}" in lorabus_run("submit", str(tmp_path / f"{a}.yaml"), *fleet_args)
        until(lambda: (exports[a] / "v1").is_dir(), 300, f"{a}'s v1 to be exported", interval=0.5)
        assert f"run {b} submitted" in lorabus_run("submit", str(tmp_path / f"{b}.yaml"), *fleet_args)
        until(lambda: (exports[b] / "v2").is_dir(), 300, f"{b}'s v2 to be exported", interval=0.5)
        assert f"run {b} stopping in fleet {fleet}" in lorabus_run("stop", b, *fleet_args)
        listed = lorabus_run("list", *fleet_args)
        assert fleet in listed and a in listed and b in listed
        proc.wait(timeout=700)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    out = (tmp_path / "up.log").read_text()
    print(out[-6000:])
    assert proc.returncode == 0, out[-4000:]

    async def read() -> tuple[dict, dict, dict]:
        bus = await Bus.connect(BusConfig(url=nats_url), run=fleet, service="tester")
        try:
            records = await RunTable(bus, fleet).records()
            trajs = {r: await stream(bus, r, "TRAJECTORIES", subjects.trajectory_all(r), Trajectory) for r in exports}
            verdicts = {r: await stream(bus, r, "DECISIONS", subjects.decision_all(r), TrajectoryDecision)
                        for r in exports}  # fmt: skip
            return records, trajs, verdicts
        finally:
            await bus.close()

    records, trajs, decisions = asyncio.run(read())
    assert {r: records[r].state for r in exports} == {fleet: "finished", a: "finished", b: "stopped"}
    ids: dict[str, set[str]] = {}
    for run in exports:
        ids[run] = {t.trajectory_id for t in trajs[run]}
        assert ids[run] and all(t.run == run for t in trajs[run]), run
        # each trajectory decided once, by its own run's registry, on a grant that run issued
        decided = {(d.trajectory_id, d.grant_id) for d in decisions[run]}
        assert decided == {(t.trajectory_id, t.grant_id) for t in trajs[run]}, run
        assert all(d.run == run and d.verdict != "rejected-invalid" for d in decisions[run]), decisions[run]
    assert not (ids[fleet] & ids[a]) and not (ids[fleet] & ids[b]) and not (ids[a] & ids[b])

    stopped_at = max(int(p.name[1:]) for p in exports[b].iterdir())
    assert 2 <= stopped_at < STEPS, stopped_at
    from services.clients.evaluate import Evaluator, heldout_reward

    evaluator = Evaluator(load_config(CONFIG), heldout_reward)
    base = heldout(evaluator, exports[fleet], [0], 8)[0]  # v0 of every run is the base model (B = 0)
    late = [STEPS - 2, STEPS - 1, STEPS]
    for run, rank in ((fleet, 8), (a, 4)):
        scores = heldout(evaluator, exports[run], late, rank)
        print(f"{run}: v0 {base:.3f}, {scores}")
        assert max(scores.values()) >= base + MARGIN, (run, base, scores)
    heldout(evaluator, exports[b], [stopped_at], 2)  # loads in peft at its own rank
    assert msgspec.json.decode((run_dir / "summary.json").read_bytes())["other_runs"][a]["exported"] == STEPS
    joint = re.findall(r"runs (.+) step together", (run_dir / "trainer.log").read_text())
    assert joint, "no two runs stepped together in the trainer's log"
    # every run has its own XCCL group: a submitted run's versions reach the replicas by broadcast
    # too (v0 and a version around a join come as object copies)
    for replica in ("rollout-0", "rollout-1"):
        text = (run_dir / f"{replica}.log").read_text()
        for name, run in (("four", a), ("two", b)):
            by_xccl = {int(v) for v in re.findall(rf"loaded {name}-v(\d+) via xccl", text)}
            assert len(by_xccl) >= 2, (replica, run, by_xccl, text[-3000:])
