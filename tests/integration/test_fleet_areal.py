"""`lorabus run submit AREAL.yaml --config FLEET` against the registry (real nats-server): the
AReaL experiment is translated with `lorabus up`'s table, submitted as its run keys, and the
registry takes it as a run of its own name, rank and learning rate."""

from __future__ import annotations

import asyncio

import yaml

from services.common.run_table import RunTable
from services.config import runconfig
from tests.integration.test_fleet_registry import (  # noqa: F401 - bus, fleet, fleet_config, registry are fixtures
    bus,
    fleet,
    fleet_config,
    listed,
    lorabus_run,
    registry,
)


async def test_an_areal_experiment_is_submitted_as_a_run(bus, registry, fleet, fleet_config, tmp_path):
    await listed(bus, fleet, registry)
    tree = yaml.safe_load(open("examples/areal_tiny.yaml"))
    tree["trial_name"] = trial = f"a{fleet[-6:]}"  # names of this test only: streams outlive it
    tree["actor"]["lora_rank"] = 4
    tree["actor"]["optimizer"]["lr"] = 5e-4
    path = tmp_path / "areal_run.yaml"
    path.write_text(yaml.safe_dump(tree))
    done = await asyncio.to_thread(lorabus_run, "submit", str(path), "--config", str(fleet_config))
    assert done.returncode == 0, done.stderr
    assert f"run tiny-{trial} submitted to fleet" in done.stdout and "rank 4" in done.stdout
    assert "is an AReaL experiment file" in done.stderr and "actor.optimizer.lr" in done.stderr
    record = (await RunTable(bus, fleet).records())[f"tiny-{trial}"]
    cfg = runconfig.restore(record.config, (await asyncio.to_thread(_fleet_cfg, fleet_config)))
    assert (cfg.actor.lora_rank, cfg.actor.optimizer.lr, cfg.total_train_steps) == (4, 5e-4, 40)
    assert cfg.actor.path == "examples/tiny/model" and cfg.run_dir.endswith(f"{fleet}/runs/tiny-{trial}")


def _fleet_cfg(path):
    from services.config.loader import load_config

    return load_config(path)


async def test_a_fleet_started_from_an_areal_file_takes_runs(nats_url, tmp_path):
    from services.common.bus import Bus
    from services.config.schema import BusConfig
    from tests.fixtures.service_process import ServiceProcess

    tree = yaml.safe_load(open("examples/areal_tiny.yaml"))
    tree["trial_name"] = f"f{tmp_path.name[-6:]}"
    tree["lorabus"]["bus"] = {"url": nats_url}
    tree["lorabus"]["metrics"] = {"host": "127.0.0.1", "port": 0}
    tree["lorabus"]["run_dir"] = str(tmp_path / "fleet")
    tree["lorabus"]["fleet"] = {"max_runs": 2, "lora_slots": 8}
    config = tmp_path / "areal_fleet.yaml"
    config.write_text(yaml.safe_dump(tree))
    fleet = f"tiny-{tree['trial_name']}"
    registry = ServiceProcess("services.registry", config, tmp_path / "registry.log", stop_timeout_s=10.0)
    registry.start()
    bus = await Bus.connect(BusConfig(url=nats_url), run=fleet, service="tester")
    try:
        assert fleet in await listed(bus, fleet, registry)
        run_file = tmp_path / "r2.yaml"
        run = f"r2{tree['trial_name']}"
        run_file.write_text(yaml.safe_dump({"run": run, "actor": {"lora_rank": 4}}))
        done = await asyncio.to_thread(lorabus_run, "submit", str(run_file), "--config", str(config))
        assert done.returncode == 0, done.stderr + registry.log_tail()
        runs = await listed(bus, fleet, registry)
        assert runs[run].lora_rank == 4 and runs[fleet].lora_rank == 8
    finally:
        registry.stop()
        await bus.close()
