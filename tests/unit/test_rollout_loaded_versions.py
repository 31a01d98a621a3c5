"""`lorabus_rollout_loaded_versions` follows what the engine holds: old versions leave it once
they are outside the keep window and unpinned, and the gauge says so at the next scrape (the
soak benchmark reads it to show that a long run keeps a fixed number loaded). A replica serving
two runs (one follower each, as a fleet replica) exposes one series per run."""

from __future__ import annotations

import msgspec
import pytest
from prometheus_client import REGISTRY

from services.config.loader import load_config
from services.rollout.adapters import AdapterFollower

pytestmark = pytest.mark.unit


class Engine:
    def __init__(self):
        self.unloaded: list[int] = []

    async def unload_version(self, version: int) -> None:
        self.unloaded.append(version)


class Bus:
    def __init__(self):
        self.published: list[str] = []

    async def publish(self, subject, msg, *, msg_id=None) -> None:
        self.published.append(subject)


def gauge(replica: str, run: str = "tiny") -> float | None:
    return REGISTRY.get_sample_value("lorabus_rollout_loaded_versions", {"run": run, "replica": replica})


def follower(engine, bus, replica: str, run: str = "tiny") -> AdapterFollower:
    cfg = msgspec.structs.replace(load_config("examples/tiny.yaml"), run=run)
    return AdapterFollower(
        cfg, replica, engine, bus,
        keep=2, fetch=lambda ev: b"", engine_name="embedded", load_attempts=1, retry_base_s=0.0,
    )  # fmt: skip


async def test_the_gauge_counts_the_versions_held_and_falls_as_old_ones_are_unloaded():
    engine, bus = Engine(), Bus()
    held = follower(engine, bus, "gauge-test")
    assert gauge("gauge-test") == 0
    for version in range(4):
        held.book.mark_loaded(version)
    held.book.pin(1)
    assert gauge("gauge-test") == 4

    await held.collect()  # v0 goes; v1 is outside the window but a request still uses it
    assert engine.unloaded == [0] and gauge("gauge-test") == 3

    held.book.unpin(1)
    await held.collect()
    assert engine.unloaded == [0, 1] and gauge("gauge-test") == 2
    assert len(bus.published) == 2  # each unload reported


async def test_a_replica_serving_two_runs_exposes_a_series_per_run():
    engine, bus = Engine(), Bus()
    first, second = follower(engine, bus, "two-runs", run="ra"), follower(engine, bus, "two-runs", run="rb")
    for version in range(3):
        first.book.mark_loaded(version)
    second.book.mark_loaded(0)
    assert gauge("two-runs", run="ra") == 3 and gauge("two-runs", run="rb") == 1
    await first.collect()  # one run's versions leaving says nothing of the other's
    assert gauge("two-runs", run="ra") == 2 and gauge("two-runs", run="rb") == 1

    await first.close()  # the replica no longer serves ra: its present-state series leave
    assert gauge("two-runs", run="ra") is None and gauge("two-runs", run="rb") == 1
