"""The GRPO step under pipeline parallelism, run by megatron-core's pipeline schedule.

Invariant: with the same batch, weights and optimizer, this step computes the same loss,
statistics and adapter gradients as `step.train_step` on an unsplit model: the micro-batches,
their order, the proximal logprobs and the loss are `step`'s own (`plan_step`,
`logprobs_from_logits`, `micro_batch_loss`); only where the layers run differs.

How: every rank holds the whole batch and plans the same micro-batches (ranks of one pipeline
share a data-parallel rank). The schedule (`get_forward_backward_func()`, megatron-core's 1F1B)
calls `forward_step` on every stage; the first stage embeds the tokens, later stages take the
previous stage's hidden states, sent with torch.distributed isend/irecv, shapes exchanged
first (`variable_seq_lengths`: micro-batches differ in length and rows), or all of one padded
shape (`fixed_shape`, where the MoE dispatcher needs it: `step.fixed_shape_plans`). Only the last stage
has logits, so only it computes logprobs and the loss; `loss_func` returns (loss, tokens,
extras) and the model config has `calculate_per_token_loss`, so the schedule neither divides
the loss by the micro-batch count nor by tokens: each micro-batch's loss already is its share
of the batch's loss, as in `step.train_step`. Gradients flow back stage by stage; the
optimizer then sums them over data-parallel replicas and completes the clip norm over the
model-parallel group (which spans the pipeline), so every stage clips by the same norm. The
loss and statistics are the last stage's, broadcast to the other stages.

The schedule and its device context are passed in, so this file imports without megatron-core.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from proto.messages import Trajectory
from services.config.schema import PPOConfig
from services.trainer import batching
from services.trainer.engines.base import StepStats, step_stats, summed_over_ranks
from services.trainer.engines.megatron.optim import MasterAdapterOptimizer
from services.trainer.engines.megatron.step import (
    CrossEntropy,
    fixed_shape_plans,
    local_cross_entropy,
    logprobs_from_logits,
    micro_batch_loss,
    model_inputs,
    plan_step,
)
from services.trainer.loss import LossStats

Schedule = Callable[..., list]
"""megatron-core's forward_backward_func (keyword arguments as in its schedules.py)"""


def _run(
    schedule: Schedule,
    model: nn.Module,
    plan: list[batching.MicroBatch],
    loss_of: Callable[[int, batching.MicroBatch, Tensor], tuple[Tensor, Any]],
    *,
    device: torch.device | str,
    forward_only: bool,
) -> list:
    """One pass of the schedule over `plan`; on the last stage, `loss_of`'s extras in order."""

    def forward_step(data: Iterator[tuple[int, batching.MicroBatch]], module: nn.Module) -> tuple[Tensor, Callable]:
        index, mb = next(data)
        return module(*model_inputs(mb, device)), partial(_loss, index, mb)

    def _loss(index: int, mb: batching.MicroBatch, output: Tensor) -> tuple[Tensor, Tensor, Any]:
        loss, extras = loss_of(index, mb, output)
        return loss, torch.zeros((), dtype=torch.int, device=loss.device), extras

    return schedule(
        forward_step_func=forward_step,
        data_iterator=iter(list(enumerate(plan))),
        model=[model],
        num_microbatches=len(plan),
        seq_length=max(mb.input_ids.shape[1] for mb in plan),
        micro_batch_size=max(mb.input_ids.shape[0] for mb in plan),
        forward_only=forward_only,
    )


def train_step(
    model: nn.Module,
    optimizer: MasterAdapterOptimizer,
    groups: list[Trajectory],
    head_version: int,
    *,
    schedule: Schedule,
    is_last_stage: bool,
    last_stage_rank: int,
    pp_group: dist.ProcessGroup | None,
    ppo: PPOConfig,
    dp_rank: int = 0,
    dp_size: int = 1,
    dp_group: dist.ProcessGroup | None = None,
    max_tokens: int = 4096,
    pad_id: int = 0,
    device: torch.device | str = "cpu",
    temperature: float = 1.0,
    grad_clip: float = 1.0,
    step_index: int = 0,
    lr: float = 0.0,
    cross_entropy: CrossEntropy = local_cross_entropy,
    schedule_context: Callable[[], AbstractContextManager] = nullcontext,
    fixed_shape: bool = False,
) -> StepStats:
    """`step.train_step` with the layers split over the pipeline group's stages; collective
    over the whole model-parallel and data-parallel grid. `last_stage_rank`: the global rank
    of this pipeline's last stage."""
    t0 = time.perf_counter()
    plans = plan_step(groups, ppo, dp_rank, dp_size, max_tokens, pad_id)
    if fixed_shape:  # the model config's variable_seq_lengths is off: one p2p shape for all
        plans = fixed_shape_plans(plans, pad_id, device)

    def logprobs(_: int, mb: batching.MicroBatch, logits: Tensor) -> tuple[Tensor, Tensor]:
        lp = logprobs_from_logits(logits, mb, device, temperature, cross_entropy)
        return lp.sum() * 0.0, lp.detach()

    with torch.no_grad(), schedule_context():
        prox = [_run(schedule, model, plan, logprobs, device=device, forward_only=True) for plan in plans]

    stats, loss_total, grad_norm = LossStats(), 0.0, 0.0
    for plan, plan_prox in zip(plans, prox):

        def ppo_loss(
            index: int, mb: batching.MicroBatch, logits: Tensor, prox_of: list = plan_prox
        ) -> tuple[Tensor, Any]:
            lp = logprobs_from_logits(logits, mb, device, temperature, cross_entropy)
            loss, mb_stats = micro_batch_loss(lp, prox_of[index], mb, head_version, ppo, device)
            return loss, (loss.item(), mb_stats)

        optimizer.zero_grad()
        with schedule_context():
            done = _run(schedule, model, plan, ppo_loss, device=device, forward_only=False)
        for mb_loss, mb_stats in done:  # empty off the last stage
            loss_total += mb_loss
            stats = stats + mb_stats
        grad_norm = optimizer.step(grad_clip)

    # the last stage alone saw the loss; the trainer reports rank 0's
    if dist.is_initialized() and dist.get_world_size(pp_group) > 1:
        shared: list[Any] = [(stats, loss_total) if is_last_stage else None]
        dist.broadcast_object_list(shared, src=last_stage_rank, group=pp_group)
        stats, loss_total = shared[0]
    if dp_group is not None and dp_size > 1:
        stats, loss_total = summed_over_ranks(stats, loss_total, group=dp_group, device=optimizer.masters[0].device)
    return step_stats(
        groups,
        step=step_index,
        updates=len(plans),
        loss_total=loss_total,
        stats=stats,
        grad_norm=grad_norm,
        lr=lr,
        started=t0,
    )
