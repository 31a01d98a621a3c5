"""Tenants that cannot hurt each other (real nats-server, the registry and the trainer as their
own processes): a submitted run whose adapter cannot join the base model, and one whose trainer
step raises, are each stopped with their reason in the run table (`lorabus run list` shows
it), while the fleet's own run and a healthy submitted run go on training in the same trainer;
a run stopped by request is resumed under its name and trains on from its checkpoint."""

from __future__ import annotations

import asyncio
import uuid

import yaml

from proto import subjects
from services.common import run_faults
from services.common.bus import Bus
from services.common.models import load_base_model
from services.common.run_table import RunTable
from services.common.store import open_store
from services.config.schema import BusConfig, StoreConfig
from tests.fixtures.service_process import ServiceProcess
from tests.fixtures.waiting import wait_until
from tests.integration.test_fleet_registry import listed, lorabus_run
from tests.integration.test_trainer_service import (  # noqa: F401 - tiny_model_dir is a fixture
    start_trainer,
    tiny_model_dir,
    trajectories,
    wait_event,
    write_config,
)


async def test_a_failing_run_is_stopped_with_its_reason_and_the_others_go_on(tmp_path, nats_url, tiny_model_dir):
    fleet = f"ff{uuid.uuid4().hex[:8]}"
    store_cfg = StoreConfig(uri=f"file://{tmp_path / 'store'}")
    config = write_config(tmp_path, fleet, nats_url, store_cfg, tiny_model_dir)
    doc = yaml.safe_load(config.read_text())
    doc["total_train_steps"] = 20
    doc["fleet"] = {"max_runs": 4, "lora_slots": 16}
    config.write_text(yaml.safe_dump(doc))
    registry = ServiceProcess("services.registry", config, tmp_path / "registry.log", stop_timeout_s=10.0)
    registry.start()
    bus = await Bus.connect(BusConfig(url=nats_url), run=fleet, service="tester")
    await bus.ensure_streams()
    log = tmp_path / "trainer.log"
    proc = start_trainer(config, log)
    views: list[Bus] = []
    try:
        await listed(bus, fleet, registry)
        table = RunTable(bus, fleet)
        tag = fleet[2:6]  # names of this test only: streams outlive a test on the shared nats-server
        good, nomodule, badstep = f"good{tag}", f"nomodule{tag}", f"badstep{tag}"
        runs = {
            good: {"actor": {"lora_rank": 2}},
            # valid config, but the model has no such module: the adapter cannot join the model
            nomodule: {"actor": {"target_modules": ["nonexistent_proj"]}},
            # valid config, but more PPO minibatches than a batch has completions: every step raises
            badstep: {"actor": {"ppo": {"ppo_n_minibatches": 1000}}},
        }
        for run, keys in runs.items():
            reply = await table.submit(run, {"run": run, **keys})
            assert reply.ok, reply.problems
        await wait_event(bus, fleet, 0, proc, log)

        async def state(run: str) -> tuple[str, str]:
            info = (await listed(bus, fleet, registry))[run]
            return info.state, info.reason

        def what() -> str:
            return f"trainer:\n{log.read_text()[-3000:]}\nregistry:\n{registry.log_tail()}"

        # the adapter that cannot join: reported when the trainer opens the run
        await wait_until(lambda: _stopped(state, nomodule), 60, what, interval=0.3)
        _, why = await state(nomodule)
        assert why.startswith("failed in trainer: its adapter cannot join the base model: actor.target_modules: "
                              "['nonexistent_proj'] did not match the model"), why  # fmt: skip
        assert run_faults.failed(why)

        model = load_base_model(tiny_model_dir, "float32", "cpu").eval()
        for run in (good, badstep):
            view = bus.for_run(run)
            views.append(view)
            await wait_event(view, run, 0, proc, log)
            for traj in trajectories(model, run, 0):
                await view.publish(subjects.accepted(run), traj, msg_id=traj.trajectory_id)
        # the step that raises: reported after it, the run retired; the healthy runs train on
        await wait_until(lambda: _stopped(state, badstep), 60, what, interval=0.3)
        _, why = await state(badstep)
        assert why.startswith("failed in trainer: step 0 on 2 groups raised ValueError(") and "ppo_n_minibatches" in why
        await wait_until(lambda: f"run {badstep}: closed" in log.read_text(), 30, what)
        await wait_event(views[0], good, 1, proc, log)
        for traj in trajectories(model, fleet, 10):
            await bus.publish(subjects.accepted(fleet), traj, msg_id=traj.trajectory_id)
        await wait_event(bus, fleet, 1, proc, log)
        assert proc.poll() is None and (await state(good))[0] == "active"
        # what the run table says, as the operator sees it
        listing = await asyncio.to_thread(lorabus_run, "list", "--config", str(config))
        assert listing.returncode == 0, listing.stderr
        line = next(x for x in listing.stdout.splitlines() if x.startswith(f"{badstep} "))
        assert "failed in trainer: step 0" in line
        # the failed runs' first versions stay, as a stopped run's do
        store = open_store(store_cfg)
        assert store.exists(f"{badstep}/adapters/v0/adapter_model.safetensors")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        registry.stop()
        for view in views:
            await view.close()
        await bus.close()


