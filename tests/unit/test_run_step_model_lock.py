"""`runs.steps` holds the fleet's shared model for the update and the canary only: the next run's
step may start while this one's version is still being stored or broadcast, and never while
the model is being read; a run's own next step may too, its publications kept in order. A
joint step publishes each run on its own and faults only the run that failed; the scheduler
steps every ready run of a shared model with the one the share picks."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import types

import pytest
import torch

from proto.messages import TrainerStep
from services.config.loader import load_config
from services.trainer import runs
from services.trainer.engines.base import StepStats


class Engine:
    world_size = 1
    step = 0


class Followers:
    def send(self, work) -> None:
        pass


class Bus:
    def __init__(self) -> None:
        self.published: list = []

    async def publish(self, subject, msg, msg_id=None) -> None:
        self.published.append(msg)


class Queue:
    trained: list = []

    def __init__(self) -> None:
        self.acked = False

    async def refuse(self, refused) -> None:
        pass

    def mark_trained(self, ids) -> None:
        pass

    async def ack(self, ids) -> None:
        self.acked = True


@dataclasses.dataclass(frozen=True)
class SlowAnnounce(runs.Rank0):
    """An announcement (upload or broadcast) that ends when `go` is set."""

    entered: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    go: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)

    async def announce(self, version, tensors, *, weights=None, canary_follows=False, trainer_step=None):
        self.entered.set()
        await self.go.wait()
        return None


@pytest.mark.asyncio
async def test_the_model_is_free_while_the_version_is_on_its_way(monkeypatch):
    model = asyncio.Lock()
    held_during_update: list[bool] = []

    def run_steps(members):
        assert threading.current_thread() is not threading.main_thread()
        held_during_update.append(model.locked())
        stats = StepStats(step=0, loss=0.0, reward_mean=0.5, groups=2, tokens=10, grad_norm=0.0, lr=1e-4,
                          step_seconds=0.1, trained_at=1.0)  # fmt: skip
        return [(stats, {}, None)]

    monkeypatch.setattr(runs, "run_steps", run_steps)
    cfg = load_config("examples/tiny.yaml", [])
    bus, queue = Bus(), Queue()
    ctx = SlowAnnounce(cfg, Engine(), bus, None, asyncio.Event(), Followers(), None, "epoch")  # type: ignore[arg-type]
    stepping = asyncio.create_task(runs.step(ctx, queue, [], 3, model))  # type: ignore[arg-type]
    await asyncio.wait_for(ctx.entered.wait(), 10)
    assert held_during_update == [True]
    # the announcement is under way: another run's step can take the model now
    await asyncio.wait_for(model.acquire(), 1)
    model.release()
    assert not stepping.done() and not queue.acked and not bus.published
    ctx.go.set()
    assert await asyncio.wait_for(stepping, 10) == 4
    assert queue.acked and isinstance(bus.published[0], TrainerStep) and bus.published[0].version == 4
    assert not model.locked()


@pytest.mark.asyncio
async def test_a_failed_update_gives_the_model_back(monkeypatch):
    def run_steps(members):  # ranks.run_steps hands each run's exception back
        return [RuntimeError("CUDA error: an illegal memory access")]

    monkeypatch.setattr(runs, "run_steps", run_steps)
    model = asyncio.Lock()
    ctx = SlowAnnounce(load_config("examples/tiny.yaml", []), Engine(), Bus(), None, asyncio.Event(), Followers(),
                       None, "epoch")  # type: ignore[arg-type]  # fmt: skip
    with pytest.raises(runs.RunFault, match="illegal memory access"):
        await runs.step(ctx, Queue(), [], 3, model)  # type: ignore[arg-type]
    assert not model.locked()


@pytest.mark.asyncio
async def test_a_joint_step_publishes_each_run_and_faults_only_the_one_that_failed(monkeypatch):
    def run_steps(members):
        assert len(members) == 2
        stats = StepStats(step=0, loss=0.0, reward_mean=0.5, groups=2, tokens=10, grad_norm=0.0, lr=1e-4,
                          step_seconds=0.1, trained_at=1.0)  # fmt: skip
        return [(stats, {}, None), RuntimeError("trajectory t1: token id 99999 >= the model's vocab size")]

    monkeypatch.setattr(runs, "run_steps", run_steps)
    model = asyncio.Lock()
    cfg = load_config("examples/tiny.yaml", [])
    turns, queues, buses = [], [], []
    for _ in range(2):
        bus, queue = Bus(), Queue()
        ctx = SlowAnnounce(cfg, Engine(), bus, None, asyncio.Event(), Followers(), None, "epoch")  # type: ignore[arg-type]
        ctx.go.set()
        turns.append(runs.Turn(ctx, queue, [], 3))  # type: ignore[arg-type]
        queues.append(queue)
        buses.append(bus)
    first, second = await asyncio.wait_for(runs.steps(turns, model), 10)
    assert first == 4 and queues[0].acked and buses[0].published[0].version == 4
    assert isinstance(second, runs.RunFault) and "token id 99999" in str(second)
    assert not queues[1].acked and not buses[1].published and not model.locked()


class Worker:
    def __init__(self, run: str, steps: int, *, ready: bool = True, engine=None, step_together: str = "auto"):
        self.run, self.steps, self.last_step, self.done = run, steps, -1, False
        self.batch = ["g"] if ready else None
        cfg = load_config("examples/tiny.yaml", [f"fleet.step_together={step_together}"])
        self.ctx = runs.Rank0(cfg, engine or Engine(), None, None, None, None, None, "")  # type: ignore[arg-type]


def test_every_ready_run_on_a_shared_model_steps_with_the_one_the_share_picks(monkeypatch):
    from services.trainer import service

    monkeypatch.setattr(service, "shares_base", lambda engine: True)
    monkeypatch.setattr(Engine, "device", torch.device("cuda"), raising=False)
    workers = [Worker("a", 5), Worker("b", 1), Worker("c", 0, ready=False), Worker("d", 3)]
    assert [w.run for w in service.next_runs(workers)] == ["b", "a", "d"]
    monkeypatch.setattr(service, "shares_base", lambda engine: False)
    assert [w.run for w in service.next_runs(workers)] == ["b"]
    monkeypatch.setattr(service, "shares_base", lambda engine: True)
    monkeypatch.setattr(Engine, "device", torch.device("cpu"), raising=False)  # compute-bound there
    assert [w.run for w in service.next_runs(workers)] == ["b"]
    assert service.next_runs([Worker("c", 0, ready=False)]) == []


def test_fleet_step_together_decides_it_for_any_device(monkeypatch):
    from services.trainer import service

    monkeypatch.setattr(service, "shares_base", lambda engine: True)
    for device, mode, team in [("cpu", "always", ["b", "a"]), ("cuda", "never", ["b"]), ("cuda", "auto", ["b", "a"])]:
        monkeypatch.setattr(Engine, "device", torch.device(device), raising=False)
        workers = [Worker("a", 5, step_together=mode), Worker("b", 1, step_together=mode)]
        assert [w.run for w in service.next_runs(workers)] == team, (device, mode)
    monkeypatch.setattr(service, "shares_base", lambda engine: False)  # one model per run: never together
    assert [w.run for w in service.next_runs([Worker("a", 5, step_together="always"), Worker("b", 1)])] == ["b"]


@dataclasses.dataclass(frozen=True)
class GatedAnnounce(runs.Rank0):
    """Announcements that end when their version's gate opens; records (version, trainer step)
    in the order they begin."""

    gates: dict = dataclasses.field(default_factory=dict)
    begun: list = dataclasses.field(default_factory=list)

    async def announce(self, version, tensors, *, weights=None, canary_follows=False, trainer_step=None):
        self.begun.append((version, trainer_step))
        await self.gates.setdefault(version, asyncio.Event()).wait()
        return None


class OrderedQueue(Queue):
    def __init__(self) -> None:
        super().__init__()
        self.acks: list[list[str]] = []
        self.trained = []

    def mark_trained(self, ids) -> None:
        self.trained.extend(ids)

    async def ack(self, ids) -> None:
        self.acks.append(list(ids))


@pytest.mark.asyncio
async def test_the_next_step_trains_while_the_last_ones_publication_is_on_its_way_and_order_is_kept(monkeypatch):
    """A step's publication (event, record, checkpoint, acks) goes on behind the run's next
    step; each announcement begins only once the one before is published, with the trainer step
    that made it; the records, checkpoints and acks come in step order, and each checkpoint
    holds its own step's state, not the state of the steps trained since."""
    engine, trained, saved = Engine(), [], []

    def run_steps(members):
        [(e, work, _)] = members
        e.step += 1
        trained.append(work.groups[0].trajectory_id)
        stats = StepStats(step=e.step, loss=0.0, reward_mean=0.5, groups=1, tokens=10, grad_norm=0.0, lr=1e-4,
                          step_seconds=0.1, trained_at=1.0)  # fmt: skip
        return [(stats, {}, {"state": {"moments": e.step}} if work.save_checkpoint else None)]

    monkeypatch.setattr(runs, "run_steps", run_steps)
    monkeypatch.setattr(runs.checkpoint, "save", lambda root, ckpt: saved.append(ckpt))
    cfg = load_config("examples/tiny.yaml", ["actor.checkpoint_every=1"])
    bus, queue, model = Bus(), OrderedQueue(), asyncio.Lock()
    ctx = GatedAnnounce(cfg, engine, bus, None, asyncio.Event(), Followers(), None, "epoch")  # type: ignore[arg-type]
    turns: list[runs.Turn] = []
    for version, tid in zip((3, 4, 5), "abc"):
        after = turns[-1].finishing if turns else None
        turn = runs.Turn(ctx, queue, [types.SimpleNamespace(trajectory_id=tid)], version, after=after)  # type: ignore[arg-type]
        assert await asyncio.wait_for(runs.steps([turn], model), 10) == [version + 1]
        assert turn.finishing is not None and not turn.finishing.done()
        turns.append(turn)
    await asyncio.sleep(0.05)
    # three steps trained; v4's announcement alone has begun, and nothing is published yet
    assert trained == ["a", "b", "c"] and ctx.begun == [(4, 1)] and not bus.published and not queue.acks
    for version in (4, 5, 6):
        ctx.gates.setdefault(version, asyncio.Event()).set()
    await asyncio.wait_for(asyncio.gather(*(t.finishing for t in turns)), 10)
    assert ctx.begun == [(4, 1), (5, 2), (6, 3)]
    assert [m.version for m in bus.published if isinstance(m, TrainerStep)] == [4, 5, 6]
    assert queue.acks == [["a"], ["b"], ["c"]]
    assert [(c.step, c.version, c.optimizer, c.trained_ids, c.trained_seqs) for c in saved] == [
        (1, 4, {"state": {"moments": 1}}, ["a"], ["a"]),
        (2, 5, {"state": {"moments": 2}}, ["b"], ["a", "b"]),
        (3, 6, {"state": {"moments": 3}}, ["c"], ["a", "b", "c"]),
    ]


