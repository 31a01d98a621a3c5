"""The trainer's announcement of a version against a real nats-server and a local store, under
someone announcing the trainer's next version first (issue 17)."""

from __future__ import annotations

import time
import uuid

import pytest

from proto import codec, subjects
from proto.messages import AdapterReady, LoraSpec, ObjectPayload
from services.common import adapter_io, streams
from services.common.bus import Bus
from services.common.store import LocalStore
from services.config.schema import BusConfig
from services.trainer.publish import publish_adapter, trainer_epoch

LORA = LoraSpec(rank=2, alpha=4.0, target_modules=["q_proj"], base_model="tiny")


@pytest.fixture
async def bus(nats_url):
    bus = await Bus.connect(BusConfig(url=nats_url), run=f"tp{uuid.uuid4().hex[:8]}", service="trainer")
    await bus.ensure_streams()
    yield bus
    await bus.close()


def tensors(seed: int):
    import torch

    torch.manual_seed(seed)
    return {"base_model.model.q_proj.lora_A.weight": torch.randn(2, 4)}


def weights(seed: int) -> bytes:
    return adapter_io.to_bytes(tensors(seed))


async def test_an_announcement_of_the_trainers_next_version_by_someone_else_does_not_stop_it(bus, tmp_path):
    """The forger's `adapter.v1.ready` (reusing v0's object, even with the msg_id the trainer
    used to use) once made the trainer drop its real v1 (`v1 was announced with sha256 ... but
    never stored`) and the run exited 0 on the forger's weights."""
    run, store = bus.run, LocalStore(tmp_path / "store")
    epoch = trainer_epoch(store, run)
    assert trainer_epoch(store, run) == epoch and trainer_epoch(store, "other-run") != epoch  # kept per run

    async def announce(version: int, seed: int) -> AdapterReady | None:
        return await publish_adapter(bus, store, run=run, epoch=epoch, lora_name="l", version=version,
                                     tensors=tensors(seed), lora=LORA, trainer_step=version)  # fmt: skip

    v0 = await announce(0, 0)
    assert v0 is not None and v0.trainer_epoch == epoch
    forged = AdapterReady(
        run=run, trainer_epoch="forger", lora_name="l", version=1, trainer_step=1, created_at=time.time(),
        lora=LORA, payloads=v0.payloads,
    )  # fmt: skip
    await bus.publish(subjects.adapter_ready(run, 1), forged, msg_id="adapter-v1")
    v1 = await announce(1, 1)
    assert v1 is not None and v1.trainer_epoch == epoch
    obj = v1.object_payload()
    assert obj is not None and obj.sha256 == adapter_io.sha256(weights(1))
    stored = await bus.last_raw(streams.ADAPTERS(run), subjects.adapter_ready(run, 1))
    assert stored is not None and codec.decode(stored.data, AdapterReady) == v1
    # and a restarted trainer of the same epoch still announces each version once
    assert await announce(1, 1) is None
    assert isinstance(obj, ObjectPayload)


async def test_the_canary_follows_its_event_and_a_replica_waits_for_it(bus, tmp_path):
    """Issue 28: the event goes out saying its canary follows; a reader waiting on the canary's
    subject (`Bus.wait_last`) is woken when it is stored, and gets None when it never is. A
    trainer that died between the two publishes it at restart (`ensure_canary`)."""
    import asyncio

    from proto.messages import AdapterCanary, Canary, CanarySequence
    from services.rollout import canary as replica_canary
    from services.trainer.publish import ensure_canary, publish_canary

    run, store = bus.run, LocalStore(tmp_path / "store")
    epoch = trainer_epoch(store, run)
    want = Canary(dtype="float32", sequences=[CanarySequence(prompt_token_ids=[3], token_ids=[4], logprobs=[-0.1])])
    ev = await publish_adapter(bus, store, run=run, epoch=epoch, lora_name="l", version=0, tensors=tensors(0),
                               lora=LORA, trainer_step=0, canary_follows=True)  # fmt: skip
    assert ev is not None and ev.canary_follows and ev.canary is None
    stream, subject = streams.CANARIES(run), subjects.adapter_canary(run, 0)
    t0 = time.monotonic()
    assert await bus.wait_last(stream, AdapterCanary, subject, timeout=0.3) is None
    assert 0.3 <= time.monotonic() - t0 < 2.0

    async def later() -> None:
        await asyncio.sleep(0.5)
        await publish_canary(bus, ev, want)

    sending = asyncio.create_task(later())
    t0 = time.monotonic()
    assert await replica_canary.obtain(bus, ev, 10.0) == want
    assert time.monotonic() - t0 < 1.5, "woken by the publish, not by the end of the wait"
    await sending
    stored = await bus.last(stream, AdapterCanary, subject)
    assert stored is not None and stored.adapter_sha256 == ev.object_payload().sha256  # type: ignore[union-attr]
    assert not await ensure_canary(bus, run, 0, epoch, want), "stored: not sent again"

    # v1 announced, and the trainer died before its canary: the restart sends it
    v1 = await publish_adapter(bus, store, run=run, epoch=epoch, lora_name="l", version=1, tensors=tensors(1),
                               lora=LORA, trainer_step=1, canary_follows=True)  # fmt: skip
    assert v1 is not None
    with pytest.raises(replica_canary.CanaryFailed, match="none came on"):
        await replica_canary.obtain(bus, v1, 0.2)
    assert await ensure_canary(bus, run, 1, epoch, want)
    assert await replica_canary.obtain(bus, v1, 0.2) == want
