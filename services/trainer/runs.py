"""One run in the trainer: its step, and its life beside the fleet's other runs (`TrainWorker`).

A run is what a single-run trainer is: its own durable on its own ACCEPTED stream
(`AcceptedQueue`), its resume plan and checkpoints (its `actor.checkpoint_dir`), its versions
announced under its own subjects. Per step:

    pull B accepted groups -> train_step (groups beyond actor.max_train_infer_kl left out and
      dead-lettered) -> gather adapter -> announce v<N+1>, saying its canary follows (upload,
      or broadcast with the upload behind it; the canary computed beside it: in a thread of one
      process, or by the ranks together)
      -> its canary (AdapterCanary, after the event) -> TrainerStep -> checkpoint (if due) ->
      ack the messages trained

The acks come last, so a crash anywhere before them makes JetStream redeliver the batch to
the restarted trainer: accepted trajectories are never lost. The announcement comes before the
checkpoint (under XCCL nothing may be serialised before the event, and a checkpoint would be):
a crash between the two resumes from the previous checkpoint as a new version above N (the
store holds N), and the redelivered batch is trained again; no version number ever names two
adapters, and the cost of that crash is one step of compute.

A run collects its next batch in the background while its current batch trains (acks are per
batch, so the next batch's deliveries are never acked with this one's). In one process without
XCCL, a step's publication (event, canary, record, checkpoint, acks) goes on behind the run's
next step, which trains meanwhile; the checkpoint's state is taken as the step leaves the
engine. The next announcement begins only once this publication has ended, so a run's events,
records, checkpoints and acks keep step order, and one that fails fails those after it
(nothing after it is announced). A crash with a publication on its way costs the steps whose
batches were not yet acked, which are redelivered and trained again, as above.

Runs other than the fleet's own share its model (`SharedBaseEngine.sibling`); a step holds the
model for its update and canary only, so a run's adapter leaves it (`drop`) only between steps,
and the next run trains while this one's version is uploaded or broadcast, announced and
checkpointed. A
step that raises is the run's `RunFault` (`services.common.run_faults`): the scheduler stops
that run and the others go on; what fails after it (the store, the bus) is everyone's and
raised as it is.

Runs that share the model and hold a batch at the same moment step together (`steps`): one
joint step trains each run's batch on its own adapter in the same forwards and backwards
(`fsdp2_step`), then each run announces, records, checkpoints and acks alone. A joint step
that raised before any update is retried one run at a time, so the fault stays the one run's.

Invariant: a step trains each run's batch on that run's adapter only and publishes and acks in
that run's namespace; each queue reads one run's stream and refuses another run's trajectory.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from proto import subjects
from proto.messages import AdapterReady, Canary, Mismatch, TrainerStep, Trajectory
from services.common import adapter_io
from services.common.bus import Bus
from services.common.run_faults import RunFault
from services.config.schema import LorabusConfig
from services.trainer import canary as trainer_canary
from services.trainer import checkpoint, metrics, mismatch
from services.trainer.accepted import AcceptedQueue
from services.trainer.engines.base import SharedBaseEngine, StepStats, TrainEngine
from services.trainer.publish import Announced, ensure_canary, publish_adapter, publish_canary
from services.trainer.ranks import Followers, Step, Work, run_steps
from services.trainer.resume import Resume

if TYPE_CHECKING:
    from services.common.store import ObjectStore
    from services.trainer.xccl_sender import XcclSender

log = logging.getLogger(__name__)

T = TypeVar("T")


def checkpoint_due(cfg: LorabusConfig, step: int) -> bool:
    every = cfg.actor.checkpoint_every
    return every > 0 and step % every == 0


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
    announced: Announced = field(default_factory=Announced)
    """the versions the stream is asked about before each is announced (`publish.Announced`):
    reset by the run's start (`TrainWorker.start`)"""

    async def announce(
        self,
        version: int,
        tensors: dict[str, torch.Tensor],
        *,
        weights: bytes | None = None,
        canary_follows: bool = False,
        trainer_step: int | None = None,
    ) -> AdapterReady | None:
        """Store (or broadcast) and announce `version`, saying whether its canary follows
        (`send_canary`); None when it was announced already. `weights`: its serialised form when at
        hand (else serialised where `deliver` says). `trainer_step`: the engine's step count that
        made it (default: the engine's now; a step announced behind the next one passes its own)."""
        return await publish_adapter(
            self.bus,
            self.store,
            run=self.cfg.run,
            epoch=self.epoch,
            lora_name=self.cfg.gconfig.lora_name,
            version=version,
            tensors=tensors,
            lora=self.engine.lora_spec(),
            trainer_step=self.engine.step if trainer_step is None else trainer_step,
            sender=self.sender,
            weights=weights,
            canary_follows=canary_follows,
            announced=self.announced,
        )

    async def send_canary(self, version: int, canary: Canary, event: AdapterReady | None) -> None:
        """Publish `version`'s canary after its event: `event` as `announce` returned it, None
        when the version had been announced already (then only when its canary never came)."""
        if event is not None:
            await publish_canary(self.bus, event, canary)
        else:
            await ensure_canary(self.bus, self.cfg.run, version, self.epoch, canary)


