"""`publish_adapter` asks the ADAPTERS stream whether its version was announced already (one
JetStream round trip) only where it could have been (`publish.Announced`): the first version a
trainer announces after it starts (a restart re-announces its checkpoint's version) and any the
store held when it started; in steady state every version is above both, and the look-up is
skipped. Without a record (`announced=None`) every version is looked up, as before."""

from __future__ import annotations

import asyncio

import torch

from proto import subjects
from proto.messages import AdapterReady, LoraSpec
from services.common.store import LocalStore
from services.config.loader import load_config
from services.trainer import runs
from services.trainer.publish import Announced, publish_adapter

LORA = LoraSpec(rank=2, alpha=4.0, target_modules=["q_proj"], base_model="tiny")
RUN, EPOCH = "r1", "e1"


class Bus:
    """The ADAPTERS stream as last message per subject; counts the look-ups."""

    def __init__(self) -> None:
        self.stream: dict[str, object] = {}
        self.lookups: list[int] = []

    async def last(self, stream, model, subject):
        if model is AdapterReady:
            self.lookups.append(int(subject.split(".v")[-1].split(".")[0]))
        return self.stream.get(subject)

    async def publish(self, subject, msg, msg_id=None) -> None:
        self.stream[subject] = msg


def tensors(seed: int) -> dict[str, torch.Tensor]:
    return {"base_model.model.q_proj.lora_A.weight": torch.full((2, 4), float(seed))}


async def announce(bus: Bus, store: LocalStore, version: int, announced: Announced | None) -> AdapterReady | None:
    return await publish_adapter(bus, store, run=RUN, epoch=EPOCH, lora_name="l", version=version,  # type: ignore[arg-type]
                                 tensors=tensors(version), lora=LORA, trainer_step=version,
                                 announced=announced)  # fmt: skip


async def test_steady_state_skips_the_look_up_and_a_restart_looks_its_first_version_up(tmp_path):
    bus, store = Bus(), LocalStore(tmp_path / "store")
    life = Announced()
    life.begin(None)  # a fresh run: nothing stored
    for v in range(4):
        assert (await announce(bus, store, v, life)) is not None
    assert bus.lookups == [0], "looked up once, at the first version of the life"
    assert all(subjects.adapter_ready(RUN, v) in bus.stream for v in range(4))

    # the trainer dies after announcing v3 and resumes from its checkpoint of v3 (the store
    # holds v0..v3): v3 is looked up, found, and not announced again; v4 on is not looked up
    bus.lookups.clear()
    before = bus.stream[subjects.adapter_ready(RUN, 3)]
    life = Announced()
    life.begin(3)
    assert await announce(bus, store, 3, life) is None
    assert bus.stream[subjects.adapter_ready(RUN, 3)] is before
    for v in (4, 5):
        assert (await announce(bus, store, v, life)) is not None
    assert bus.lookups == [3]
    # the same version again in the same life (never done; if it were) is looked up
    assert await announce(bus, store, 5, life) is None and bus.lookups == [3, 5]

    # resumed from an older checkpoint (v1) while the store holds up to v5: resume_plan makes
    # the weights v6; had it announced v2..v5 anew, each would be looked up, as before
    bus.lookups.clear()
    life.begin(5)
    for v in (2, 3, 6, 7):
        await announce(bus, store, v, life)
    assert bus.lookups == [2, 3]

    # no record: every version is looked up (as publish_adapter always did)
    bus.lookups.clear()
    assert await announce(bus, store, 7, None) is None
    assert (await announce(bus, store, 8, None)) is not None
    assert bus.lookups == [7, 8]


class Queue:
    """The run's ACCEPTED queue, never handing out a batch."""

    def __init__(self, *args) -> None:
        pass

    async def open(self) -> None:
        pass

    async def keep_alive(self) -> None:
        await asyncio.Event().wait()

    async def next_batch(self, size, stop):
        await asyncio.Event().wait()

    async def close(self) -> None:
        pass


async def test_a_run_in_the_trainer_keeps_its_record_from_its_start(tmp_path, monkeypatch):
    """`Rank0.announce` passes the run's record, and `TrainWorker.start` begins it with the
    resume's store high-water mark (`Resume.highest_stored`): its first version is looked up, and
    so is every version the store held (a run started afresh on an older store)."""
    from services.trainer.resume import Resume

    monkeypatch.setattr(runs, "AcceptedQueue", Queue)
    bus, store = Bus(), LocalStore(tmp_path / "store")

    class Engine:
        step = 0
        vocab_size = 96

        def lora_spec(self) -> LoraSpec:
            return LORA

    cfg = load_config("examples/tiny.yaml", [f"run={RUN}"])
    ctx = runs.Rank0(cfg, Engine(), bus, store, asyncio.Event(), None, None, EPOCH)  # type: ignore[arg-type]

    async def life(start: Resume, versions: range) -> None:
        worker = runs.TrainWorker(ctx, start, asyncio.Lock(), asyncio.Event())
        await worker.start()
        try:
            for v in versions:
                await ctx.announce(v, tensors(v))
        finally:
            worker.ending = True
            await worker.drain()
            await worker.close()

    await life(Resume(0, b"", tensors(0), frozenset()), range(1, 4))
    assert bus.lookups == [0]
    bus.lookups.clear()
    await life(Resume(3, b"", tensors(3), frozenset(), highest_stored=3), range(4, 6))  # restarted at v3
    assert bus.lookups == [3]
    bus.lookups.clear()
    await life(Resume(0, b"", tensors(0), frozenset(), highest_stored=5), range(1, 8))  # no checkpoint, v0..v5 stored
    assert bus.lookups == [0, 1, 2, 3, 4, 5]
