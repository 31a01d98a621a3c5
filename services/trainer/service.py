"""The trainer service: accepted trajectories in, adapter versions out (rank 0's step loop).

Rank 0 alone talks to NATS and the object store; under torchrun the other ranks follow its
broadcasts (`ranks.py`). Per step:

    pull B accepted groups -> train_step -> gather adapter -> announce v<N+1> (upload, or
      broadcast with the upload behind it) -> TrainerStep -> checkpoint (if due) -> ack the B
      messages

The acks come last, so a crash anywhere before them makes JetStream redeliver the batch to
the restarted trainer: accepted trajectories are never lost. The announcement comes before the
checkpoint (under XCCL nothing may be serialised before the event, and a checkpoint would be):
a crash between the two resumes from the previous checkpoint as a new version above N (the
store holds N), and the redelivered batch is trained again; no version number ever names two
adapters, and the cost of that crash is one step of compute.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import torch

from proto import subjects
from proto.messages import AdapterReady, TrainerStep, Trajectory
from services.common import adapter_io, ranges, streams
from services.common.bus import Bus
from services.common.config_schema import LorabusConfig
from services.common.pull import Delivery, Puller
from services.trainer import checkpoint, metrics
from services.trainer.batching import to_samples
from services.trainer.engines.base import StepStats, TrainEngine
from services.trainer.publish import parse_adapter_version, publish_adapter, trainer_epoch
from services.trainer.ranks import Followers, Work, run_step

if TYPE_CHECKING:
    from services.common.store import ObjectStore
    from services.trainer.xccl_sender import XcclSender

log = logging.getLogger(__name__)

DURABLE = "trainer"
FETCH_TIMEOUT_S = 1.0


def checkpoint_due(cfg: LorabusConfig, step: int) -> bool:
    every = cfg.actor.checkpoint_every
    return every > 0 and step % every == 0


class AcceptedQueue:
    """The durable pull consumer on the ACCEPTED stream, with acks deferred until the batch
    has been trained and published (`Bus.consume` acks per message, too early for us)."""

    def __init__(
        self, bus: Bus, cfg: LorabusConfig, vocab_size: int, skip_ids: set[str], trained: ranges.Ranges | None = None
    ):
        self.bus, self.cfg, self.vocab_size = bus, cfg, vocab_size
        self.skip_ids = skip_ids
        self.trained: ranges.Ranges = list(trained or [])
        """ACCEPTED sequences trained so far (checkpointed with every step)"""
        self.held: list[Delivery[Trajectory]] = []
        self.reader: Puller[Trajectory] | None = None
        self.consumer = streams.consumer(cfg.run, DURABLE)
        # room for a few batches beyond the one held, so the next pull does not stall
        pending = max(4 * cfg.rollout.consumer_batch_size, self.consumer.max_ack_pending)
        self.consumer = msgspec.structs.replace(self.consumer, max_ack_pending=pending)

    async def open(self) -> None:
        self.reader = await self.bus.pull(self.consumer, Trajectory, batch=self.cfg.rollout.consumer_batch_size)

    def _problem(self, traj: Trajectory) -> str | None:
        if traj.run != self.cfg.run:
            return f"run: {traj.run!r} is not this trainer's run {self.cfg.run!r}"
        for c in traj.completions:
            if any(t >= self.vocab_size for t in c.token_ids) or any(
                t >= self.vocab_size for t in traj.prompt_token_ids
            ):
                return f"token id >= the model's vocab size {self.vocab_size}"
        try:
            to_samples([traj], self.cfg.actor.ppo)
        except ValueError as exc:
            return str(exc)
        return None

    async def next_batch(self, size: int, stop: asyncio.Event) -> list[Trajectory] | None:
        """Block until `size` usable groups are held (None if `stop` is set first)."""
        if self.reader is None:
            raise RuntimeError("AcceptedQueue: the reader opens in open(); call it first")
        reader = self.reader
        groups: list[Trajectory] = []
        while len(groups) < size:
            if stop.is_set():
                return None
            for d in await reader.burst(max_n=size - len(groups), timeout=FETCH_TIMEOUT_S):
                if ranges.contains(self.trained, d.meta.stream_seq):
                    log.info("trajectory %s was trained already (its ack was lost); acking", d.msg.trajectory_id)
                    await d.ack()
                    continue
                if d.msg.trajectory_id in self.skip_ids:
                    log.info("trajectory %s was trained before the restart; acking", d.msg.trajectory_id)
                    await d.ack()
                    continue
                if any(h.msg.trajectory_id == d.msg.trajectory_id for h in self.held):
                    continue  # redelivered while held (a late pull): the held copy settles it
                if (problem := self._problem(d.msg)) is not None:
                    await d.reject("validation", f"trajectory {d.msg.trajectory_id}: {problem}")
                    continue
                self.held.append(d)
                groups.append(d.msg)
        return groups

    async def keep_alive(self) -> None:
        """Tell the server the held messages are still being worked on (a step may outlast
        ack_wait); runs until cancelled."""
        while True:
            await asyncio.sleep(self.consumer.ack_wait_s / 3)
            for d in list(self.held):
                await d.in_progress()

    async def close(self) -> None:
        """Unsubscribe the reader before the bus drains (nothing of it is left to deliver)."""
        if self.reader is not None:
            await self.reader.stop()

    def mark_trained(self) -> None:
        """The held batch is trained: remember its sequences (before the checkpoint is saved)."""
        for d in self.held:
            ranges.add(self.trained, d.meta.stream_seq)

    async def ack_held(self) -> None:
        for d in self.held:
            await d.ack()
        self.held = []


def _highest_stored_version(store: ObjectStore, run: str) -> int | None:
    versions = [v for key in store.list(f"{run}/adapters/") if (v := parse_adapter_version(run, key)) is not None]
    return max(versions, default=None)


def resume_plan(ckpt: checkpoint.Checkpoint | None, highest_stored: int | None) -> tuple[int, bool]:
    """(version to (re)announce now, whether it carries the checkpoint's bytes unchanged).

    Fresh start: v0. Resume: the checkpoint's version, re-announced idempotently (the crash
    may have come between upload and publish). If versions past the checkpoint were already
    uploaded (checkpoint_every > 1), their weights are gone: the restored weights become a
    new version above them, so no version number ever names two different adapters."""
    if ckpt is None:
        return 0, False
    if highest_stored is not None and highest_stored > ckpt.version:
        return highest_stored + 1, False
    return ckpt.version, True


@dataclass(frozen=True)
class Resume:
    """Where rank 0's loop starts: the version to announce first (`resume_plan`), its weights
    as bytes and as tensors, and the trajectories of the checkpoint's last step (a redelivery
    of those is acked, not trained twice)."""

    version: int
    weights: bytes
    tensors: dict[str, torch.Tensor]
    trained_ids: frozenset[str]
    trained_seqs: tuple[tuple[int, int], ...] = ()

    @classmethod
    def plan(
        cls,
        ckpt: checkpoint.Checkpoint | None,
        initial: dict[str, torch.Tensor] | None,
        highest_stored: int | None,
    ) -> Resume:
        """`initial` is the untrained adapter, needed when there is no checkpoint."""
        version, unchanged = resume_plan(ckpt, highest_stored)
        if ckpt is None:
            if initial is None:
                raise ValueError(
                    "initial: None without a checkpoint; gather the untrained adapter "
                    "(engine.adapter_state() on every rank) before serving"
                )
            return cls(version, adapter_io.to_bytes(initial), initial, frozenset())
        tensors = ckpt.adapter
        weights = ckpt.adapter_bytes if unchanged else adapter_io.to_bytes(tensors)
        return cls(version, weights, tensors, frozenset(ckpt.trained_ids), tuple(ckpt.trained_seqs))


@dataclass(frozen=True)
class Rank0:
    """Rank 0's collaborators, for as long as its loop runs."""

    cfg: LorabusConfig
    engine: TrainEngine
    bus: Bus
    store: ObjectStore
    stop: asyncio.Event
    """set by SIGTERM/SIGINT: the loop ends after the current step"""
    followers: Followers
    sender: XcclSender | None
    """the XCCL group host (`actor.weight_update_mode: xccl`), else None"""
    epoch: str
    """the run's trainer epoch, carried by every adapter event (`publish.trainer_epoch`)"""

    async def announce(
        self, version: int, tensors: dict[str, torch.Tensor], *, weights: bytes | None = None
    ) -> AdapterReady | None:
        """Store (or broadcast) and announce `version`; None when it was announced already.
        `weights`: its serialised form when at hand (else serialised where `deliver` says)."""
        return await publish_adapter(
            self.bus,
            self.store,
            run=self.cfg.run,
            epoch=self.epoch,
            lora_name=self.cfg.gconfig.lora_name,
            version=version,
            tensors=tensors,
            lora=self.engine.lora_spec(),
            trainer_step=self.engine.step,
            sender=self.sender,
            weights=weights,
        )


