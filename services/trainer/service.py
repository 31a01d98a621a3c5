"""The trainer service: accepted trajectories in, adapter versions out.

Rank 0 alone talks to NATS and the object store; under torchrun it broadcasts each batch to
the other ranks, which run `worker_loop`: they ignore SIGTERM/SIGINT and stop when rank 0
says so, so a signal to torchrun ends every rank after the current step. Per step:

    pull B accepted groups -> train_step -> gather adapter -> checkpoint (if due)
      -> upload + announce v<N+1> -> TrainerStep -> ack the B messages

While rank 0 waits for trajectories it broadcasts a heartbeat every few seconds: an idle
follower never sits in one collective longer than the process-group timeout, so that timeout
can stay short enough to turn a stuck or dead peer into an error instead of a hang.

The acks come last, so a crash anywhere before them makes JetStream redeliver the batch to
the restarted trainer: accepted trajectories are never lost. The checkpoint comes before the
announcement, so with `checkpoint_every: 1` every announced version can be restored exactly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
from dataclasses import dataclass

import msgspec
import torch.distributed as dist

from proto import subjects
from proto.messages import TrainerStep, Trajectory
from services.common import adapter_io, streams
from services.common.bus import Bus
from services.common.config_schema import LorabusConfig
from services.common.pull import Delivery, Puller
from services.trainer import checkpoint, metrics
from services.trainer.batching import to_samples
from services.trainer.publish import parse_adapter_version, publish_adapter

log = logging.getLogger(__name__)

DURABLE = "trainer"
FETCH_TIMEOUT_S = 1.0


@dataclass
class Work:
    """What rank 0 broadcasts to the other ranks for one step (None = stop)."""

    groups: list[Trajectory]
    version: int
    """the head version being trained (staleness is measured against it)"""
    save_checkpoint: bool


class Heartbeat:
    """Rank 0 is alive and still waiting for a batch."""


def heartbeat_s() -> float:
    from services.trainer.engines.fsdp2 import collective_timeout_s

    return min(5.0, collective_timeout_s() / 4)


class PeerLost(RuntimeError):
    """A broadcast to the other ranks was not taken: one of them died or hangs."""


class Followers:
    """Rank 0's side of the broadcasts. The followers are idle in `worker_loop` whenever rank
    0 sends, so a broadcast not taken within `wait_s` means a peer died or hangs: it is
    raised as `PeerLost` at once instead of after the process-group timeout, and nothing is
    sent afterwards (the group is unusable; the stuck send stays in a daemon thread)."""

    def __init__(self, world_size: int, wait_s: float):
        self.world_size, self.wait_s = world_size, wait_s
        self.broken = self.stopped = False

    def send(self, work: Work | Heartbeat | None) -> None:
        if self.world_size == 1:
            return
        if self.broken:
            raise PeerLost("rank 0: an earlier broadcast to the other ranks failed")
        done, errors = threading.Event(), []

        def target() -> None:
            try:
                broadcast_work(work, 0)
            except BaseException as exc:  # noqa: BLE001 (handed to the waiting thread)
                errors.append(exc)
            finally:
                done.set()

        threading.Thread(target=target, name="broadcast", daemon=True).start()
        taken = done.wait(self.wait_s)
        if not taken or errors:
            self.broken = True
            why = f"failed ({errors[0]})" if errors else f"was not taken within {self.wait_s:.0f}s"
            raise PeerLost(
                f"rank 0: a broadcast to the other ranks {why}: a rank died or hangs; see "
                "torchrun's failure report"
            ) from (errors[0] if errors else None)

    def stop(self) -> None:
        """Tell the followers to exit (once); skipped when the group is already broken."""
        if self.world_size > 1 and not (self.broken or self.stopped):
            self.stopped = True
            self.send(None)


def broadcast_work(work: Work | Heartbeat | None, rank: int) -> Work | Heartbeat | None:
    box = [work if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def checkpoint_due(cfg: LorabusConfig, step: int) -> bool:
    every = cfg.actor.checkpoint_every
    return every > 0 and step % every == 0


class AcceptedQueue:
    """The durable pull consumer on the ACCEPTED stream, with acks deferred until the batch
    has been trained and published (`Bus.consume` acks per message, too early for us)."""

    def __init__(self, bus: Bus, cfg: LorabusConfig, vocab_size: int, skip_ids: set[str]):
        self.bus, self.cfg, self.vocab_size = bus, cfg, vocab_size
        self.skip_ids = skip_ids
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
        groups: list[Trajectory] = []
        while len(groups) < size:
            if stop.is_set():
                return None
            for d in await self.reader.burst(max_n=size - len(groups), timeout=FETCH_TIMEOUT_S):
                if d.msg.trajectory_id in self.skip_ids:
                    log.info("trajectory %s was trained before the restart; acking", d.msg.trajectory_id)
                    await d.ack()
                    continue
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

    async def ack_held(self) -> None:
        for d in self.held:
            await d.ack()
        self.held = []


def _highest_stored_version(store, run: str) -> int | None:
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


async def serve(
    cfg: LorabusConfig, engine, bus, store, stop: asyncio.Event,
    ckpt: checkpoint.Checkpoint | None, initial: dict | None, followers: Followers,
) -> int:
    """Rank 0's loop, after `restore`; returns the last published version. `initial` is the
    untrained adapter (gathered on every rank beforehand: a collective under FSDP2)."""
    run = cfg.run
    ckpt_dir = cfg.actor.checkpoint_dir
    highest = await asyncio.to_thread(_highest_stored_version, store, run)
    version, unchanged = resume_plan(ckpt, highest)
    trained_ids: list[str] = []
    if ckpt is not None:
        log.info("resuming from %s step %d (v%d)", ckpt_dir, ckpt.step, ckpt.version)
        tensors = ckpt.adapter
        weights = ckpt.adapter_bytes if unchanged else adapter_io.to_bytes(ckpt.adapter)
        trained_ids = ckpt.trained_ids
    else:
        tensors = initial
        weights = adapter_io.to_bytes(tensors)
    sender = make_sender(cfg, engine)
    try:
        return await _serve(cfg, engine, bus, store, stop, version, weights, tensors, trained_ids,
                            sender, followers)
    finally:
        if sender is not None:
            await asyncio.to_thread(sender.close)


def make_sender(cfg: LorabusConfig, engine):
    """The XCCL group host when `actor.weight_update_mode: xccl` (rank 0 only)."""
    if cfg.actor.weight_update_mode != "xccl":
        return None
    from services.common import xccl
    from services.trainer.xccl_sender import XcclSender

    a = cfg.actor
    backend = xccl.resolve_backend(a.xccl_backend, engine.device)
    sender = XcclSender(
        address=a.xccl_master_address, port=a.xccl_master_port, backend=backend,
        bucket_bytes=xccl.bucket_bytes_of(a.xccl_bucket_mb), timeout_s=a.xccl_timeout_s,
        device=engine.device if backend == "nccl" else "cpu",
    )
    log.info("xccl: %s group host on %s:%d", sender.backend, sender.address, sender.port)
    return sender


async def _serve(cfg, engine, bus, store, stop, version, weights, tensors, trained_ids, sender,
                 followers) -> int:
    run, lora_name = cfg.run, cfg.gconfig.lora_name
    ckpt_dir = cfg.actor.checkpoint_dir
    event = await publish_adapter(bus, store, run=run, lora_name=lora_name, version=version,
                                  weights=weights, lora=engine.lora_spec(), trainer_step=engine.step,
                                  sender=sender, tensors=tensors)
    log.info("v%d %s", version, "announced" if event else "was already announced")
    metrics.VERSION.set(version)

    queue = AcceptedQueue(bus, cfg, engine.vocab_size, set(trained_ids))
    await queue.open()
    keep_alive = asyncio.create_task(queue.keep_alive())
    try:
        while engine.step < cfg.total_train_steps:
            groups = await next_batch_alive(queue, cfg.rollout.consumer_batch_size, stop, followers)
            if groups is None:
                break
            step_index = engine.step
            save = checkpoint_due(cfg, step_index + 1)
            work = Work(groups=groups, version=version, save_checkpoint=save)
            await asyncio.to_thread(followers.send, work)
            stats, adapter, optim = await asyncio.to_thread(run_step, engine, work)
            version += 1
            t0 = time.perf_counter()
            weights = adapter_io.to_bytes(adapter)
            ids = [g.trajectory_id for g in groups]
            if save:
                await asyncio.to_thread(checkpoint.save, ckpt_dir, checkpoint.Checkpoint(
                    step=engine.step, version=version, adapter_bytes=weights, optimizer=optim,
                    rng=checkpoint.rng_state(), trained_ids=ids))
            await publish_adapter(bus, store, run=run, lora_name=lora_name, version=version,
                                  weights=weights, lora=engine.lora_spec(), trainer_step=engine.step,
                                  sender=sender, tensors=adapter)
            metrics.PUBLISH_SECONDS.observe(time.perf_counter() - t0)
            await bus.publish(subjects.trainer_step(run), TrainerStep(
                run=run, step=step_index, version=version, loss=stats.loss,
                reward_mean=stats.reward_mean, groups=stats.groups, tokens=stats.tokens,
                step_seconds=stats.step_seconds, mean_staleness=stats.mean_staleness,
                finished_at=time.time()), msg_id=f"trainer-step-{step_index}")
            await queue.ack_held()
            record(stats, version)
            log.info("step %d -> v%d loss %.4f reward %.3f tokens %d %.2fs", step_index, version,
                     stats.loss, stats.reward_mean, stats.tokens, stats.step_seconds)
    finally:
        keep_alive.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await keep_alive
        await queue.close()
    return version


async def next_batch_alive(queue: AcceptedQueue, size: int, stop: asyncio.Event,
                           followers: Followers):
    """`queue.next_batch`, with a heartbeat to the followers while it waits."""
    fetch = asyncio.create_task(queue.next_batch(size, stop))
    if followers.world_size == 1:
        return await fetch
    try:
        while True:
            done, _ = await asyncio.wait({fetch}, timeout=heartbeat_s())
            if done:
                return fetch.result()
            await asyncio.to_thread(followers.send, Heartbeat())
    finally:
        fetch.cancel()


def run_step(engine, work: Work):
    """The collective part of a step, identical on every rank."""
    stats = engine.train_step(work.groups, head_version=work.version)
    adapter = engine.adapter_state()
    optim = engine.optimizer_state() if work.save_checkpoint else None
    return stats, adapter, optim


def record(stats, version: int) -> None:
    metrics.STEP_SECONDS.observe(stats.step_seconds)
    metrics.TOKENS_PER_SECOND.set(stats.tokens / max(stats.step_seconds, 1e-9))
    metrics.VERSION.set(version)
    metrics.LOSS.set(stats.loss)
    metrics.REWARD_MEAN.set(stats.reward_mean)
    metrics.STEPS.inc()


def worker_loop(engine) -> None:
    """Ranks > 0: follow rank 0's broadcasts until it says stop. torchrun signals every rank
    at once; stopping here mid-step would break rank 0's collectives, so rank 0 decides."""
    def defer(signum, _frame):
        log.info("rank %d: %s; stopping when rank 0 does", engine.rank, signal.Signals(signum).name)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, defer)
    while True:
        work = broadcast_work(None, engine.rank)
        if work is None:
            return
        if isinstance(work, Work):
            run_step(engine, work)


def restore(engine, cfg: LorabusConfig) -> checkpoint.Checkpoint | None:
    """Every rank loads the newest checkpoint itself (same host, same directory)."""
    ckpt = checkpoint.load_latest(cfg.actor.checkpoint_dir)
    if ckpt is not None:
        engine.load_state(ckpt.adapter, ckpt.optimizer or None, ckpt.step)
        checkpoint.restore_rng(ckpt.rng)
    return ckpt


async def run_rank0(
    cfg: LorabusConfig, engine, ckpt: checkpoint.Checkpoint | None, initial: dict | None,
    followers: Followers,
) -> int:
    """The caller calls `followers.stop()` too, for the ways out that never get here."""
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
            return await serve(cfg, engine, bus, store, stop, ckpt, initial, followers)
        finally:  # before the bus drains: the followers need not wait for it
            await asyncio.to_thread(followers.stop)
    finally:
        t0 = time.perf_counter()
        await bus.close()
        log.info("bus closed in %.1fs", time.perf_counter() - t0)
