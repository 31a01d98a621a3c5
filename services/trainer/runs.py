"""Many runs in one trainer process: one base model, one sibling engine per run, their steps
interleaved (docs/multi-run.md).

Each run is what a single-run trainer is: its own durable on its own ACCEPTED stream
(`AcceptedQueue`), its resume plan and checkpoints (its `actor.checkpoint_dir`), its versions
announced under its own subjects, one `service.step` at a time. They share the model of the
fleet's own run (`FSDP2Engine.sibling`). Runs join and leave with the fleet's run table
(`RunTable.watch`): an active run is opened (resumed from its checkpoint, if any), one
that stops or finishes is closed after its current step and its adapter leaves the model.

Scheduling: every run collects its next batch in the background, and only while it is not
training (a batch's acks come after its step, so collection never overlaps its own step).
Among the runs holding a full batch, the one with the fewest steps per unit of share trains
next, ties to the one that waited longest (`share.pick` with steps done in place of groups in
flight): busy runs get trainer steps in proportion to their shares, and a run without a full
batch never holds the trainer.

Invariant: a step trains one run's batch on that run's adapter only and publishes and acks in
that run's namespace; each queue reads one run's stream and refuses another run's trajectory.
The trainer ends when its own run is done and no other run is live.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

from proto.messages import RunRecord, Trajectory
from services.common import runconfig, share
from services.common.config_schema import LorabusConfig
from services.common.run_table import RunTable
from services.common.store import ObjectStore
from services.trainer import service
from services.trainer.engines.fsdp2 import FSDP2Engine
from services.trainer.publish import trainer_epoch
from services.trainer.service import AcceptedQueue, Rank0, Resume

log = logging.getLogger(__name__)


@dataclass
class Slot:
    """One run in the trainer: its context, queue and progress."""

    ctx: Rank0
    queue: AcceptedQueue
    version: int
    keep_alive: asyncio.Task
    collector: asyncio.Task | None = None
    batch: list[Trajectory] | None = None
    steps: int = 0
    """steps taken by this process (the fair share counts these)"""
    last_step: int = -1
    ending: bool = False
    """stop, or finished elsewhere: close after the current step"""
    own: bool = False

    @property
    def run(self) -> str:
        return self.ctx.cfg.run

    @property
    def done(self) -> bool:
        return self.ending or self.ctx.engine.step >= self.ctx.cfg.total_train_steps


async def resume(engine: FSDP2Engine, cfg: LorabusConfig, store: ObjectStore) -> Resume:
    """Where a run starts: its newest checkpoint (restored into `engine`) or its untrained adapter."""
    ckpt = service.restore(engine, cfg)
    initial = engine.adapter_state() if ckpt is None else None
    highest = await asyncio.to_thread(service._highest_stored_version, store, cfg.run)
    if ckpt is not None:
        log.info("run %s: resuming from %s step %d (v%d)", cfg.run, cfg.actor.checkpoint_dir, ckpt.step, ckpt.version)
    return Resume.plan(ckpt, initial, highest)


@dataclass
class FleetTrainer:
    first: Rank0
    """the fleet's own run: its engine holds the model every other run's adapter joins"""
    store: ObjectStore
    slots: dict[str, Slot] = field(default_factory=dict)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    ended: set[str] = field(default_factory=set)
    _steps: int = 0

    @property
    def fleet(self) -> str:
        return self.first.cfg.run

    # --- runs joining and leaving -------------------------------------------------------------

    async def open(self, ctx: Rank0, start: Resume, *, own: bool = False) -> Slot:
        event = await ctx.announce(start.version, start.tensors, weights=start.weights)
        log.info("run %s: v%d %s", ctx.cfg.run, start.version, "announced" if event else "was already announced")
        queue = AcceptedQueue(ctx.bus, ctx.cfg, ctx.engine.vocab_size, set(start.trained_ids), list(start.trained_seqs))
        await queue.open()
        slot = Slot(ctx, queue, start.version, asyncio.create_task(queue.keep_alive()), own=own)
        self.slots[slot.run] = slot
        self._collect(slot)
        return slot

    async def open_run(self, record: RunRecord) -> None:
        """A run of the table the trainer does not serve yet (active): join it."""
        cfg = runconfig.restore(record.config, self.first.cfg)
        engine = self.first.engine
        assert isinstance(engine, FSDP2Engine)
        sibling = engine.sibling(cfg, record.run)
        bus = self.first.bus.for_run(record.run)
        await bus.ensure_streams()
        epoch = await asyncio.to_thread(trainer_epoch, self.store, cfg.run)
        ctx = Rank0(cfg, sibling, bus, self.store, self.first.stop, self.first.followers, None, epoch)
        await self.open(ctx, await resume(sibling, cfg, self.store))
        log.info("run %s joined (rank %d, share %g)", record.run, cfg.actor.lora_rank, record.share)

    async def close(self, slot: Slot) -> None:
        for task in (slot.collector, slot.keep_alive):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await slot.queue.close()
        self.slots.pop(slot.run, None)
        self.ended.add(slot.run)
        if not slot.own:
            engine = slot.ctx.engine
            assert isinstance(engine, FSDP2Engine)
            engine.drop()
            await slot.ctx.bus.close()
        log.info("run %s: closed at v%d (%d steps here)", slot.run, slot.version, slot.steps)

    async def on_record(self, record: RunRecord) -> None:
        try:
            await self._on_record(record)
        except Exception:  # one run that cannot join must not end the others' training
            log.exception("run %s: cannot follow its %s record", record.run, record.state)

    async def _on_record(self, record: RunRecord) -> None:
        if record.run == self.fleet:
            return
        slot = self.slots.get(record.run)
        if record.state == "active" and slot is None and record.run not in self.ended:
            await self.open_run(record)
        elif record.state != "active" and slot is not None:
            slot.ending = True
        self.wake.set()

    # --- batches and steps --------------------------------------------------------------------

    def _collect(self, slot: Slot) -> None:
        async def collect() -> None:
            slot.batch = await slot.queue.next_batch(slot.ctx.cfg.rollout.consumer_batch_size, self.first.stop)
            self.wake.set()

        slot.collector = asyncio.create_task(collect(), name=f"collect:{slot.run}")

    def next_run(self) -> Slot | None:
        ready = [s for s in self.slots.values() if s.batch and not s.done]
        loads = [
            share.RunLoad(run=s.run, share=s.ctx.cfg.fleet.share, running=s.steps, ready=True, last_grant=s.last_step)
            for s in ready
        ]
        chosen = share.pick(loads)
        return None if chosen is None else self.slots[chosen]

    async def serve(self) -> int:
        """Steps until the own run is done and no other run is live (or stop); returns the own
        run's last version."""
        own = next(s for s in self.slots.values() if s.own)
        while not self.first.stop.is_set():
            for ended in [s for s in self.slots.values() if s.done and not s.own]:
                await self.close(ended)
            if own.done and len(self.slots) == 1:
                break
            self.wake.clear()  # before looking: a batch that lands meanwhile sets it again
            slot = self.next_run()
            if slot is None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.wake.wait(), 1.0)
                continue
            groups, slot.batch = slot.batch, None
            assert groups is not None
            slot.version = await service.step(slot.ctx, slot.queue, groups, slot.version)
            slot.steps += 1
            slot.last_step = self._steps
            self._steps += 1
            if not slot.done:
                self._collect(slot)
        for slot in list(self.slots.values()):
            await self.close(slot)
        return own.version


async def serve_fleet(ctx: Rank0, start: Resume, store: ObjectStore) -> int:
    """`service.serve` for a fleet: the own run from `start`, every other live run of the run
    table as it comes."""
    trainer = FleetTrainer(ctx, store)
    await trainer.open(ctx, start, own=True)
    try:
        watch = await RunTable(ctx.bus, trainer.fleet).watch(trainer.on_record)
    except Exception as exc:  # e.g. a bus user without KV rights: the own run still trains
        log.warning("fleet %s: cannot follow the run table (%r); training this run only", trainer.fleet, exc)
        watch = None
    try:
        return await trainer.serve()
    finally:
        if watch is not None:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch


def serves_fleet(engine: object) -> bool:
    """Whether this trainer can take other runs: one process of the fsdp2 engine."""
    return isinstance(engine, FSDP2Engine) and engine.world_size == 1