@dataclass
class Turn:
    """One run's batch in a trainer step, and what became of it on the way to publication."""

    ctx: Rank0
    queue: AcceptedQueue
    groups: list[Trajectory]
    version: int
    """the run's head version; the step publishes the next one (unless it refused every group)"""
    index: int = 0
    """the run's step count before this step (its TrainerStep's `step`)"""
    stats: StepStats | None = None
    adapter: dict[str, torch.Tensor] = field(default_factory=dict)
    ids: list[str] = field(default_factory=list)
    """the trajectories trained (a checkpoint's record of them)"""
    checkpoint: Callable[..., checkpoint.Checkpoint] | None = None
    """this step's checkpoint, all but the adapter's bytes (serialised on the way), taken as
    the step left the engine, the RNG and the queue: the next step may have moved them since"""
    announcing: asyncio.Future[AdapterReady | None] | None = None
    beside: asyncio.Future[trainer_canary.Timed] | None = None
    started: float = 0.0
    after: asyncio.Future[None] | None = None
    """the run's previous step's publication, while it is still on its way: this step's
    announcement waits for its end (a run's events, records and acks stay in step order)"""
    finishing: asyncio.Future[None] | None = None
    """this step's publication, when it goes on behind the next step (`behind`)"""

    def behind(self) -> bool:
        """Whether this step's publication (event, canary, record, checkpoint, acks) may go on
        while the run's next step trains: not under XCCL (the next step writes the sender's other
        send set, which this one's broadcast must have left), not over several ranks."""
        return self.ctx.sender is None and self.ctx.engine.world_size == 1


async def step(ctx: Rank0, queue: AcceptedQueue, groups: list[Trajectory], version: int, model: asyncio.Lock) -> int:
    """One step of `ctx`'s run on `groups` (held by `queue`); returns the version it published
    (`steps` of one run; its `RunFault` raised)."""
    turn = Turn(ctx, queue, groups, version)
    [result] = await steps([turn], model)
    if turn.finishing is not None:  # published in full before it returns
        await turn.finishing
    if isinstance(result, RunFault):
        raise result
    return result


