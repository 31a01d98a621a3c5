"""The fsdp2 engine's train step, for one run's batch or for several runs' batches at once.

The runs of a fleet share one base model, each with its own peft adapter (`FSDP2Engine.sibling`).
Stepped one after another, N runs cost N passes of their batches through the whole base, and the
trainer is the fleet's serial part. Stepped together, a forward holds rows of several runs, each
LoRA layer sends each run's rows through its own adapter (`lora.rows_by_adapter`), and one
backward gives each adapter the gradient of its own rows' loss only. Every run keeps what makes
its step its own: advantages, minibatches, micro-batches and loss weights planned from its batch
alone (as if it trained alone), its sampling temperature, loss settings and head version, its
mismatch tally and refusals, its gradient clipping, optimizer and schedule.

A forward holds at most one micro-batch of each run, and several only while their padded size
stays within the largest `actor.mb_spec_max_tokens` among them, so a joint step needs no more
memory per forward than the most generous run allows. One run alone is exactly the single-run
step: one micro-batch per forward, its active adapter, no routing.

Invariant: a run's update in a joint step is the update it makes alone (the same samples,
weights, loss and optimizer step; only the GEMMs' reduction order can differ: the base's over
more rows, the LoRA's over the joined adapters' ranks), and one run's rows never reach another
run's adapter or its gradient.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from proto.messages import Trajectory
from services.trainer import batching, mismatch, precision
from services.trainer.engines.base import JointStepFailed, StepStats, micro_batch_loss, step_stats, summed_over_ranks
from services.trainer.lora import Route, rows_by_adapter
from services.trainer.loss import LossStats

if TYPE_CHECKING:
    from services.trainer.engines.fsdp2 import FSDP2Engine


@dataclass(frozen=True)
class RunBatch:
    """One run's part of a step: its engine (adapter), batch and head version."""

    engine: FSDP2Engine
    groups: list[Trajectory]
    head_version: int


@dataclass
class _Run:
    """A run's working state through one step."""

    batch: RunBatch
    groups: list[Trajectory]
    plans: list[list[list[batching.Sample]]] = field(default_factory=list)
    """per minibatch, this rank's micro-batches (as samples)"""
    prox: dict[tuple[int, int], Tensor] = field(default_factory=dict)
    """(minibatch, micro-batch) -> proximal logprobs of its rows, in the forward that holds them"""
    tally: mismatch.Tally | None = None
    stats: LossStats = field(default_factory=LossStats)
    loss_total: float = 0.0
    grad_norm: float = 0.0
    updates: int = 0

    @property
    def engine(self) -> FSDP2Engine:
        return self.batch.engine


@dataclass(frozen=True)
class _Piece:
    run: _Run
    index: tuple[int, int]
    """(minibatch, micro-batch) of `run`"""
    samples: list[batching.Sample]


@dataclass(frozen=True)
class _Forward:
    """One forward's rows: the pieces' samples collated together, each piece a row span."""

    pieces: list[_Piece]
    mb: batching.MicroBatch
    spans: list[tuple[int, int]]

    @property
    def route(self) -> Route:
        return [(p.run.engine.adapter, lo, hi) for p, (lo, hi) in zip(self.pieces, self.spans)]


def train(batches: Sequence[RunBatch]) -> list[StepStats]:
    """One train step for each of `batches` (distinct runs on one model), in one pass of
    forwards and backwards; the stats in the order given. A single batch is the single-run step
    (every rank of FSDP2 calls it alike); several need one process (siblings never shard)."""
    if not batches:
        raise ValueError("batches: a train step needs at least one run's batch")
    engines = [b.engine for b in batches]
    model = engines[0].model
    if any(e.model is not model for e in engines) or len({e.adapter for e in engines}) != len(engines):
        raise ValueError("batches: a joint step takes distinct runs on one shared model")
    t0 = time.perf_counter()
    runs = [_Run(batch=b, groups=b.groups) for b in batches]
    joint = len(runs) > 1
    if not joint:
        engines[0].activate()
    try:
        with _trainable(engines) if joint else contextlib.nullcontext(), rows_by_adapter(model, enabled=joint) as route:
            _score(runs, route)
            refused = {id(r): _refuse(r) for r in runs}
            live = [r for r in runs if r.groups]
            if live and any(refused.values()):  # fewer completions may not fill the minibatches asked for
                tallies = {id(r): r.tally for r in live}  # the report covers the whole batch
                _score(live, route, minibatches=lambda r: min(r.engine.actor.ppo.ppo_n_minibatches, _completions(r)))
                for r in live:
                    r.tally = tallies[id(r)]
            _update(live, route)
    except Exception as exc:
        if not joint:
            raise
        raise JointStepFailed(f"a joint step of {len(runs)} runs raised {exc!r}",
                              updated=any(r.updates for r in runs)) from exc  # fmt: skip
    return [_stats(r, refused[id(r)], t0) for r in runs]


