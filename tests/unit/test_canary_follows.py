"""Issue 28, the canary as its own message: the trainer announces a version without waiting for
its canary and publishes it after the event (`runs.step`, `publish.publish_canary` /
`ensure_canary`); a replica takes only a canary bound to the event (`rollout.canary.obtain`),
and one that never comes, does not decode or vouches for other weights fails the check."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import msgspec
import pytest

from proto import codec, subjects
from proto import messages as m
from services.common import streams
from services.config.loader import load_config
from services.rollout import canary
from services.trainer import publish, runs
from services.trainer.engines.base import StepStats
from tests.unit.test_run_step_model_lock import Followers, Queue

SHA = "ab" * 32
LORA = m.LoraSpec(rank=4, alpha=8.0, target_modules=["q_proj"], base_model="tiny")
CANARY = m.Canary(
    dtype="float32", sequences=[m.CanarySequence(prompt_token_ids=[3, 4], token_ids=[5], logprobs=[-0.5])]
)


def event(version: int = 3, *, sha: str | None = SHA, follows: bool = True, epoch: str = "e0") -> m.AdapterReady:
    return m.AdapterReady(
        run="r", trainer_epoch=epoch, lora_name="l", version=version, trainer_step=version, created_at=1.0,
        lora=LORA, payloads=[m.ObjectPayload(uri=f"file:///s/r/adapters/v{version}/a", bytes=10, sha256=sha)],
        canary_follows=follows,
    )  # fmt: skip


def test_events_of_older_trainers_decode_with_nothing_following():
    raw = msgspec.json.decode(codec.encode(event()))
    del raw["canary_follows"]
    old = codec.decode(msgspec.json.encode(raw), m.AdapterReady)
    assert old.canary_follows is False and old.canary is None and not canary.expected(old)
    assert canary.expected(msgspec.structs.replace(old, canary=CANARY))
    assert canary.expected(event())


def test_the_canary_stream_keeps_one_per_version_apart_from_the_adapter_events():
    subject = subjects.adapter_canary("r", 7)
    assert subject == "lorabus.r.canary.v7" and subjects.parse_adapter_canary(subject) == ("r", 7)
    assert streams.stream_for_subject("r", subject) == streams.CANARIES("r")
    (config,) = [c for c in streams.stream_configs("r") if c.name == streams.CANARIES("r")]
    assert config.max_msgs_per_subject == 1 and config.max_msg_size == m.AdapterCanary.max_bytes
    with pytest.raises(subjects.SubjectError, match="not an adapter-canary subject"):
        subjects.parse_adapter_canary("lorabus.r.canary.v01")


def test_the_widest_canary_fits_its_cap():
    seq = m.CanarySequence(prompt_token_ids=[2**53] * 512, token_ids=[2**53] * 128,
                           logprobs=[-1.2345678901234567e-300] * 128)  # fmt: skip
    msg = m.AdapterCanary(run="a" * 64, trainer_epoch="b" * 64, version=2**31 - 1, adapter_sha256=SHA,
                          canary=m.Canary(dtype="bfloat16", sequences=[seq] * 16), created_at=1e11 - 0.5)  # fmt: skip
    assert len(codec.encode(msg)) <= m.AdapterCanary.max_bytes


def test_the_canary_message_names_the_events_weights():
    msg = publish.canary_message(event(5), CANARY)
    assert (msg.run, msg.trainer_epoch, msg.version, msg.adapter_sha256) == ("r", "e0", 5, SHA)
    assert canary.binding_problem(event(5), msg) is None
    # an XCCL event sent before its copy was hashed names no sha256: neither does its canary
    assert publish.canary_message(event(5, sha=None), CANARY).adapter_sha256 is None


@pytest.mark.parametrize(
    "change, field",
    [
        ({"version": 4}, "version"),
        ({"trainer_epoch": "forger"}, "trainer_epoch"),
        ({"adapter_sha256": "cd" * 32}, "adapter_sha256"),
        ({"adapter_sha256": None}, "adapter_sha256"),
        ({"run": "other"}, "run"),
    ],
)
def test_a_canary_of_another_version_epoch_or_weights_is_not_the_events(change, field):
    msg = msgspec.structs.replace(publish.canary_message(event(5), CANARY), **change)
    problem = canary.binding_problem(event(5), msg)
    assert problem is not None and problem.startswith(f"{field}: ")


class StoredBus:
    """What `obtain` and `ensure_canary` read of the Bus: stored messages by subject."""

    def __init__(self, stored: dict[str, bytes] | None = None) -> None:
        self.stored = dict(stored or {})
        self.published: list[tuple[str, msgspec.Struct, str | None]] = []
        self.waited: list[float] = []

    async def last(self, stream, msg_type, subject=None):
        data = self.stored.get(subject)
        return None if data is None else codec.decode(data, msg_type)

    async def wait_last(self, stream, msg_type, subject, *, timeout):
        assert stream == streams.CANARIES("r")
        self.waited.append(timeout)
        return await self.last(stream, msg_type, subject)

    async def publish(self, subject, msg, msg_id=None):
        self.published.append((subject, msg, msg_id))
        self.stored[subject] = codec.encode(msg)
        return len(self.published)


async def test_obtain_takes_the_events_own_canary_without_reading_the_bus():
    bus = StoredBus()
    assert await canary.obtain(bus, msgspec.structs.replace(event(), canary=CANARY, canary_follows=False), 5) == CANARY
    assert bus.waited == []


async def test_obtain_takes_a_bound_canary_and_refuses_what_is_missing_garbled_or_other():
    ev, subject = event(3), subjects.adapter_canary("r", 3)
    good = StoredBus({subject: codec.encode(publish.canary_message(ev, CANARY))})
    assert await canary.obtain(good, ev, 7.5) == CANARY and good.waited == [7.5]
    with pytest.raises(
        canary.CanaryFailed, match=r"none came on lorabus\.r\.canary\.v3 within rollout\.canary_wait_s 2 s"
    ):
        await canary.obtain(StoredBus(), ev, 2.0)
    with pytest.raises(canary.CanaryFailed, match="does not decode"):
        await canary.obtain(StoredBus({subject: b"{not json"}), ev, 2.0)
    other = publish.canary_message(event(3, sha="cd" * 32), CANARY)
    with pytest.raises(canary.CanaryFailed, match="is not this event's .adapter_sha256") as info:
        await canary.obtain(StoredBus({subject: codec.encode(other)}), ev, 2.0)
    assert canary.WITHDRAWN in str(info.value)


async def test_publish_canary_needs_an_event_that_says_it_follows():
    bus = StoredBus()
    await publish.publish_canary(bus, event(2), CANARY)
    ((subject, msg, msg_id),) = bus.published
    assert subject == subjects.adapter_canary("r", 2) and msg_id == "canary-e0-v2" and msg.canary == CANARY
    with pytest.raises(ValueError, match="canary_follows"):
        await publish.publish_canary(bus, event(2, follows=False), CANARY)


async def test_a_restart_publishes_the_canary_an_announced_event_still_waits_for():
    ev = event(4)
    bus = StoredBus({subjects.adapter_ready("r", 4): codec.encode(ev)})
    assert await publish.ensure_canary(bus, "r", 4, "e0", CANARY)
    assert [s for s, _, _ in bus.published] == [subjects.adapter_canary("r", 4)]
    assert not await publish.ensure_canary(bus, "r", 4, "e0", CANARY), "stored already: not again"
    # an event that embedded its canary, or another epoch's event: nothing to publish
    embedded = StoredBus({subjects.adapter_ready("r", 4): codec.encode(event(4, follows=False))})
    assert not await publish.ensure_canary(embedded, "r", 4, "e0", CANARY)
    foreign = StoredBus({subjects.adapter_ready("r", 4): codec.encode(event(4, epoch="x1"))})
    assert not await publish.ensure_canary(foreign, "r", 4, "e0", CANARY)
    assert not embedded.published and not foreign.published


class CanaryEngine:
    """A one-process engine whose canary takes until `release` is set (a thread waits on it)."""

    world_size = 1
    step = 0

    def __init__(self) -> None:
        import threading

        self.release = threading.Event()

    def canary(self) -> m.Canary:
        assert self.release.wait(10), "the test never released the canary"
        return CANARY


@dataclasses.dataclass(frozen=True)
class Announcing(runs.Rank0):
    """An announcement that publishes its event at once (the delivery is instant)."""

    async def announce(self, version, tensors, *, weights=None, canary_follows=False, trainer_step=None):
        ev = event(version, follows=canary_follows)
        await self.bus.publish(subjects.adapter_ready("r", version), ev, msg_id=None)
        return ev


async def test_the_step_announces_before_its_canary_is_computed_and_sends_it_after(monkeypatch):
    def run_steps(members):
        stats = StepStats(step=0, loss=0.0, reward_mean=0.5, groups=2, tokens=10, grad_norm=0.0, lr=1e-4,
                          step_seconds=0.1, trained_at=time.time())  # fmt: skip
        return [(stats, {}, None)]

    monkeypatch.setattr(runs, "run_steps", run_steps)
    engine, bus = CanaryEngine(), StoredBus()
    cfg = load_config("examples/tiny.yaml", [])
    ctx = Announcing(cfg, engine, bus, None, asyncio.Event(), Followers(), None, "e0")  # type: ignore[arg-type]
    stepping = asyncio.create_task(runs.step(ctx, Queue(), [], 3, asyncio.Lock()))  # type: ignore[arg-type]
    for _ in range(200):
        if bus.published:
            break
        await asyncio.sleep(0.01)
    # the event is out while the canary is still being computed, and says it follows
    ((subject, ev, _),) = bus.published
    assert subject == subjects.adapter_ready("r", 4) and ev.canary_follows and ev.canary is None
    engine.release.set()
    assert await asyncio.wait_for(stepping, 10) == 4
    kinds = [type(msg).__name__ for _, msg, _ in bus.published]
    assert kinds == ["AdapterReady", "AdapterCanary", "TrainerStep"]
    _, step, step_id = bus.published[2]
    assert step.canary_wait_seconds == 0.0 and step.canary_seconds is not None and step.canary_seconds > 0
    # a step redone after a crash before its checkpoint publishes on a new version: its record
    # must not be dropped as a duplicate of the lost attempt's
    assert step_id == f"trainer-step-{step.step}-v4"
