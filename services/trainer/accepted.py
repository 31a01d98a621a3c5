"""A run's accepted trajectories as the trainer takes them: a durable pull consumer on the run's
ACCEPTED stream whose acks wait until the batch is trained and published.

Invariant: a trajectory is acked only once the step that trained it is published (or when it
was trained before: its sequence is in `trained`, or its id in the checkpoint's last step), and
one that this run cannot train (another run's, a token id beyond the vocabulary, a shape the
loss refuses, behaviour logprobs beyond actor.max_train_infer_kl: `refuse`) is dead-lettered,
never trained.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Mapping

import msgspec

from proto.messages import Trajectory
from services.common import ranges, streams
from services.common.bus import Bus
from services.common.pull import Delivery, Puller, ack_all
from services.config.schema import LorabusConfig
from services.trainer import batching

log = logging.getLogger(__name__)

DURABLE = "trainer"
FETCH_TIMEOUT_S = 1.0


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
        return batching.problem(traj, self.vocab_size)  # checked, not converted: the step converts

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
                # first: a batch in flight is marked trained before its step is published, and
                # a copy of it redelivered meanwhile (a restarted nats-server) must not be acked
                # here: a crash before that publication would lose it
                if any(h.msg.trajectory_id == d.msg.trajectory_id for h in self.held):
                    continue  # redelivered while held (a late pull): the held copy settles it
                if ranges.contains(self.trained, d.meta.stream_seq):
                    log.info("trajectory %s was trained already (its ack was lost); acking", d.msg.trajectory_id)
                    await d.ack()
                    continue
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

    async def refuse(self, reasons: Mapping[str, str]) -> None:
        """Dead-letter the held trajectories the step refused (trajectory id -> why) and let go
        of them: they were not trained, and no redelivery brings them back."""
        kept = []
        for d in self.held:
            why = reasons.get(d.msg.trajectory_id)
            if why is None:
                kept.append(d)
            else:
                await d.reject("validation", f"trajectory {d.msg.trajectory_id}: {why}")
        self.held = kept

    def mark_trained(self, ids: Collection[str]) -> None:
        """The held trajectories `ids` (a batch) are trained: remember their sequences (before
        the checkpoint is saved)."""
        for d in self.held:
            if d.msg.trajectory_id in ids:
                ranges.add(self.trained, d.meta.stream_seq)

    async def ack(self, ids: Collection[str]) -> None:
        """Ack the held trajectories `ids` (a batch whose step is published) and let go of them;
        the rest stay held (the next batch, collected while this one was trained)."""
        done = [d for d in self.held if d.msg.trajectory_id in ids]
        self.held = [d for d in self.held if d.msg.trajectory_id not in ids]
        await ack_all(done)