def _completions(run: _Run) -> int:
    return sum(1 for g in run.groups for c in g.completions if c.token_ids)


def _score(runs: list[_Run], route: list[Route], minibatches: Callable[[_Run], int] | None = None) -> None:
    """Plan each run's micro-batches (`minibatches`: how many minibatches, default its
    `ppo_n_minibatches`), and compute their proximal logprobs (no grad) and its mismatch tally
    (summed over the ranks)."""
    for r in runs:
        e, ppo = r.engine, r.engine.actor.ppo
        samples = batching.to_samples(r.groups, ppo)
        if not samples:
            raise ValueError("train_step: every completion in the batch is empty")
        n = minibatches(r) if minibatches is not None else ppo.ppo_n_minibatches
        parts = batching.split_minibatches(samples, n, token_level=ppo.token_level_loss)
        r.plans = [
            batching.plan_micro_batches(part, e.rank, e.world_size, e.actor.mb_spec_max_tokens) for part in parts
        ]
        r.tally = mismatch.Tally.empty(len(r.groups))
        r.prox = {}
    with torch.no_grad():
        for k in range(max(len(r.plans) for r in runs)):
            for fwd in _forwards(runs, k):
                route[0] = fwd.route
                for piece, lp, part in zip(fwd.pieces, _logprobs(fwd), _parts(fwd)):
                    piece.run.prox[piece.index] = lp
                    assert piece.run.tally is not None
                    piece.run.tally.add(part, lp, piece.run.batch.head_version)
    for r in runs:
        if r.engine.world_size > 1:
            assert r.tally is not None
            r.tally.all_reduce(device=r.engine.device)


def _refuse(r: _Run) -> dict[str, str]:
    """The run's groups beyond its `actor.max_train_infer_kl` leave its batch (all of them
    when no completion is left): trajectory id -> why."""
    assert r.tally is not None
    beyond = r.tally.beyond(r.engine.actor.max_train_infer_kl)
    if beyond:
        r.groups = [g for i, g in enumerate(r.groups) if i not in beyond]
        if _completions(r) == 0:
            r.groups = []
    return {r.batch.groups[i].trajectory_id: why for i, why in beyond.items()}


def _update(runs: list[_Run], route: list[Route]) -> None:
    """Each run's minibatches, the k-th of every run in the same forwards: one backward per
    forward, then one optimizer step per run that had a k-th minibatch."""
    for k in range(max((len(r.plans) for r in runs), default=0)):
        active = [r for r in runs if k < len(r.plans)]
        for r in active:
            r.engine.optimizer.zero_grad(set_to_none=True)
        for fwd in _forwards(active, k):
            route[0] = fwd.route
            total: Tensor | None = None
            for piece, lp, part in zip(fwd.pieces, _logprobs(fwd), _parts(fwd)):
                r = piece.run
                loss, part_stats = micro_batch_loss(
                    lp, r.prox[piece.index], part, r.batch.head_version, r.engine.actor.ppo, r.engine.device
                )
                # FSDP2 averages gradients over ranks; the loss weights already divide by the
                # whole batch's token count, so undo the average
                scaled = loss * float(r.engine.world_size)
                total = scaled if total is None else total + scaled
                r.loss_total += loss.item()
                r.stats = r.stats + part_stats
            assert total is not None
            total.backward()
        for r in active:
            e = r.engine
            r.grad_norm = _scalar(torch.nn.utils.clip_grad_norm_(e.params, e.actor.optimizer.gradient_clipping))
            e.optimizer.step()
            r.updates += 1


