"""The evaluator of a fleet scores every run's exports under that run (`python -m
services.clients.evaluate`, real nats-server and registry): the fleet's own run and a run
submitted to it each get their v0 scored with their own held-out config (the submitted run's
reward is a constant 1.0, so its score says whose config was used), published on their own
eval subject and stream, and a run submitted after the evaluator started is picked up from the
run table."""

from __future__ import annotations

import uuid
from pathlib import Path

import msgspec
import pytest
import yaml
from peft import LoraConfig, get_peft_model

from proto import messages as m
from proto import subjects
from services.common import streams
from services.common.bus import Bus
from services.common.models import load_base_model
from services.common.run_table import RunTable
from services.config import runconfig
from services.config.loader import load_config
from services.config.schema import BusConfig
from services.exporter.peft_dir import version_uri
from tests.fixtures.service_process import REPO, ServiceProcess
from tests.fixtures.waiting import wait_until
from tests.integration.test_fleet_registry import listed

TINY = REPO / "examples" / "tiny.yaml"


@pytest.fixture
def fleet() -> str:
    return f"evalfleet{uuid.uuid4().hex[:8]}"


@pytest.fixture
def fleet_config(tmp_path, nats_url, fleet) -> Path:
    tree = yaml.safe_load(TINY.read_text())
    del tree["experiment_name"], tree["trial_name"]
    tree.update(run=fleet, run_dir=f"{tmp_path}/runs/{fleet}", total_train_steps=2)
    tree["bus"] = {"url": nats_url}
    tree["metrics"] = {"host": "127.0.0.1", "port": 0}
    tree["fleet"] = {"lora_slots": 16}
    tree["evaluator"] = {"max_prompts": 4, "device": "cpu"}
    config = tmp_path / "fleet.yaml"
    config.write_text(yaml.safe_dump(tree))
    return config


@pytest.fixture
def processes(tmp_path, fleet_config):
    started: list[ServiceProcess] = []

    def start(module: str) -> ServiceProcess:
        proc = ServiceProcess(module, fleet_config, tmp_path / f"{module.rsplit('.', 1)[-1]}.log", stop_timeout_s=10.0)
        proc.start()
        started.append(proc)
        return proc

    yield start
    for proc in reversed(started):
        proc.stop()


def export_v0(uri: str, rank: int) -> m.ExportDone:
    """A PEFT directory of rank `rank` at v0 of `uri` (exporter.uri), and its ExportDone."""
    directory = Path(version_uri(uri, 0).removeprefix("file://"))
    model = get_peft_model(
        load_base_model(REPO / "examples/tiny/model"), LoraConfig(r=rank, target_modules="all-linear")
    )
    model.save_pretrained(str(directory))
    weights = directory / "adapter_model.safetensors"
    return m.ExportDone(run="x", lora_name="tiny_lora", version=0, uri=f"file://{directory}",
                        files=sorted(p.name for p in directory.iterdir()), bytes=weights.stat().st_size,
                        sha256="0" * 64, exported_at=0.0)  # fmt: skip


async def test_every_run_of_the_fleet_is_scored_under_its_own_run(tmp_path, nats_url, fleet, fleet_config, processes):
    registry = processes("services.registry")
    bus = await Bus.connect(BusConfig(url=nats_url), run=fleet, service="tester")
    try:
        await bus.ensure_streams()
        await listed(bus, fleet, registry)
        own_cfg = load_config(fleet_config)
        evaluator = processes("services.clients.evaluate")

        # the fleet's own run, then a run submitted while the evaluator runs
        own = msgspec.structs.replace(export_v0(own_cfg.exporter.uri, 8), run=fleet)
        await bus.publish(subjects.export_done(fleet, 0), own, msg_id=f"{fleet}-export-v0")
        other = "const"
        reply = await RunTable(bus, fleet).submit(
            other,
            {"run": other, "gconfig": {"lora_name": "const_lora"}, "actor": {"lora_rank": 4},
             "valid_dataset": {"path": "builtin:arith:valid", "reward_fn": "tests.fixtures.constant_reward:one"}},
        )  # fmt: skip
        assert reply.ok, reply.problems
        record = (await RunTable(bus, fleet).records())[other]
        other_cfg = runconfig.restore(record.config, own_cfg)
        view = bus.for_run(other)
        await view.ensure_streams()
        done = msgspec.structs.replace(export_v0(other_cfg.exporter.uri, 4), run=other)
        await view.publish(subjects.export_done(other, 0), done, msg_id=f"{other}-export-v0")

        async def results(run: str) -> list[m.EvalResult]:
            assert evaluator.alive(), evaluator.log_tail()
            return await (view if run == other else bus).read_all(streams.EVALS(run), m.EvalResult)

        async def scored() -> dict | None:
            got = {run: await results(run) for run in (fleet, other)}
            return got if all(got.values()) else None

        got = await wait_until(scored, 120, lambda: f"both runs scored:\n{evaluator.log_tail()}", interval=0.5)
        for run, [result] in got.items():
            assert (result.run, result.evaluator, result.version, result.n) == (run, "heldout", 0, 4)
            assert result.metric == "heldout_reward"
        assert got[other][0].score == 1.0  # its own reward, not the fleet's
        assert got[fleet][0].score < 1.0, "the fleet's own arithmetic reward on an untrained adapter"
        log = evaluator.log_text()
        assert f"run {other}: v0 heldout_reward=1.0000" in log and f"run {fleet}: v0 heldout_reward=" in log
        await view.close()
    finally:
        await bus.close()