def make_sender(cfg: LorabusConfig, engine: TrainEngine) -> XcclSender | None:
    """The XCCL group host when `actor.weight_update_mode: xccl` (rank 0 only)."""
    if cfg.actor.weight_update_mode != "xccl":
        return None
    from services.common import xccl
    from services.trainer.xccl_sender import XcclSender

    a = cfg.actor
    backend = xccl.resolve_backend(a.xccl_backend, engine.device)
    sender = XcclSender(
        address=a.xccl_master_address,
        port=a.xccl_master_port,
        backend=backend,
        bucket_bytes=xccl.bucket_bytes_of(a.xccl_bucket_mb),
        timeout_s=a.xccl_timeout_s,
        device=engine.device if backend == "nccl" else "cpu",
    )
    log.info("xccl: %s group host on %s:%d", sender.backend, sender.address, sender.port)
    return sender


@contextlib.asynccontextmanager
async def sender_for(cfg: LorabusConfig, engine: TrainEngine) -> AsyncIterator[XcclSender | None]:
    """`make_sender`, closed (its last upload awaited) when the loop ends."""
    sender = make_sender(cfg, engine)
    try:
        yield sender
    finally:
        if sender is not None:
            await asyncio.to_thread(sender.close)


async def serve(ctx: Rank0, start: Resume) -> int:
    """Rank 0's loop: announce `start`, then one step per batch until `total_train_steps` or
    `ctx.stop`; returns the last published version."""
    cfg, engine, bus, followers = ctx.cfg, ctx.engine, ctx.bus, ctx.followers
    version = start.version
    event = await ctx.announce(version, start.tensors, weights=start.weights)
    log.info("v%d %s", version, "announced" if event else "was already announced")
    metrics.VERSION.labels(cfg.run).set(version)

    queue = AcceptedQueue(bus, cfg, engine.vocab_size, set(start.trained_ids), list(start.trained_seqs))
    await queue.open()
    keep_alive = asyncio.create_task(queue.keep_alive())
    try:
        while engine.step < cfg.total_train_steps:
            groups = await followers.heartbeat_while(queue.next_batch(cfg.rollout.consumer_batch_size, ctx.stop))
            if groups is None:
                break
            version = await step(ctx, queue, groups, version)
    finally:
        keep_alive.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await keep_alive
        await queue.close()
    return version


