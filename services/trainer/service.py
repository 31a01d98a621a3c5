"""The trainer service: accepted trajectories in, adapter versions out (rank 0's loop).

Rank 0 alone talks to NATS and the object store; under torchrun the other ranks follow its
broadcasts (`ranks.py`). Every run the trainer serves is a `runs.TrainWorker` of one `RunHost`
(docs/multi-run.md): the fleet's own run first, on the engine that holds the base model, and
every active run of the fleet's run table beside it, on a sibling adapter of that model
(`SharedBaseEngine`); a run that stops or finishes is retired after its current step and its
adapter leaves the model. An engine that cannot share its base (megatron, or fsdp2 over several
ranks) serves the own run only, on the same loop.

One loop steps them (`serve`): every run collects its next batch in the background, and among
the runs holding a full batch the one with the fewest steps per unit of share leads the next
step, ties to the one that waited longest (`share.pick` with steps done in place of groups in
flight); on a shared model every other run holding a batch steps with it, in the same forwards
and backwards (`runs.steps`; `fleet.step_together`, by default on an accelerator only). A run
without a full batch never holds the trainer, and a ready run never waits for another's step;
the shares are kept where batches are made (the registry grants rollout slots by share), so a
run's steps follow its share of the rollouts. While no run holds a batch, rank 0 heartbeats the other ranks. A
submitted run whose adapter cannot join the model or whose step raises (`run_faults.RunFault`)
is retired and reported to the registry, which stops it with the reason; the other runs go on.

Invariant: the trainer ends when its own run is done and no other run is live (or on stop), and
every run's step is published before its batch is acked (`runs.steps`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import AsyncIterator, Iterable
from typing import TYPE_CHECKING

import torch

from proto.messages import Canary, RunStateName
from services.common import run_faults, share
from services.common.bus import Bus
from services.common.run_faults import RunFault
from services.common.run_host import MakeWorker, RunHost
from services.config.schema import LorabusConfig, StepTogether
from services.trainer import canary as trainer_canary
from services.trainer import checkpoint
from services.trainer.engines.base import TrainEngine, shares_base
from services.trainer.publish import trainer_epoch
from services.trainer.ranks import Followers
from services.trainer.resume import Resume, highest_stored_version, resume
from services.trainer.runs import Rank0, TrainWorker, train_together

if TYPE_CHECKING:
    from services.common.store import ObjectStore
    from services.trainer.xccl_sender import XcclSender

log = logging.getLogger(__name__)

ENDS: tuple[RunStateName, ...] = ("stopping", "stopped", "finished")
"""a run in these states takes no more steps here"""


def make_sender(cfg: LorabusConfig, engine: TrainEngine, port: int | None = None) -> XcclSender | None:
    """The XCCL group host when `actor.weight_update_mode: xccl` (rank 0 only), on `port` (default
    `actor.xccl_master_port`; 0: a free one, which the events name)."""
    if cfg.actor.weight_update_mode != "xccl":
        return None
    from services.common import xccl
    from services.trainer.xccl_sender import XcclSender

    a = cfg.actor
    backend = xccl.resolve_backend(a.xccl_backend, engine.device)
    sender = XcclSender(
        address=a.xccl_master_address,
        port=a.xccl_master_port if port is None else port,
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


def next_runs(workers: Iterable[TrainWorker]) -> list[TrainWorker]:
    """The runs to train next: the ready one with the fewest steps per share (`share.pick`)
    first, then, on an engine whose runs share its model, every other ready run with it (one
    joint step costs little more than one run's, and a ready run never waits for the trainer);
    empty when none is ready."""
    ready = {w.run: w for w in workers if w.batch and not w.done}
    loads = [
        share.RunLoad(run=w.run, share=w.ctx.cfg.fleet.share, running=w.steps, ready=True, last_grant=w.last_step)
        for w in ready.values()
    ]
    chosen = share.pick(loads)
    if chosen is None:
        return []
    lead = ready.pop(chosen)
    together = steps_together(lead.ctx.engine, lead.ctx.cfg.fleet.step_together)
    return [lead, *ready.values()] if together else [lead]


def steps_together(engine: TrainEngine, mode: StepTogether = "auto") -> bool:
    """Whether ready runs on `engine`'s model step together (`fleet.step_together`): only on a
    shared base; under `auto` on an accelerator, where a pass through the base costs launches
    and memory reads that a larger batch shares. On the CPU a step is compute-bound and a
    larger batch is slower per row (8 runs: 0.85x one after another, `benchmarks/joint_step.py`),
    so there runs step one at a time unless `always`."""
    if mode == "never" or not shares_base(engine):
        return False
    return mode == "always" or engine.device.type != "cpu"


async def _woken(wake: asyncio.Event, stop: asyncio.Event) -> None:
    waits = {asyncio.create_task(wake.wait()), asyncio.create_task(stop.wait())}
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in waits:
            task.cancel()


async def serve(host: RunHost[TrainWorker], followers: Followers, stop: asyncio.Event) -> int:
    """Steps until the own run is done and no other run is live (or `stop`); returns the own
    run's last version."""
    own, steps = host.own, 0
    while not stop.is_set():
        for done in [w for w in host.workers.values() if w.done and w is not own]:
            await host.retire(done.run)
        if own.done and len(host.workers) == 1:
            break
        host.changed.clear()  # before looking: a batch that lands meanwhile sets it again
        team = next_runs(host.workers.values())
        if not team:
            await followers.heartbeat_while(_woken(host.changed, stop))
            continue
        for worker, fault in zip(team, await train_together(team, steps)):
            if fault is None:
                continue
            if worker is own:  # its engine holds the base: a restart, as a single-run trainer's
                raise fault
            worker.ending = True  # retired above on the next turn, whatever the registry answers
            await run_faults.report(host.bus, host.fleet, worker.run, "trainer", fault)
        steps += 1
    return own.version


def worker_maker(
    cfg: LorabusConfig, ctx: Rank0, start: Resume, store: ObjectStore, model: asyncio.Lock, wake: asyncio.Event
) -> MakeWorker[TrainWorker]:
    """How the trainer's host makes each run's worker: the own run on `ctx` from `start`, every
    other run on a sibling of the own run's engine, resumed from its own checkpoint."""
    engine = ctx.engine

    async def make(run_cfg: LorabusConfig, bus: Bus) -> TrainWorker:
        if run_cfg.run == cfg.run:
            return TrainWorker(ctx, start, model, wake)
        if not shares_base(engine):
            raise RunFault(
                f"actor.backend: {cfg.actor.backend!r} with actor.nproc_per_node {engine.world_size}: this "
                f"trainer cannot take run {run_cfg.run!r} beside its own; runs share one trainer with backend "
                "fsdp2 and nproc_per_node 1"
            )
        async with model:  # the adapter joins the model between steps
            try:
                sibling = engine.sibling(run_cfg, run_cfg.run)
            except Exception as exc:  # its LoRA shape on this model: the run's config, its fault alone
                raise RunFault(f"its adapter cannot join the base model: {exc}") from exc
        try:
            async with model:
                begin = await resume(sibling, run_cfg, store)
            epoch = await asyncio.to_thread(trainer_epoch, store, run_cfg.run)
            # each run its own group, on a free port: its events name it, its replicas' receivers
            # join it (the configured port is the own run's)
            sender = make_sender(run_cfg, sibling, port=0)
        except BaseException:  # a run that cannot start leaves nothing behind on the shared model
            async with model:
                sibling.drop()
            raise
        run_ctx = Rank0(run_cfg, sibling, bus, store, ctx.stop, ctx.followers, sender, epoch)
        return TrainWorker(run_ctx, begin, model, wake, sibling=sibling)

    return make


async def run_rank0(
    cfg: LorabusConfig,
    engine: TrainEngine,
    ckpt: checkpoint.Checkpoint | None,
    initial: dict[str, torch.Tensor] | None,
    followers: Followers,
    canary: Canary | None = None,
) -> int:
    """Connect, plan the start from `ckpt` (after `restore`) or `initial` (the untrained
    adapter, gathered on every rank beforehand: a collective under FSDP2) and `serve`;
    returns the last published version. `canary`: the first version's, computed on every rank
    beforehand too (None: computed here, when the engine is one process). The caller calls
    `followers.stop()` too, for the ways out that never get here."""
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
            highest = await asyncio.to_thread(highest_stored_version, store, cfg.run)
            epoch = await asyncio.to_thread(trainer_epoch, store, cfg.run)
            if canary is None and engine.world_size == 1:
                canary, _ = trainer_canary.timed(engine)
            start = Resume.plan(ckpt, initial, highest, canary)
            if ckpt is not None:
                log.info("resuming from %s step %d (v%d)", cfg.actor.checkpoint_dir, ckpt.step, ckpt.version)
            async with sender_for(cfg, engine) as sender:
                ctx = Rank0(cfg, engine, bus, store, stop, followers, sender, epoch)
                wake = asyncio.Event()
                make = worker_maker(cfg, ctx, start, store, asyncio.Lock(), wake)
                host = RunHost(cfg, bus, make, name="trainer", ends=ENDS, changed=wake)
                await host.start()
                try:
                    return await serve(host, followers, stop)
                finally:
                    await host.close()
        finally:  # before the bus drains: the followers need not wait for it
            await asyncio.to_thread(followers.stop)
    finally:
        t0 = time.perf_counter()
        await bus.close()
        log.info("bus closed in %.1fs", time.perf_counter() - t0)
