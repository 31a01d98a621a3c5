"""The registry as a fleet (`python -m services.registry`, real nats-server): runs submitted,
listed and stopped with `lorabus run`, fleet admission shared by weight between runs, each
run's off-policyness and accepted stream its own, and the run table surviving a restart."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from proto import codec, subjects
from proto.messages import (
    AdmissionDeny,
    AdmissionGrant,
    AdmissionReply,
    FleetAdmissionRequest,
    Trajectory,
)
from services.common import streams
from services.common.bus import Bus
from services.common.run_table import RunTable
from services.config.schema import BusConfig
from tests.fixtures.service_process import REPO, ServiceProcess
from tests.fixtures.waiting import wait_until
from tests.integration.test_registry_service import ready, stream_messages, trajectory


@pytest.fixture
def fleet() -> str:
    return f"fleet{uuid.uuid4().hex[:8]}"


@pytest.fixture
def fleet_config(tmp_path, nats_url, fleet) -> Path:
    config = tmp_path / "fleet.yaml"
    config.write_text(
        f"""
run: {fleet}
run_dir: {tmp_path}/runs/{fleet}
bus: {{url: "{nats_url}"}}
metrics: {{host: 127.0.0.1, port: 0}}
actor: {{path: examples/tiny/model}}
train_dataset: {{path: "builtin:arith"}}
fleet: {{max_concurrent_rollouts: 6, max_runs: 2, lora_slots: 8}}
rollout:
  max_head_offpolicyness: 1
  consumer_batch_size: 6
  lease_seconds: 30
