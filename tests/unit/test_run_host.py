"""The run host (services/common/run_host.py) with a fake worker: the own run first, runs joining
and leaving with their records, one retirement however many ask, the own run closed last."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from proto.messages import RunRecord, RunStateName
from services.common.run_host import RunHost
from services.config import runconfig
from services.config.loader import load_config

FLEET = "examples/tiny.yaml"


class FakeBus:
    """What the host uses of a Bus: views, streams, closing; the run table cannot be read."""

    def __init__(self, run: str, log: list[str]):
        self.run, self.log = run, log
        self.closed = False

    def for_run(self, run: str) -> FakeBus:
        return FakeBus(run, self.log)

    async def ensure_streams(self) -> None:
        self.log.append(f"streams {self.run}")

    async def key_value(self, bucket: str):
        raise PermissionError(f"no rights on {bucket}")

    async def close(self) -> None:
        self.closed = True
        self.log.append(f"bus closed {self.run}")


class FakeWorker:
    def __init__(self, run: str, bus: FakeBus, log: list[str], *, hold: asyncio.Event | None = None):
        self.run, self.bus, self.log, self.hold = run, bus, log, hold

    async def start(self) -> None:
        self.log.append(f"start {self.run}")

    async def drain(self) -> None:
        self.log.append(f"drain {self.run}")
        if self.hold is not None:
            await self.hold.wait()

    async def close(self) -> None:
        self.log.append(f"close {self.run}")


def record(cfg, run: str, state: RunStateName) -> RunRecord:
    run_cfg = runconfig.run_config(cfg, runconfig.fleet_tree(FLEET, ["run_dir=/tmp/host-x"]), {"run": run})
    return RunRecord(fleet=cfg.run, run=run, state=state, share=1.0, config=runconfig.stored(run_cfg),
                     submitted_at=0.0, changed_at=0.0)  # fmt: skip


@pytest.fixture
def fleet():
    cfg = load_config(FLEET, ["run_dir=/tmp/host-x"])
    log: list[str] = []
    workers: dict[str, FakeWorker] = {}
    holds: dict[str, asyncio.Event] = {}

    async def make(run_cfg, bus) -> FakeWorker:
        workers[run_cfg.run] = FakeWorker(run_cfg.run, bus, log, hold=holds.get(run_cfg.run))
        return workers[run_cfg.run]

    host = RunHost(cfg, FakeBus(cfg.run, log), make, name="test")  # type: ignore[arg-type]
    return cfg, host, log, workers, holds


async def test_the_own_run_is_the_first_run_and_the_only_one_without_the_table(fleet):
    cfg, host, log, workers, _ = fleet
    own = await host.start()
    assert own is workers[cfg.run] and list(host.workers) == [cfg.run]
    assert log == [f"start {cfg.run}"]  # the own run on the process's bus: no view, no streams
    assert own.bus is host.bus
    await host.close()
    assert log[-2:] == [f"drain {cfg.run}", f"close {cfg.run}"] and not host.workers
    assert not host.bus.closed  # the process's bus is the process's to close


async def test_runs_join_on_their_record_and_leave_on_an_ending_one(fleet):
    cfg, host, log, workers, _ = fleet
    await host.start()
    await host.on_record(record(cfg, "r2", "active"))
    assert list(host.workers) == [cfg.run, "r2"]
    assert workers["r2"].bus.run == "r2" and "streams r2" in log  # its own view, streams ensured
    await host.on_record(record(cfg, "r2", "stopping"))  # neither opens nor ends (the default)
    assert "drain r2" not in log
    await host.on_record(record(cfg, "r2", "stopped"))
    assert "r2" not in host.workers and set(host.ended) == {"r2"} and workers["r2"].bus.closed
    assert log[-3:] == ["drain r2", "close r2", "bus closed r2"]
    await host.on_record(record(cfg, "r2", "active"))  # a retired run is never served again here
    assert "r2" not in host.workers
    await host.on_record(record(cfg, cfg.run, "stopped"))  # the own run's record changes nothing
    assert cfg.run in host.workers
    await host.close()


async def test_a_resumed_run_is_served_again_and_retires_anew(fleet):
    cfg, host, log, workers, _ = fleet
    await host.start()

    def at(state: RunStateName, t: float) -> RunRecord:
        return msgspec.structs.replace(record(cfg, "r2", state), changed_at=t)

    await host.on_record(at("active", 1.0))
    await host.on_record(at("stopping", 2.0))
    await host.on_record(at("stopped", 3.0))
    assert "r2" not in host.workers
    await host.on_record(at("active", 1.0))  # an old record (a replay): not a resume
    assert "r2" not in host.workers
    await host.on_record(at("active", 4.0))  # `lorabus run resume`
    assert "r2" in host.workers and "r2" not in host.ended and log.count("start r2") == 2
    await host.on_record(at("stopped", 5.0))
    assert "r2" not in host.workers and log.count("close r2") == 2
    await host.close()


async def test_states_a_service_opens_and_ends_are_its_own(fleet):
    cfg, _, log, _, _ = fleet

    async def make(run_cfg, bus):
        return FakeWorker(run_cfg.run, bus, log)

    host = RunHost(cfg, FakeBus(cfg.run, log), make, name="export", opens=("active", "stopped"), ends=())  # type: ignore[arg-type]
    await host.start()
    await host.on_record(record(cfg, "old", "stopped"))
    assert "old" in host.workers  # an exporter exports a stopped run's last versions too
    await host.on_record(record(cfg, "old", "finished"))
    assert "old" in host.workers
    with pytest.raises(ValueError, match="opens/ends"):
        RunHost(cfg, FakeBus(cfg.run, log), make, name="x", opens=("active",), ends=("active",))  # type: ignore[arg-type]
    await host.close()


async def test_a_run_is_retired_once_however_many_ask(fleet):
    cfg, host, log, _, holds = fleet
    hold = holds["r3"] = asyncio.Event()
    await host.start()
    await host.on_record(record(cfg, "r3", "active"))
    by_record = asyncio.create_task(host.on_record(record(cfg, "r3", "finished")))
    by_owner = asyncio.create_task(host.retire("r3"))
    # a condition, not a time: a loaded machine can stall the loop past any sleep, and the drain
    # comes a loop turn after both tasks have asked (the retire task is created by the first)
    for _ in range(100):
        if "drain r3" in log:
            break
        await asyncio.sleep(0)
    assert log.count("drain r3") == 1 and "r3" in host.workers  # draining: still served
    hold.set()
    await asyncio.gather(by_record, by_owner)
    assert log.count("close r3") == 1 and "r3" not in host.workers
    await host.close()


async def test_others_close_before_the_own_run(fleet):
    cfg, host, log, _, _ = fleet
    await host.start()
    await host.on_record(record(cfg, "a", "active"))
    await host.on_record(record(cfg, "b", "active"))
    await host.close()
    closes = [line for line in log if line.startswith("close")]
    assert closes[-1] == f"close {cfg.run}" and sorted(closes[:-1]) == ["close a", "close b"]


async def test_a_run_that_cannot_start_is_left_unserved_and_the_others_go_on(fleet):
    cfg, _, log, _, _ = fleet

    async def make(run_cfg, bus):
        if run_cfg.run == "bad":
            raise RuntimeError("no adapter slot")
        return FakeWorker(run_cfg.run, bus, log)

    host = RunHost(cfg, FakeBus(cfg.run, log), make, name="test")  # type: ignore[arg-type]
    await host.start()
    await host.on_record(record(cfg, "bad", "active"))
    assert "bad" not in host.workers and "bus closed bad" in log  # its view is not left open
    await host.on_record(record(cfg, "good", "active"))
    assert "good" in host.workers
    await host.close()


async def test_other_runs_wait_for_ready(fleet):
    cfg, _, log, _, _ = fleet
    ready = asyncio.Event()

    async def make(run_cfg, bus):
        return FakeWorker(run_cfg.run, bus, log)

    host = RunHost(cfg, FakeBus(cfg.run, log), make, name="test", ready=ready)  # type: ignore[arg-type]
    await host.start()  # the own run does not wait: it is what makes the host ready
    joining = asyncio.create_task(host.on_record(record(cfg, "late", "active")))
    await asyncio.sleep(0.01)
    assert "late" not in host.workers
    ready.set()
    await joining
    assert "late" in host.workers
    await host.close()
