"""Rank 0 decides, the other ranks follow: the trainer's protocol between torchrun ranks.

Only rank 0 talks to NATS and the object store. For each step it broadcasts a `Work` (the
batch, the head version, whether to checkpoint), and every rank then runs `run_step`, the
same collectives in the same order. The followers sit in `worker_loop`: they ignore
SIGTERM/SIGINT and stop when rank 0 broadcasts None, so a signal to torchrun ends every rank
after the current step.

While rank 0 waits for trajectories it broadcasts a `Heartbeat` every `heartbeat_s`: an idle
follower never sits in one collective longer than the process-group timeout, so that timeout
can stay short enough to turn a stuck or dead peer into an error (`PeerLost`) instead of a hang.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from types import FrameType
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from proto.messages import Trajectory
from services.trainer import canary as trainer_canary
from services.trainer.engines.base import JointStepFailed, StepStats, TrainEngine, collective_timeout_s, shares_base

log = logging.getLogger(__name__)
T = TypeVar("T")


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
    return min(5.0, collective_timeout_s() / 4)


class PeerLost(RuntimeError):
    """A broadcast to the other ranks was not taken: one of them died or hangs."""


def broadcast_work(work: Work | Heartbeat | None, rank: int) -> Work | Heartbeat | None:
    box = [work if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


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
            except BaseException as exc:  # handed to the waiting thread
                errors.append(exc)
            finally:
                done.set()

        threading.Thread(target=target, name="broadcast", daemon=True).start()
        taken = done.wait(self.wait_s)
        if not taken or errors:
            self.broken = True
            why = f"failed ({errors[0]})" if errors else f"was not taken within {self.wait_s:.0f}s"
            raise PeerLost(
                f"rank 0: a broadcast to the other ranks {why}: a rank died or hangs; see torchrun's failure report"
            ) from (errors[0] if errors else None)

    def stop(self) -> None:
        """Tell the followers to exit (once); skipped when the group is already broken."""
        if self.world_size > 1 and not (self.broken or self.stopped):
            self.stopped = True
            self.send(None)

    async def heartbeat_while(self, waiting: Coroutine[Any, Any, T]) -> T:
        """Await `waiting` (rank 0's wait for a batch), with a heartbeat every `heartbeat_s`."""
        task = asyncio.create_task(waiting)
        if self.world_size == 1:
            return await task
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=heartbeat_s())
                if done:
                    return task.result()
                await asyncio.to_thread(self.send, Heartbeat())
        finally:
            task.cancel()


Step = tuple[StepStats, dict[str, torch.Tensor], dict[str, Any] | None]
"""a run's step as `run_step` returns it: (stats, the new adapter, the optimizer state or None)"""


Delivered = Callable[[Step], None]
"""rank 0's hook, handed a step's result once its adapter is gathered and before the canary"""


def run_step(
    engine: TrainEngine, work: Work, into: Mapping[str, torch.Tensor] | None = None, delivered: Delivered | None = None
) -> Step:
    """The collective part of a step, identical on every rank: (stats, the new adapter, the
    optimizer state when the step is checkpointed). `into` (rank 0 under XCCL): where the
    adapter is written (`TrainEngine.adapter_state`). Over several ranks the new version's
    canary is computed here, last, on the model just updated (`stats.canary`: a collective, in
    the same place on every rank); rank 0 hands the step to `delivered` before it, so that the
    version is announced while the canary is computed. One process computes its canary beside
    the announcement instead (`runs.steps`). A step that refused every group made no update: no
    canary, no adapter ({}), no optimizer state (every rank knows it alike)."""
    return _after(engine, work, into, engine.train_step(work.groups, head_version=work.version), delivered)


def run_steps(
    members: list[tuple[TrainEngine, Work, Mapping[str, torch.Tensor] | None]], delivered: Delivered | None = None
) -> list[Step | Exception]:
    """Rank 0: `run_step` for the runs of `members` (engine, work, into), several on one shared
    model (one process) in one joint step (`SharedBaseEngine.train_together`); each run's
    result, or the exception that is its own. A joint step that failed before any update is
    retried one run at a time, which finds whose batch it was; one that failed after an update
    is every member's (their optimizers moved, and a retry would train twice). `delivered`:
    `run_step`'s, for a single run."""
    if len(members) > 1:
        lead = members[0][0]
        if not shares_base(lead) or delivered is not None:
            raise ValueError(f"{type(lead).__name__}: several runs step together on a shared base in one process")
        try:
            stats = lead.train_together([(e, w.groups, w.version) for e, w, _ in members])
        except JointStepFailed as failed:
            if failed.updated:
                return [failed] * len(members)
            log.warning("%s; stepping its %d runs one at a time", failed, len(members))
        else:
            return [_guarded(_after, e, w, into, s, None) for (e, w, into), s in zip(members, stats)]
    return [_guarded(run_step, e, w, into, delivered) for e, w, into in members]


def _guarded(fn: Callable[..., Step], *args: Any) -> Step | Exception:
    try:
        return fn(*args)
    except Exception as exc:  # the run's batch on the run's adapter: its fault alone
        return exc


def _after(
    engine: TrainEngine,
    work: Work,
    into: Mapping[str, torch.Tensor] | None,
    stats: StepStats,
    delivered: Delivered | None,
) -> Step:
    stats.trained_at = time.time()
    if stats.groups == 0:
        return stats, {}, None
    adapter = engine.adapter_state(into)
    optim = engine.optimizer_state() if work.save_checkpoint else None
    step = stats, adapter, optim
    if engine.world_size > 1:
        if delivered is not None:
            delivered(step)
        stats.canary, stats.canary_seconds = trainer_canary.timed(engine)
    return step


def worker_loop(engine: TrainEngine) -> None:
    """Ranks > 0: follow rank 0's broadcasts until it says stop. torchrun signals every rank
    at once; stopping here mid-step would break rank 0's collectives, so rank 0 decides."""

    def defer(signum: int, _frame: FrameType | None) -> None:
        log.info("rank %d: %s; stopping when rank 0 does", engine.rank, signal.Signals(signum).name)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, defer)
    while True:
        work = broadcast_work(None, engine.rank)
        if work is None:
            # a signal that came after this point finds the handler above and is only logged
            log.info("rank %d: rank 0 said stop; leaving", engine.rank)
            return
        if isinstance(work, Work):
            run_step(engine, work)