@pytest.mark.asyncio
async def test_a_publication_that_failed_fails_the_next_ones_and_announces_nothing_more(monkeypatch):
    engine = Engine()

    def run_steps(members):
        [(e, _, _)] = members
        e.step += 1
        stats = StepStats(step=e.step, loss=0.0, reward_mean=0.5, groups=1, tokens=10, grad_norm=0.0, lr=1e-4,
                          step_seconds=0.1, trained_at=1.0)  # fmt: skip
        return [(stats, {}, None)]

    class Broken(GatedAnnounce):
        async def announce(self, version, tensors, *, weights=None, canary_follows=False, trainer_step=None):
            self.begun.append((version, trainer_step))
            raise ConnectionError("store unreachable")

    monkeypatch.setattr(runs, "run_steps", run_steps)
    cfg = load_config("examples/tiny.yaml", ["actor.checkpoint_every=0"])
    ctx = Broken(cfg, engine, Bus(), None, asyncio.Event(), Followers(), None, "epoch")  # type: ignore[arg-type]
    queue, model = OrderedQueue(), asyncio.Lock()
    first = runs.Turn(ctx, queue, [types.SimpleNamespace(trajectory_id="a")], 3)  # type: ignore[arg-type]
    await runs.steps([first], model)
    second = runs.Turn(ctx, queue, [types.SimpleNamespace(trajectory_id="b")], 4, after=first.finishing)  # type: ignore[arg-type]
    await runs.steps([second], model)
    for turn in (first, second):
        with pytest.raises(ConnectionError, match="store unreachable"):
            await asyncio.wait_for(turn.finishing, 10)
    assert ctx.begun == [(4, 1)] and not queue.acks  # v5 never announced; nothing acked
