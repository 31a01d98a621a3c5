"""One trainer process, two runs (real nats-server, local store): a run that joins through the
fleet's run table gets its own adapter (another rank and targets) on the same model, trains on
its own accepted stream, and publishes its versions under its own subjects."""

from __future__ import annotations

import uuid

import msgspec
import torch

from proto import codec, subjects
from proto.messages import DeadLetter, RunRecord, TrainerStep
from services.common import streams
from services.common.bus import Bus
from services.common.models import load_base_model
from services.common.run_table import RunTable
from services.common.store import open_store
from services.config import runconfig
from services.config.loader import load_config
from services.config.schema import BusConfig, StoreConfig
from tests.fixtures.waiting import wait_until
from tests.integration.test_trainer_service import (  # noqa: F401 - tiny_model_dir is a fixture
    fetch_adapter,
    start_trainer,
    tiny_model_dir,
    trajectories,
    wait_event,
    write_config,
)


async def test_a_second_run_trains_beside_the_first(tmp_path, nats_url, tiny_model_dir):
    fleet = f"tf{uuid.uuid4().hex[:8]}"
    store_cfg = StoreConfig(uri=f"file://{tmp_path / 'store'}")
    config = write_config(tmp_path, fleet, nats_url, store_cfg, tiny_model_dir)
    fleet_cfg = load_config(config)
    run_cfg = runconfig.run_config(
        fleet_cfg,
        runconfig.fleet_tree(config),
        {"run": "two", "gconfig": {"lora_name": "two"}, "actor": {"lora_rank": 2, "target_modules": ["v_proj"]}},
    )
    store = open_store(store_cfg)
    model = load_base_model(tiny_model_dir, "float32", "cpu").eval()
    log = tmp_path / "trainer.log"
    bus = await Bus.connect(BusConfig(url=nats_url), run=fleet, service="tester")
    await bus.ensure_streams()
    two = bus.for_run("two")
    await two.ensure_streams()
    proc = start_trainer(config, log)
    try:
        v0 = await wait_event(bus, fleet, 0, proc, log)
        record = RunRecord(fleet=fleet, run="two", state="active", share=1.0, config=runconfig.stored(run_cfg),
                           submitted_at=1.0, changed_at=1.0)  # fmt: skip
        await RunTable(bus, record.fleet).put(record)
        t0 = await wait_event(two, "two", 0, proc, log)
        assert (v0.lora.rank, t0.lora.rank) == (4, 2) and t0.lora.target_modules == ["v_proj"]
        assert t0.lora_name == "two" and t0.run == "two"
        assert t0.object_payload().uri.endswith("two/adapters/v0/adapter_model.safetensors")

        for traj in trajectories(model, "two", 0):
            await two.publish(subjects.accepted("two"), traj, msg_id=traj.trajectory_id)
        t1 = await wait_event(two, "two", 1, proc, log)
        w0, w1 = fetch_adapter(store, t0), fetch_adapter(store, t1)
        assert w1.keys() == w0.keys() and all("v_proj" in k for k in w1)
        assert any(not torch.equal(w0[k], w1[k]) for k in w0 if "lora_B" in k)
        # the fleet's own run has not moved: its stream got nothing
        assert await bus.last(streams.TRAINER(fleet), TrainerStep) is None
        for traj in trajectories(model, fleet, 10):
            await bus.publish(subjects.accepted(fleet), traj, msg_id=traj.trajectory_id)
        v1 = await wait_event(bus, fleet, 1, proc, log)
        assert v1.lora.rank == 4
        steps = {run: await b.last(streams.TRAINER(run), TrainerStep) for run, b in ((fleet, bus), ("two", two))}
        assert steps[fleet].run == fleet and steps["two"].run == "two"
        assert steps[fleet].version == steps["two"].version == 1
        # a trajectory of another run on a run's stream is refused, never trained
        stray = trajectories(model, fleet, 20)[0]
        await two.publish(subjects.accepted("two"), stray, msg_id="stray")

        async def refused() -> DeadLetter | None:
            raw = await two.last_raw(streams.DEADLETTER("two"))
            return None if raw is None else codec.decode(raw.data, DeadLetter)

        letter = await wait_until(refused, 30, lambda: f"the stray trajectory refused:\n{log.read_text()[-3000:]}")
        assert letter.reason == "validation" and f"{fleet!r} is not this trainer's run 'two'" in letter.error
        # stopping the run: the trainer closes it and its adapter leaves the model
        await RunTable(bus, record.fleet).put(msgspec.structs.replace(record, state="stopping", changed_at=2.0))
        await wait_until(lambda: "run two: closed at v1" in log.read_text(), 30, lambda: log.read_text()[-3000:])
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        await two.close()
        await bus.close()
