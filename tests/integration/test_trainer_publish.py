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