async def steps(turns: list[Turn], model: asyncio.Lock) -> list[int | RunFault]:
    """One step of each turn's run on its batch, several runs (on one shared model) trained
    together (`ranks.run_steps`), in the order the module docstring gives; returns per run the
    version it published, or its `RunFault` (a step that raised: that run's fault alone; I/O
    that fails afterwards is everyone's and raised). `model` (the fleet's shared model) is held
    for what reads it, the update and the canaries, and released before the uploads or
    broadcasts end: the next step starts while these versions are still on their way. An
    announcement never waits for its canary: it goes out as soon as the version is delivered,
    and the canary right after it, or as soon as it is computed if that is later."""
    works = [
        Work(groups=t.groups, version=t.version, save_checkpoint=checkpoint_due(t.ctx.cfg, t.ctx.engine.step + 1))
        for t in turns
    ]
    for t in turns:
        t.index = t.ctx.engine.step
    results: list[int | RunFault] = []
    await model.acquire()
    try:
        if len(turns) == 1:  # the other ranks step with it (several runs share one process only)
            await asyncio.to_thread(turns[0].ctx.followers.send, works[0])
        # under XCCL the adapter is written straight into the sender's free send set
        members = [(t.ctx.engine, w, t.ctx.sender.fill_views() if t.ctx.sender else None) for t, w in zip(turns, works)]
        if len(turns) == 1 and turns[0].ctx.engine.world_size > 1:
            results.append(await _step_over_ranks(turns[0], members))
        else:
            trained = await asyncio.to_thread(run_steps, members)
            canaries = _canaries_together(turns, trained)
            for i, (turn, done) in enumerate(zip(turns, trained)):
                if isinstance(done, Exception):
                    results.append(_fault(turn, done))
                else:
                    results.append(await _announce(turn, *done, beside=canaries.get(i)))
    finally:
        model.release()
    published = [t for t in turns if t.announcing is not None]
    for t in published:
        if t.behind():
            t.finishing = asyncio.ensure_future(_finish(t))
    await asyncio.gather(*(_finish(t) for t in published if t.finishing is None))
    return results


def _canaries_together(turns: list[Turn], trained: list) -> dict[int, asyncio.Future[trainer_canary.Timed]]:
    """The canaries of a joint step's runs that made a version, by turn index: one decode for
    all of them (`trainer_canary.beside_together`), started before the first announcement;
    none where one run made a version (`_announce` starts its own)."""
    made = [i for i, done in enumerate(trained) if not isinstance(done, Exception) and done[0].groups > 0]
    if len(made) < 2:
        return {}
    besides = trainer_canary.beside_together([turns[i].ctx.engine for i in made])
    return dict(zip(made, besides, strict=True))


def _fault(turn: Turn, exc: Exception) -> RunFault:
    return RunFault(f"step {turn.index} on {len(turn.groups)} groups raised {exc!r}")


async def _step_over_ranks(turn: Turn, members: list) -> int | RunFault:
    """One run's step over several ranks: the announcement starts as soon as the adapter is
    gathered (`ranks.run_step`'s `delivered`), while the ranks compute the canary together,
    and the model is held until they are done (the next step's broadcast must not cross it)."""
    loop = asyncio.get_running_loop()
    gathered: asyncio.Future[Step] = loop.create_future()

    def delivered(step: Step) -> None:
        loop.call_soon_threadsafe(gathered.set_result, step)

    trained = asyncio.ensure_future(asyncio.to_thread(run_steps, members, delivered))
    either: list[asyncio.Future[Any]] = [gathered, trained]
    await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    # `delivered` reaches the loop before the thread's end does (both by call_soon_threadsafe,
    # in order), so a step that gathered an adapter is never taken for one that did not
    if not gathered.done():  # failed, or refused every group: no adapter, no canary
        [done] = trained.result()
        return _fault(turn, done) if isinstance(done, Exception) else await _announce(turn, *done)

    async def canary() -> trainer_canary.Timed:
        [done] = await trained
        if isinstance(done, Exception):  # the version is out: its missing canary is everyone's problem
            raise done
        return done[0].canary, done[0].canary_seconds

    return await _announce(turn, *gathered.result(), beside=asyncio.ensure_future(canary()))