async def step(ctx: Rank0, queue: AcceptedQueue, groups: list[Trajectory], version: int) -> int:
    """One step of `ctx`'s run on `groups` (held by `queue`), in the order the module docstring
    gives; returns the version it published. A fleet's trainer calls it for each run's steps."""
    cfg, engine, bus, followers, run = ctx.cfg, ctx.engine, ctx.bus, ctx.followers, ctx.cfg.run
    step_index = engine.step
    work = Work(groups=groups, version=version, save_checkpoint=checkpoint_due(cfg, step_index + 1))
    await asyncio.to_thread(followers.send, work)
    # under XCCL the adapter is written straight into the sender's free send set
    into = ctx.sender.fill_views() if ctx.sender is not None else None
    stats, adapter, optim = await asyncio.to_thread(run_step, engine, work, into)
    version += 1
    t0 = time.perf_counter()
    ids = [g.trajectory_id for g in groups]
    queue.mark_trained()
    # announced before the checkpoint: under XCCL nothing is serialised before the event. A
    # crash between the two resumes from an older checkpoint above N (the store has N's
    # marker), so N never names two adapters.
    await ctx.announce(version, adapter)
    announced = time.perf_counter()
    metrics.PUBLISH_SECONDS.labels(run).observe(announced - t0)
    # the step's record before the checkpoint: a crash after a checkpoint resumes past this
    # step and would never publish it; a crash before one redoes the step, and its record's
    # msg_id makes the second publish a duplicate the stream drops
    await bus.publish(
        subjects.trainer_step(run),
        TrainerStep(
            run=run,
            step=step_index,
            version=version,
            loss=stats.loss,
            reward_mean=stats.reward_mean,
            groups=stats.groups,
            tokens=stats.tokens,
            step_seconds=stats.step_seconds,
            mean_staleness=stats.mean_staleness,
            finished_at=time.time(),
        ),
        msg_id=f"trainer-step-{step_index}",
    )
    if optim is not None:  # gathered by run_step because this step is checkpoint_due
        await asyncio.to_thread(
            checkpoint.save,
            cfg.actor.checkpoint_dir,
            checkpoint.Checkpoint(
                step=engine.step,
                version=version,
                adapter_bytes=await asyncio.to_thread(adapter_io.to_bytes, adapter),
                optimizer=optim,
                rng=checkpoint.rng_state(),
                trained_ids=ids,
                trained_seqs=list(queue.trained),
            ),
        )
    log.info(
        "v%d announced in %.1f ms; step event and checkpoint %.1f ms after",
        version,
        (announced - t0) * 1e3,
        (time.perf_counter() - announced) * 1e3,
    )
    await queue.ack_held()
    record(stats, version, run)
    log.info(
        "step %d -> v%d loss %.4f reward %.3f tokens %d %.2fs grad_norm %.3g lr %.3g "
        "clip %.3f masked %.3f imp_weight %.3f (max %.2f)",
        step_index,
        version,
        stats.loss,
        stats.reward_mean,
        stats.tokens,
        stats.step_seconds,
        stats.grad_norm,
        stats.lr,
        stats.loss_stats.get("clip_fraction", 0.0),
        stats.loss_stats.get("masked_fraction", 0.0),
        stats.loss_stats.get("imp_weight_mean", 1.0),
        stats.loss_stats.get("imp_weight_max", 1.0),
    )
    return version


