"""The fleet's trainer-memory quota at submit and resume (`python -m services.registry`, real
nats-server): `fleet.max_adapter_memory_gib` sized to take the fleet's own run and one small run;
a larger run is refused by `lorabus run submit` with the run, its bytes, the live total and the
budget; once the small run stops its room is free again, and resuming it while another holds
that room is refused the same way. `lorabus run list` and the registry's /metrics show what the
quota counted per run."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request
import uuid
from pathlib import Path

import msgspec
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from services.common import adapter_memory
from services.common.run_table import RunTable
from services.config.loader import backfill
from services.config.schema import LorabusConfig
from tests.fixtures.waiting import wait_until
from tests.integration.test_fleet_registry import (  # noqa: F401 - bus and registry are fixtures
    _state,
    bus,
    listed,
    lorabus_run,
    registry,
)

TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny" / "model"
SHAPE = adapter_memory.base_shape(json.loads((TINY / "config.json").read_text()))


def size(rank: int, targets: list[str] | None = None) -> int:
    tree = {"actor": {"lora_rank": rank, "target_modules": targets or []}}
    return adapter_memory.run_memory(backfill(msgspec.convert(tree, LorabusConfig)), SHAPE).total


OWN, SMALL, BIG = size(32), size(4), size(16)
BUDGET_GIB = (OWN + SMALL) / adapter_memory.GIB
"""room for the fleet's own run (rank 32, all-linear: the default actor) and one rank-4 run"""


@pytest.fixture
def fleet() -> str:
    return f"quota{uuid.uuid4().hex[:8]}"


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
fleet: {{lora_slots: 16, max_lora_rank: 32, max_adapter_memory_gib: {BUDGET_GIB!r}}}
"""
    )
    return config


def memory_gauges(registry) -> dict[str, float]:
    """The registry's lorabus_fleet_adapter_memory_bytes by run, and its budget under ''."""
    found = re.search(r"metrics on :(\d+)", registry.log_text())
    assert found, registry.log_tail()
    port = found.group(1)
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            if sample.name == "lorabus_fleet_adapter_memory_bytes":
                out[sample.labels["run"]] = sample.value
            elif sample.name == "lorabus_fleet_adapter_memory_budget_bytes":
                out[""] = sample.value
    return out


def run_file(tmp_path: Path, run: str, rank: int) -> Path:
    path = tmp_path / f"{run}.yaml"
    path.write_text(yaml.safe_dump({"run": run, "gconfig": {"lora_name": run}, "actor": {"lora_rank": rank}}))
    return path


async def test_a_run_beyond_the_memory_budget_is_refused_at_submit_and_resume(
    bus, registry, fleet, fleet_config, tmp_path
):
    assert list(await listed(bus, fleet, registry)) == [fleet]

    async def submit(path: Path):
        return await asyncio.to_thread(lorabus_run, "submit", str(path), "--config", str(fleet_config))

    small = await submit(run_file(tmp_path, "small", 4))
    assert small.returncode == 0, small.stderr
    assert f"rank 4, trainer memory {adapter_memory.human(SMALL)}" in small.stdout

    big = await submit(run_file(tmp_path, "big", 16))
    assert big.returncode == 1, big.stdout
    refusal = next(line for line in big.stderr.splitlines() if "fleet.max_adapter_memory_gib" in line)
    assert f"fleet.max_adapter_memory_gib: {BUDGET_GIB:g} ({adapter_memory.human(OWN + SMALL)})" in refusal
    assert (
        f"too little for run 'big': its adapter (rank 16, adamw) needs {adapter_memory.human(BIG)} ({BIG} bytes"
        in refusal
    )
    assert f"the live runs ({fleet}, small) hold {adapter_memory.human(OWN + SMALL)}" in refusal
    assert "; stop a run, lower its actor.lora_rank" in refusal
    assert "big" not in await listed(bus, fleet, registry)
    table = await asyncio.to_thread(lorabus_run, "list", "--config", str(fleet_config))
    header, *rows = table.stdout.splitlines()
    assert "memory" in header.split() and any(
        r.split()[0] == "small" and adapter_memory.human(SMALL) in r for r in rows
    )
    gauges = await asyncio.to_thread(memory_gauges, registry)  # what the quota counted, on /metrics
    assert gauges == {"": int(BUDGET_GIB * adapter_memory.GIB), fleet: OWN, "small": SMALL}

    # a stopped run holds no trainer memory: its room takes another run of its size
    runs_table = RunTable(bus, fleet)
    assert (await runs_table.stop("small")).ok
    await wait_until(lambda: _state(bus, fleet, registry, "small", "stopped"), 20, "small stopped", interval=0.3)
    other = await submit(run_file(tmp_path, "other", 4))
    assert other.returncode == 0, other.stderr
    resumed = await runs_table.resume("small")
    assert not resumed.ok and len(resumed.problems) == 1
    assert resumed.problems[0].startswith("fleet.max_adapter_memory_gib: ") and "run 'small'" in resumed.problems[0]
    runs = await listed(bus, fleet, registry)
    assert (runs["small"].state, runs["other"].state) == ("stopped", "active")
    gauges = await asyncio.to_thread(memory_gauges, registry)
    assert (gauges["small"], gauges["other"]) == (0, SMALL)
