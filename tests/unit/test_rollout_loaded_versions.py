"""`lorabus_rollout_loaded_versions` follows what the engine holds: old versions leave it once
they are outside the keep window and unpinned, and the gauge says so at the next scrape (the
soak benchmark reads it to show that a long run keeps a fixed number loaded)."""

from __future__ import annotations

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


def gauge(replica: str) -> float | None:
    return REGISTRY.get_sample_value("lorabus_rollout_loaded_versions", {"replica": replica})


async def test_the_gauge_counts_the_versions_held_and_falls_as_old_ones_are_unloaded():
    engine, bus = Engine(), Bus()
    follower = AdapterFollower(
        load_config("examples/tiny.yaml"), "gauge-test", engine, bus,
        keep=2, fetch=lambda ev: b"", engine_name="embedded", load_attempts=1, retry_base_s=0.0,
    )  # fmt: skip
    assert gauge("gauge-test") == 0
    for version in range(4):
        follower.book.mark_loaded(version)
    follower.book.pin(1)
    assert gauge("gauge-test") == 4

    await follower.collect()  # v0 goes; v1 is outside the window but a request still uses it
    assert engine.unloaded == [0] and gauge("gauge-test") == 3

    follower.book.unpin(1)
    await follower.collect()
    assert engine.unloaded == [0, 1] and gauge("gauge-test") == 2
    assert len(bus.published) == 2  # each unload reported