async def _announce(
    turn: Turn,
    stats: StepStats,
    adapter: dict[str, torch.Tensor],
    optim: dict | None,
    beside: asyncio.Future[trainer_canary.Timed] | None = None,
) -> int:
    """Under the model lock, after the update: the refusals, then the announcement started and
    the canary computed beside it (it reads the model with this run's adapter active: in a
    thread of one process, else `beside`: the ranks' collective, or the one decode of every run
    of a joint step). Returns the run's version now
    (unchanged when every group was refused)."""
    ctx, queue, engine, run = turn.ctx, turn.queue, turn.ctx.engine, turn.ctx.cfg.run
    turn.stats, turn.adapter = stats, adapter
    if stats.refused:  # beyond actor.max_train_infer_kl: dead-lettered, never trained
        await queue.refuse(stats.refused)
        metrics.REFUSED_GROUPS.labels(run, mismatch.REASON).inc(len(stats.refused))
        log.warning("step %d refused %d of %d groups: %s", turn.index, len(stats.refused), len(turn.groups),
                    next(iter(stats.refused.values())))  # fmt: skip
    if stats.groups == 0:  # every group refused: no update, so no version
        record_mismatch(stats, run)
        return turn.version
    turn.version += 1
    turn.started = time.perf_counter()
    turn.ids = [g.trajectory_id for g in turn.groups if g.trajectory_id not in stats.refused]
    queue.mark_trained(turn.ids)
    if optim is not None:  # gathered by run_step because this step is checkpoint_due
        turn.checkpoint = functools.partial(
            checkpoint.Checkpoint,
            step=engine.step,
            version=turn.version,
            optimizer=optim,
            rng=checkpoint.rng_state(),
            trained_ids=turn.ids,
            trained_seqs=list(queue.trained),
        )
    # announced before the checkpoint: under XCCL nothing is serialised before the event. A
    # crash between the two resumes from an older checkpoint above N (the store has N's
    # marker), so N never names two adapters.
    # the canary is computed while the version is stored or broadcast and announced
    turn.beside = beside if beside is not None else trainer_canary.beside(engine)
    follows = trainer_canary.computes(engine)
    turn.announcing = asyncio.ensure_future(
        _after(turn.after, ctx.announce(turn.version, adapter, canary_follows=follows, trainer_step=engine.step))
    )
    if turn.beside is not None:
        await asyncio.wait([turn.beside])
    return turn.version


async def _after(previous: asyncio.Future[None] | None, announce: Coroutine[Any, Any, T]) -> T:
    """`announce` once the run's previous publication has ended (its failure is this one's)."""
    if previous is not None:
        try:
            await previous
        except BaseException:
            announce.close()  # never started: nothing of this version went out
            raise
    return await announce


async def _finish(turn: Turn) -> None:
    """After the model lock: the event, the canary after it, the step's record, the checkpoint
    (if due), the acks."""
    ctx, bus, queue, run, version = turn.ctx, turn.ctx.bus, turn.queue, turn.ctx.cfg.run, turn.version
    stats = turn.stats
    assert stats is not None and turn.announcing is not None
    event = await turn.announcing
    announced = time.perf_counter()
    if turn.beside is not None:
        stats.canary, stats.canary_seconds = await turn.beside
        stats.canary_wait_seconds = 0.0  # the announcement went out without it
    metrics.PUBLISH_SECONDS.labels(run).observe(announced - turn.started)
    if stats.canary is not None:  # after the event, which names the weights it vouches for
        await ctx.send_canary(version, stats.canary, event)
    # the step's record before the checkpoint: a crash after a checkpoint resumes past this
    # step and would never publish it. A crash before one redoes the step on a new version
    # (version numbers are never reused): the record's msg_id names step and version, so the
    # redo's record is stored beside the lost attempt's, and readers keep the later one per
    # step; a publish retried as it is stays one message
    await bus.publish(
        subjects.trainer_step(run),
        TrainerStep(
            run=run,
            step=turn.index,
            version=version,
            loss=stats.loss,
            reward_mean=stats.reward_mean,
            groups=stats.groups,
            tokens=stats.tokens,
            step_seconds=stats.step_seconds,
            mean_staleness=stats.mean_staleness,
            finished_at=time.time(),
            trained_at=stats.trained_at or None,
            canary_seconds=stats.canary_seconds,
            canary_wait_seconds=stats.canary_wait_seconds,
            mismatch=stats.mismatch,
        ),
        msg_id=f"trainer-step-{turn.index}-v{version}",
    )
    if turn.checkpoint is not None:
        adapter_bytes = await asyncio.to_thread(adapter_io.to_bytes, turn.adapter)
        await asyncio.to_thread(
            checkpoint.save, ctx.cfg.actor.checkpoint_dir, turn.checkpoint(adapter_bytes=adapter_bytes)
        )
    log.info(
        "v%d announced in %.1f ms; step event and checkpoint %.1f ms after",
        version,
        (announced - turn.started) * 1e3,
        (time.perf_counter() - announced) * 1e3,
    )
    await queue.ack([g.trajectory_id for g in turn.groups])
    record(stats, version, run)
    log.info(
        "step %d -> v%d loss %.4f reward %.3f tokens %d %.2fs grad_norm %.3g lr %.3g "
        "clip %.3f masked %.3f imp_weight %.3f (max %.2f) %s canary %s",
        turn.index,
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
        describe(stats.mismatch),
        canary_line(stats),
    )


