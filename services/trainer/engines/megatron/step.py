"""One GRPO / decoupled-PPO train step on a Megatron-style causal LM, in plain torch.

The model is anything called as Megatron's `GPTModel` is, `model(input_ids, position_ids,
attention_mask) -> logits [b, s, vocab (or vocab / tp)]`, so the same step runs the
megatron-bridge engine, the megatron-core benchmark and a CPU test model. Batching, GRPO
advantages and the loss are the FSDP2 engine's (`services.trainer.batching`,
`services.trainer.loss`): both backends optimise exactly the same objective.

Data parallelism: every rank holds the whole batch and takes its round-robin share of each
minibatch (`plan_micro_batches` with the data-parallel rank and size); ranks of one
tensor-parallel group pass the same DP rank and so run the same micro-batches.

Fixed shapes (`fixed_shape`): megatron-core's allgather token dispatcher (the MoE dispatcher
that runs without CUDA) gathers equal token counts from every expert-parallel rank and is
refused with variable-length pipeline micro-batches, so there every micro-batch of the step is
right-padded to one (rows, length) agreed over all ranks. Padding changes no real token's
logprob (causal attention; rows, and MoE routing without capacity limits, are per token) and
adds nothing to the loss (zero loss weight).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from proto.messages import Trajectory
from services.config.schema import PPOConfig
from services.trainer import batching, mismatch
from services.trainer.engines.base import StepStats, micro_batch_loss, step_stats, summed_over_ranks
from services.trainer.engines.megatron.optim import MasterAdapterOptimizer
from services.trainer.loss import LossStats

CrossEntropy = Callable[[Tensor, Tensor], Tensor]
"""(logits [..., V or V/tp], targets [...]) -> -log p(target); megatron-core's
`tensor_parallel.vocab_parallel_cross_entropy` under TP"""


def local_cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    return torch.logsumexp(logits, dim=-1) - logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def causal_mask(length: int, device: torch.device | str) -> Tensor:
    """Megatron's mask convention: True where attention is NOT allowed. Right padding needs
    nothing more: a real token never attends to the pad tokens after it."""
    return torch.triu(torch.ones(length, length, dtype=torch.bool, device=device), 1)[None, None]


def model_inputs(mb: batching.MicroBatch, device: torch.device | str) -> tuple[Tensor, Tensor, Tensor]:
    """(input_ids, position_ids, attention_mask) as `GPTModel.forward` takes them."""
    input_ids = mb.input_ids.to(device)
    b, length = input_ids.shape
    position_ids = torch.arange(length, device=device).unsqueeze(0).expand(b, -1)
    return input_ids, position_ids, causal_mask(length, device)


def logprobs_from_logits(
    logits: Tensor,
    mb: batching.MicroBatch,
    device: torch.device | str,
    temperature: float,
    cross_entropy: CrossEntropy = local_cross_entropy,
) -> Tensor:
    """log pi(target) on the micro-batch's target columns from the model's logits [b, s, V]."""
    length, width = mb.input_ids.shape[1], mb.targets.shape[1]
    # the logit at position t predicts token t + 1
    logits = logits[:, length - width - 1 : length - 1].float() / temperature
    return -cross_entropy(logits, mb.targets.to(device))


def target_logprobs(
    model: nn.Module,
    mb: batching.MicroBatch,
    device: torch.device | str,
    temperature: float,
    cross_entropy: CrossEntropy = local_cross_entropy,
) -> Tensor:
    """log pi(target) on the micro-batch's target columns, sampling temperature applied."""
    logits = model(*model_inputs(mb, device))
    return logprobs_from_logits(logits, mb, device, temperature, cross_entropy)


def plan_step(
    groups: list[Trajectory], ppo: PPOConfig, dp_rank: int, dp_size: int, max_tokens: int, pad_id: int
) -> list[list[batching.MicroBatch]]:
    """This data-parallel rank's collated micro-batches, one list per optimiser update."""
    samples = batching.to_samples(groups, ppo)
    if not samples:
        raise ValueError("train_step: every completion in the batch is empty")
    minibatches = batching.split_minibatches(samples, ppo.ppo_n_minibatches, token_level=ppo.token_level_loss)
    return [
        [batching.collate(mb, pad_id) for mb in batching.plan_micro_batches(minibatch, dp_rank, dp_size, max_tokens)]
        for minibatch in minibatches
    ]