def record(stats: StepStats, version: int, run: str) -> None:
    metrics.STEP_SECONDS.labels(run).observe(stats.step_seconds)
    metrics.TOKENS_PER_SECOND.labels(run).set(stats.tokens / max(stats.step_seconds, 1e-9))
    metrics.VERSION.labels(run).set(version)
    metrics.LOSS.labels(run).set(stats.loss)
    metrics.REWARD_MEAN.labels(run).set(stats.reward_mean)
    metrics.STEPS.labels(run).inc()


def restore(engine: TrainEngine, cfg: LorabusConfig) -> checkpoint.Checkpoint | None:
    """Every rank loads the newest checkpoint itself (same host, same directory)."""
    ckpt = checkpoint.load_latest(cfg.actor.checkpoint_dir)
    if ckpt is not None:
        engine.load_state(ckpt.adapter, ckpt.optimizer or None, ckpt.step)
        checkpoint.restore_rng(ckpt.rng)
    return ckpt


async def run_rank0(
    cfg: LorabusConfig,
    engine: TrainEngine,
    ckpt: checkpoint.Checkpoint | None,
    initial: dict[str, torch.Tensor] | None,
    followers: Followers,
) -> int:
    """Connect, plan the start from `ckpt` (after `restore`) or `initial` (the untrained
    adapter, gathered on every rank beforehand: a collective under FSDP2) and `serve`;
    returns the last published version. The caller calls `followers.stop()` too, for the
    ways out that never get here."""
    from services.common.bus import Bus
    from services.common.store import open_store

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    bus = await Bus.connect(cfg.bus, run=cfg.run, service="trainer")
    try:
        await bus.ensure_streams()
        store = open_store(cfg.store)
        try:
            highest = await asyncio.to_thread(_highest_stored_version, store, cfg.run)
            epoch = await asyncio.to_thread(trainer_epoch, store, cfg.run)
            start = Resume.plan(ckpt, initial, highest)
            if ckpt is not None:
                log.info("resuming from %s step %d (v%d)", cfg.actor.checkpoint_dir, ckpt.step, ckpt.version)
            async with sender_for(cfg, engine) as sender:
                ctx = Rank0(cfg, engine, bus, store, stop, followers, sender, epoch)
                from services.trainer import runs  # the fleet: other runs join this model

                if runs.serves_fleet(engine):
                    return await runs.serve_fleet(ctx, start, store)
                return await serve(ctx, start)
        finally:  # before the bus drains: the followers need not wait for it
            await asyncio.to_thread(followers.stop)
    finally:
        t0 = time.perf_counter()
        await bus.close()
        log.info("bus closed in %.1fs", time.perf_counter() - t0)