def canary_line(stats: StepStats) -> str:
    if stats.canary_seconds is None:
        return "-"
    return f"{stats.canary_seconds * 1e3:.1f} ms (waited {(stats.canary_wait_seconds or 0.0) * 1e3:.1f} ms)"


def describe(m: Mismatch | None) -> str:
    """The step log line's mismatch part: k3 KL and |Δ logprob|, mean (max), on-policy tokens."""
    if m is None:
        return "mismatch -"
    f, scope = (m.on_policy, "on-policy") if m.on_policy is not None else (m.all_tokens, "all")
    return (
        f"kl {f.kl_mean:.2e} (max {f.kl_max:.2e}) |dlogp| {f.abs_mean:.2e} (max {f.abs_max:.2e}) "
        f"[{scope}, {f.tokens} tok, k3]" + (f" refused {m.refused_groups}" if m.refused_groups else "")
    )


def record_mismatch(stats: StepStats, run: str) -> None:
    for kl in stats.group_kl:
        metrics.GROUP_KL.labels(run).observe(kl)
    m = stats.mismatch
    if m is None:
        return
    for scope, f in (("on_policy", m.on_policy), ("all", m.all_tokens)):
        if f is None or f.tokens == 0:
            continue
        metrics.MISMATCH_KL.labels(run, "mean", scope).set(f.kl_mean)
        metrics.MISMATCH_KL.labels(run, "max", scope).set(f.kl_max)
        metrics.MISMATCH_LOGPROB.labels(run, "mean", scope).set(f.abs_mean)
        metrics.MISMATCH_LOGPROB.labels(run, "max", scope).set(f.abs_max)


def record(stats: StepStats, version: int, run: str) -> None:
    record_mismatch(stats, run)
    if stats.canary_seconds is not None:
        metrics.CANARY_SECONDS.labels(run).observe(stats.canary_seconds)
    metrics.STEP_SECONDS.labels(run).observe(stats.step_seconds)
    metrics.TOKENS_PER_SECOND.labels(run).set(stats.tokens / max(stats.step_seconds, 1e-9))
    metrics.VERSION.labels(run).set(version)
    metrics.LOSS.labels(run).set(stats.loss)
    metrics.REWARD_MEAN.labels(run).set(stats.reward_mean)
    metrics.STEPS.labels(run).inc()