def pad_micro_batch(mb: batching.MicroBatch, rows: int, length: int, pad_id: int) -> batching.MicroBatch:
    """`mb` right-padded to [rows, length]: pad tokens, zero loss weight, targets widened."""
    b, n = mb.input_ids.shape
    first_target = n - mb.targets.shape[1]
    if rows < b or length < n:
        raise ValueError(f"pad_micro_batch: [{rows}, {length}] is smaller than the micro-batch [{b}, {n}]")
    input_ids = torch.full((rows, length), pad_id, dtype=mb.input_ids.dtype)
    input_ids[:b, :n] = mb.input_ids
    attention_mask = torch.zeros((rows, length), dtype=mb.attention_mask.dtype)
    attention_mask[:b, :n] = mb.attention_mask

    def per_token(t: Tensor) -> Tensor:
        out = torch.zeros((rows, length - first_target), dtype=t.dtype)
        out[:b, : t.shape[1]] = t
        return out

    return batching.MicroBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        targets=input_ids[:, first_target:],
        loss_weights=per_token(mb.loss_weights),
        behave_logprobs=per_token(mb.behave_logprobs),
        versions=per_token(mb.versions),
        advantages=per_token(mb.advantages),
        groups=torch.cat([mb.groups, mb.groups[:1].expand(rows - b)]),
    )


def fixed_shape_plans(
    plans: list[list[batching.MicroBatch]], pad_id: int, device: torch.device | str
) -> list[list[batching.MicroBatch]]:
    """Every micro-batch padded to the largest rows and length of any on any rank (a MAX
    all-reduce over the default group; one rank: its own largest)."""
    shape = torch.tensor([max(mb.input_ids.shape[i] for plan in plans for mb in plan) for i in (0, 1)], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(shape, op=dist.ReduceOp.MAX)
    rows, length = (int(v) for v in shape.tolist())
    return [[pad_micro_batch(mb, rows, length, pad_id) for mb in plan] for plan in plans]


def train_step(
    model: nn.Module,
    optimizer: MasterAdapterOptimizer,
    groups: list[Trajectory],
    head_version: int,
    *,
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
    fixed_shape: bool = False,
) -> StepStats:
    """Proximal logprobs with no grad, then `ppo.ppo_n_minibatches` optimiser updates."""
    t0 = time.perf_counter()
    plans = plan_step(groups, ppo, dp_rank, dp_size, max_tokens, pad_id)
    if fixed_shape:
        plans = fixed_shape_plans(plans, pad_id, device)
    with torch.no_grad():
        prox = [[target_logprobs(model, mb, device, temperature, cross_entropy) for mb in plan] for plan in plans]
    # the train/inference mismatch, as the FSDP2 engine reports it: the proximal logprobs are
    # this model's own before the update; a DP rank holds its share of the tokens (TP ranks of
    # one group hold the same), so the tally is summed over the data-parallel group only
    tally = mismatch.Tally.empty(len(groups))
    for plan, plan_prox in zip(plans, prox):
        for mb, mb_prox in zip(plan, plan_prox):
            tally.add(mb, mb_prox, head_version)
    if dp_group is not None and dp_size > 1:
        tally.all_reduce(group=dp_group, device=optimizer.masters[0].device)

    stats, loss_total, grad_norm = LossStats(), 0.0, 0.0
    for plan, plan_prox in zip(plans, prox):
        optimizer.zero_grad()
        for mb, mb_prox in zip(plan, plan_prox):
            lp = target_logprobs(model, mb, device, temperature, cross_entropy)
            loss, mb_stats = micro_batch_loss(lp, mb_prox, mb, head_version, ppo, device)
            loss.backward()
            loss_total += loss.item()
            stats = stats + mb_stats
        grad_norm = optimizer.step(grad_clip)

    if dp_group is not None and dp_size > 1:
        stats, loss_total = summed_over_ranks(stats, loss_total, group=dp_group, device=optimizer.masters[0].device)
    result = step_stats(
        groups,
        step=step_index,
        updates=len(plans),
        loss_total=loss_total,
        stats=stats,
        grad_norm=grad_norm,
        lr=lr,
        started=t0,
    )
    result.mismatch, result.group_kl = tally.report(), tally.group_kl().tolist()
    return result