async def _stopped(state, run: str) -> bool:
    return (await state(run))[0] in ("stopping", "stopped")


async def test_a_stopped_run_resumes_from_its_checkpoint(tmp_path, nats_url, tiny_model_dir):
    fleet = f"fr{uuid.uuid4().hex[:8]}"
    store_cfg = StoreConfig(uri=f"file://{tmp_path / 'store'}")
    config = write_config(tmp_path, fleet, nats_url, store_cfg, tiny_model_dir)
    doc = yaml.safe_load(config.read_text())
    doc["total_train_steps"] = 20
    doc["fleet"] = {"max_runs": 2, "lora_slots": 8}
    config.write_text(yaml.safe_dump(doc))
    registry = ServiceProcess("services.registry", config, tmp_path / "registry.log", stop_timeout_s=10.0)
    registry.start()
    bus = await Bus.connect(BusConfig(url=nats_url), run=fleet, service="tester")
    await bus.ensure_streams()
    log = tmp_path / "trainer.log"
    proc = start_trainer(config, log)
    r = f"res{uuid.uuid4().hex[:6]}"
    two = bus.for_run(r)
    try:
        await listed(bus, fleet, registry)
        assert (await RunTable(bus, fleet).submit(r, {"run": r, "actor": {"lora_rank": 2}})).ok
        model = load_base_model(tiny_model_dir, "float32", "cpu").eval()

        def what() -> str:
            return f"trainer:\n{log.read_text()[-3000:]}\nregistry:\n{registry.log_tail()}"

        await wait_event(two, r, 0, proc, log)
        for traj in trajectories(model, r, 0):
            await two.publish(subjects.accepted(r), traj, msg_id=traj.trajectory_id)
        v1 = await wait_event(two, r, 1, proc, log)
        # resuming what is active or unknown is refused or a no-op, with the reason
        unknown = await asyncio.to_thread(lorabus_run, "resume", "nobody", "--config", str(config))
        assert unknown.returncode == 1 and "'nobody' is not a run of this fleet" in unknown.stderr
        stopped = await asyncio.to_thread(lorabus_run, "stop", r, "--config", str(config))
        assert stopped.returncode == 0, stopped.stderr
        await wait_until(lambda: f"run {r}: closed at v1" in log.read_text(), 30, what)
        await wait_until(lambda: _in(bus, fleet, registry, r, "stopped"), 30, what, interval=0.3)

        resumed = await asyncio.to_thread(lorabus_run, "resume", r, "--config", str(config))
        assert resumed.returncode == 0 and f"run {r} resumed in fleet" in resumed.stdout, resumed.stderr
        assert (await listed(bus, fleet, registry))[r].state == "active"
        await wait_until(lambda: f"run {r}: v1 was already announced" in log.read_text(), 60, what)
        for traj in trajectories(model, r, 10):
            await two.publish(subjects.accepted(r), traj, msg_id=traj.trajectory_id)
        v2 = await wait_event(two, r, 2, proc, log)
        assert v2.parent_version == 1 and v2.trainer_step == v1.trainer_step + 1 == 2
        assert v2.trainer_epoch == v1.trainer_epoch  # the same lineage, not a new run
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        registry.stop()
        await two.close()
        await bus.close()


async def _in(bus, fleet, registry, run: str, state: str) -> bool:
    return (await listed(bus, fleet, registry))[run].state == state