"""
    )
    return config


@pytest.fixture
def registry(tmp_path, fleet_config):
    reg = ServiceProcess("services.registry", fleet_config, tmp_path / "registry.log", stop_timeout_s=10.0)
    reg.start()
    yield reg
    reg.stop()


@pytest.fixture
async def bus(nats_url, fleet):
    bus = await Bus.connect(BusConfig(url=nats_url), run=fleet, service="tester")
    await bus.ensure_streams()
    yield bus
    await bus.close()


def lorabus_run(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "services.cli", "run", *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)


async def listed(bus: Bus, fleet: str, registry: ServiceProcess) -> dict:
    async def answer():
        assert registry.alive(), registry.log_tail()
        try:
            return {r.run: r for r in (await RunTable(bus, fleet).list(timeout=0.5)).runs}
        except Exception:
            return None

    return await wait_until(answer, 20, lambda: f"the fleet to answer:\n{registry.log_tail()}", interval=0.2)


async def fleet_admit(bus: Bus, fleet: str, loaded: dict, rid: str | None = None) -> AdmissionReply:
    request = FleetAdmissionRequest(fleet=fleet, replica="r1", request_id=rid or uuid.uuid4().hex, loaded=loaded)
    return await bus.request(subjects.fleet_admission(fleet), request, AdmissionReply, timeout=5.0)


async def test_runs_share_the_fleet_by_weight_and_keep_their_own_ledgers(bus, registry, fleet, fleet_config, tmp_path):
    runs = await listed(bus, fleet, registry)
    assert list(runs) == [fleet] and runs[fleet].state == "active"  # `lorabus up`'s own run

    run_file = tmp_path / "r4.yaml"
    run_file.write_text(
        yaml.safe_dump(
            {
                "run": "r4",
                "gconfig": {"lora_name": "four"},
                "actor": {"lora_rank": 4},
                "fleet": {"share": 2},
                "rollout": {"lease_seconds": 3, "max_head_offpolicyness": 0, "consumer_batch_size": 6},
            }
        )
    )
    done = await asyncio.to_thread(lorabus_run, "submit", str(run_file), "--config", str(fleet_config))
    assert done.returncode == 0, done.stderr
    assert "run r4 submitted to fleet" in done.stdout and "share 2, rank 4" in done.stdout
    again = await asyncio.to_thread(lorabus_run, "submit", str(run_file), "--config", str(fleet_config))
    assert again.returncode == 1 and "'r4' is already a run of this fleet" in again.stderr
    # the registry checks too: a client that skips the local check gets the loader's lines
    refused = await RunTable(bus, fleet).submit("bad", {"run": "bad", "actor": {"lora_rank": 0, "path": "x"}})
    assert not refused.ok and any(p.startswith("actor.path: 'x' is a fleet setting") for p in refused.problems)
    over = await RunTable(bus, fleet).submit("third", {"run": "third"})
    assert not over.ok and over.problems[0].startswith("fleet.max_runs: 2 runs are live")

    listing = await asyncio.to_thread(lorabus_run, "list", "--config", str(fleet_config))
    assert listing.returncode == 0, listing.stderr
    assert [line.split()[0] for line in listing.stdout.splitlines()[1:]] == [fleet, "r4"]

    # nothing published yet: no run can grant
    idle = await fleet_admit(bus, fleet, {fleet: [], "r4": []})
    assert isinstance(idle, AdmissionDeny) and idle.reason.startswith("fleet-idle")
    r4 = bus.for_run("r4")
    await bus.publish(subjects.adapter_ready(fleet, 0), ready(fleet, 0), msg_id=f"{fleet}-v0")
    await r4.publish(subjects.adapter_ready("r4", 0), ready("r4", 0), msg_id="r4-v0")

    async def heads() -> bool:
        return all(r.head_version == 0 for r in (await listed(bus, fleet, registry)).values())

    await wait_until(heads, 10, "both runs to see v0", interval=0.2)

    both = {fleet: [0], "r4": [0]}
    grants = [await fleet_admit(bus, fleet, both, rid=f"q{i}") for i in range(6)]
    assert all(isinstance(g, AdmissionGrant) for g in grants), grants
    by_run = {run: [g for g in grants if g.run == run] for run in (fleet, "r4")}
    assert (len(by_run[fleet]), len(by_run["r4"])) == (2, 4)  # shares 1 : 2 of 6 slots
    full = await fleet_admit(bus, fleet, both)
    assert isinstance(full, AdmissionDeny) and full.reason.startswith("fleet-max-concurrent")
    retried = await fleet_admit(bus, fleet, both, rid="q0")
    assert retried == grants[0]

    # a trajectory of r4 lands in r4's accepted stream and nowhere else
    g = by_run["r4"][0]
    t = trajectory("r4", g, "r4-traj-1")
    await r4.publish(subjects.trajectory("r4", "r1"), t, msg_id=t.trajectory_id)

    async def accepted_in(run: str) -> list[str]:
        raw = await stream_messages(bus, streams.ACCEPTED(run), subjects.accepted(run))
        return [codec.decode(r, Trajectory).trajectory_id for r in raw]

    await wait_until(lambda: accepted_in("r4"), 10, "r4's accepted trajectory", interval=0.2)
    assert await accepted_in("r4") == ["r4-traj-1"] and await accepted_in(fleet) == []

    stopping = await asyncio.to_thread(lorabus_run, "stop", "r4", "--config", str(fleet_config))
    assert stopping.returncode == 0 and "run r4 stopping in fleet" in stopping.stdout, stopping.stderr
    # its grants run out (3 s leases), then it is stopped; the fleet never grants it again
    await wait_until(lambda: _state(bus, fleet, registry, "r4", "stopped"), 20, "r4 to be stopped", interval=0.3)
    records = await RunTable(bus, fleet).records()
    assert records["r4"].state == "stopped" and records["r4"].config["actor"]["lora_rank"] == 4
    later = [await fleet_admit(bus, fleet, both) for _ in range(3)]
    assert all(isinstance(g, AdmissionDeny) or g.run == fleet for g in later), later
    # a stopped run's name stays taken, and the table survives a restart
    registry.stop()
    registry.start()
    runs = await listed(bus, fleet, registry)
    assert (runs[fleet].state, runs["r4"].state) == ("active", "stopped")
    assert runs["r4"].head_version is None  # no registry runs for it any more
    reuse = await RunTable(bus, fleet).submit("r4", {"run": "r4"})
    assert not reuse.ok and "never reused" in reuse.problems[0]
    await r4.close()


async def _state(bus, fleet, registry, run, state) -> bool:
    return (await listed(bus, fleet, registry))[run].state == state