def _stats(r: _Run, refused: dict[str, str], t0: float) -> StepStats:
    """The run's report; its engine's schedule and step counter advance when it updated."""
    e = r.engine
    assert r.tally is not None
    report, group_kl = r.tally.report(refused=len(refused)), r.tally.group_kl().tolist()
    lr = float(e.scheduler.get_last_lr()[0])  # the LR this step ran with
    if not r.updates:  # every group refused
        return StepStats(step=e.step - 1, loss=0.0, reward_mean=0.0, groups=0, tokens=0, grad_norm=0.0, lr=lr,
                         step_seconds=time.perf_counter() - t0, mismatch=report, refused=refused,
                         group_kl=group_kl)  # fmt: skip
    e.scheduler.step()
    e.step += 1
    stats, loss_total = r.stats, r.loss_total
    if e.world_size > 1:
        stats, loss_total = summed_over_ranks(stats, loss_total)
    result = step_stats(r.groups, step=e.step - 1, updates=r.updates, loss_total=loss_total, stats=stats,
                        grad_norm=r.grad_norm, lr=lr, started=t0)  # fmt: skip
    result.mismatch, result.refused, result.group_kl = report, refused, group_kl
    return result


def _forwards(runs: list[_Run], k: int) -> Iterator[_Forward]:
    """The forwards of minibatch `k`: the runs' micro-batches in order, at most one of each run
    in a forward, together while the padded size fits the largest budget among them."""
    budget = max(r.engine.actor.mb_spec_max_tokens for r in runs)
    pending = [
        _Piece(r, (k, j), r.plans[k][j])
        for j in range(max(len(r.plans[k]) for r in runs if k < len(r.plans)))
        for r in runs
        if k < len(r.plans) and j < len(r.plans[k])
    ]
    current: list[_Piece] = []
    for piece in pending:
        together = current + [piece]
        rows = sum(len(p.samples) for p in together)
        longest = max(len(s.input_ids) for p in together for s in p.samples)
        if current and (any(p.run is piece.run for p in current) or rows * longest > budget):
            yield _collate(current)
            together = [piece]
        current = together
    if current:
        yield _collate(current)


def _collate(pieces: list[_Piece]) -> _Forward:
    spans, row = [], 0
    for p in pieces:
        spans.append((row, row + len(p.samples)))
        row += len(p.samples)
    mb = batching.collate([s for p in pieces for s in p.samples], pieces[0].run.engine.pad_id)
    return _Forward(pieces=pieces, mb=mb, spans=spans)


def _parts(fwd: _Forward) -> list[batching.MicroBatch]:
    """Each piece's rows of the forward's micro-batch."""
    if len(fwd.spans) == 1:
        return [fwd.mb]
    return [replace(fwd.mb, **{name: getattr(fwd.mb, name)[lo:hi] for name in _ROW_FIELDS}) for lo, hi in fwd.spans]


_ROW_FIELDS = ("input_ids", "attention_mask", "targets", "loss_weights", "behave_logprobs", "versions",
               "advantages", "groups")  # fmt: skip


def _logprobs(fwd: _Forward) -> list[Tensor]:
    """log pi(target) of each piece's rows at its target columns, each run's logits divided by
    its own sampling temperature (in fp32, outside autocast)."""
    e, mb = fwd.pieces[0].run.engine, fwd.mb
    with precision.forward_context(e.device, e.dtype):
        out = e.model(
            input_ids=mb.input_ids.to(e.device),
            attention_mask=mb.attention_mask.to(e.device),
            logits_to_keep=mb.logits_to_keep,
            use_cache=False,
        )
    targets = mb.targets.to(e.device).unsqueeze(-1)
    result = []
    for piece, (lo, hi) in zip(fwd.pieces, fwd.spans):
        logits = out.logits[lo:hi, :-1].float() / piece.run.engine.temperature
        result.append(logits.gather(-1, targets[lo:hi]).squeeze(-1) - torch.logsumexp(logits, dim=-1))
    return result


@contextlib.contextmanager
def _trainable(engines: list[FSDP2Engine]) -> Iterator[None]:
    """Every joined run's adapter trainable for the step (peft leaves only the active one so),
    then as they were."""
    params = [p for e in engines for p in e.params]
    was = [p.requires_grad for p in params]
    for p in params:
        p.requires_grad_(True)
    try:
        yield
    finally:
        for p, flag in zip(params, was):
            p.requires_grad_(flag)


def _scalar(t: Tensor) -> float:
    full = getattr(t, "full_tensor", None)
    return float(full() if full is not None else t)