@dataclass
class TrainWorker:
    """One run in the trainer (a `RunWorker` of the trainer's `RunHost`)."""

    ctx: Rank0
    begin: Resume
    """where the run starts (`resume.Resume`)"""
    model: asyncio.Lock
    """the shared model: held by every step, and by a sibling's drop"""
    wake: asyncio.Event
    """set when a batch is ready or the run ends (the scheduler's wake-up)"""
    sibling: SharedBaseEngine | None = None
    """the engine to drop when the run closes: a run's adapter on the fleet's own run's model
    (None: the fleet's own run, whose engine holds the model)"""
    queue: AcceptedQueue | None = None
    version: int = -1
    batch: list[Trajectory] | None = None
    steps: int = 0
    """steps taken by this process (the fair share counts these)"""
    last_step: int = -1
    ending: bool = False
    """retired (stopped, or finished elsewhere): no step after the current one"""
    _busy: asyncio.Lock = field(default_factory=asyncio.Lock)
    _collector: asyncio.Task | None = None
    _keep_alive: asyncio.Task | None = None
    _finishing: asyncio.Future[None] | None = None
    """the last step's publication while it goes on behind the next step (`Turn.behind`)"""

    @property
    def run(self) -> str:
        return self.ctx.cfg.run

    @property
    def done(self) -> bool:
        return self.ending or self.ctx.engine.step >= self.ctx.cfg.total_train_steps

    async def start(self) -> None:
        """Announce the first version (again, if it was), then collect the first batch."""
        ctx, start = self.ctx, self.begin
        self.version = start.version
        ctx.announced.begin(start.highest_stored)  # its first version is looked up
        event = await ctx.announce(start.version, start.tensors, weights=start.weights,
                                   canary_follows=start.canary is not None)  # fmt: skip
        log.info("run %s: v%d %s", self.run, start.version, "announced" if event else "was already announced")
        if start.canary is not None:  # the engine holds exactly the version's weights
            await ctx.send_canary(start.version, start.canary, event)
        metrics.VERSION.labels(self.run).set(start.version)
        queue = AcceptedQueue(ctx.bus, ctx.cfg, ctx.engine.vocab_size, set(start.trained_ids), list(start.trained_seqs))
        await queue.open()
        self.queue = queue
        self._keep_alive = asyncio.create_task(queue.keep_alive(), name=f"keep-alive:{self.run}")
        self.collect()

    def collect(self, ahead: bool = False) -> None:
        """Collect the next batch in the background, unless one is held or on its way, or the
        run is done; `ahead`: while the current batch trains (none when it is the last)."""
        if self.done or self.batch is not None or (self._collector is not None and not self._collector.done()):
            return
        if ahead and self.ctx.engine.step + 1 >= self.ctx.cfg.total_train_steps:
            return
        queue = self.queue
        assert queue is not None  # started

        async def collect() -> None:
            self.batch = await queue.next_batch(self.ctx.cfg.rollout.consumer_batch_size, self.ctx.stop)
            self.wake.set()

        self._collector = asyncio.create_task(collect(), name=f"collect:{self.run}")

    async def train(self, step_index: int) -> None:
        """One step on the batch collected, then collect the next; `step_index`: the trainer's
        step count (the fair share's tie-break). Its `RunFault` is raised."""
        [fault] = await train_together([self], step_index)
        if fault is not None:
            raise fault

    async def drain(self) -> None:
        """No step after the current one, whose end (its publication too) this waits for."""
        self.ending = True
        self.wake.set()
        await _cancel(self._collector)
        async with self._busy:
            if self._finishing is not None:
                await self._finishing

    async def close(self) -> None:
        """Stop reading the run's stream (what it holds un-acked comes back after ack_wait);
        a sibling's adapter leaves the model."""
        await _cancel(self._keep_alive)
        if self.queue is not None:
            await self.queue.close()
        if self.sibling is not None:
            if self.ctx.sender is not None:  # its own group (the own run's closes with the trainer)
                await asyncio.to_thread(self.ctx.sender.close)
            async with self.model:
                self.sibling.drop()
        log.info("run %s: closed at v%d (%d steps here)", self.run, self.version, self.steps)


async def train_together(workers: list[TrainWorker], step_index: int) -> list[RunFault | None]:
    """One step of each worker's run on the batch it collected, in one joint step when there
    are several (runs on one shared model: `steps`), then each collects its next; returns each
    run's `RunFault`, or None. `step_index`: the trainer's step count (the fair share's
    tie-break)."""
    turns = []
    for w in workers:
        if w._finishing is not None and w._finishing.done():
            w._finishing.result()  # the last step's publication failed: everyone's fault, raised
        groups, w.batch = w.batch, None
        assert groups is not None and w.queue is not None  # picked because it holds a batch
        turns.append(Turn(w.ctx, w.queue, groups, w.version, after=w._finishing))
        w.collect(ahead=True)  # its acks are its own batch's: the next one is pulled meanwhile
    if len(workers) > 1:
        log.info("runs %s step together", ", ".join(w.run for w in workers))
    async with contextlib.AsyncExitStack() as busy:
        for w in workers:
            await busy.enter_async_context(w._busy)
        results = await steps(turns, workers[0].model)
    faults: list[RunFault | None] = []
    for w, turn, result in zip(workers, turns, results):
        if turn.announcing is not None:  # a version: the next one is announced after its end
            w._finishing = turn.finishing
        if isinstance(result, RunFault):
            faults.append(result)
            continue
        w.version = result
        metrics.STEP_RUNS.labels(w.run).observe(len(workers))
        w.steps += 1
        w.last_step = step_index
        w.collect()
        faults.append(None)
    return faults


async def _cancel(task: asyncio.Task | None) -> None:
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
