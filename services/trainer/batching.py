"""Trajectories -> padded micro-batches, as pure functions (no model, no process group).

Every rank holds the whole batch and runs the same deterministic plan, so the ranks agree on
how many micro-batches there are without talking to each other: FSDP2's collectives hang if
one rank runs a forward the others do not.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from proto.messages import Trajectory
from services.config.schema import PPOConfig
from services.trainer.loss import batch_normalise, group_advantages, overlong_penalty


@dataclass(frozen=True)
class Sample:
    """One completion with its prompt, ready to be scored by the trainer's model."""

    input_ids: list[int]
    """prompt + completion tokens"""
    prompt_len: int
    behave_logprobs: list[float]
    versions: list[int]
    advantage: float
    token_weight: float = 0.0
    """this sample's per-token share of its minibatch's loss (0 for padding samples)"""
    group: int = 0
    """the index of its trajectory in the step's batch (what the mismatch tally groups by)"""

    @property
    def completion_len(self) -> int:
        return len(self.input_ids) - self.prompt_len


def problem(trajectory: Trajectory, vocab_size: int | None = None) -> str | None:
    """Why `trajectory` cannot be trained (by a model of `vocab_size` tokens, when given), or
    None. What `to_samples` needs of a trajectory is checked here and only here: the trainer
    checks each trajectory once as it arrives (`AcceptedQueue`) and converts it once, in the
    step, where `to_samples` refuses with the same words."""
    if not trajectory.prompt_token_ids:
        return "prompt_token_ids is empty"
    if vocab_size is not None:
        for where, tokens in [("prompt_token_ids", trajectory.prompt_token_ids)] + [
            (f"completions[{i}].token_ids", c.token_ids) for i, c in enumerate(trajectory.completions)
        ]:
            if any(t >= vocab_size for t in tokens):
                return f"{where}: token id {max(tokens)} >= the model's vocab size {vocab_size}"
    return None


def advantages(rewards: list[Tensor], lengths: list[Tensor], ppo: PPOConfig) -> list[Tensor]:
    """Each completion's advantage, group by group, from its reward and its length in tokens:
    the overlong penalty, then shaping and normalisation (AReaL's `_compute_advantages` for one
    reward per completion, with no critic and no KL term)."""
    if ppo.overlong_tokens is not None:
        if ppo.overlong_max_tokens is None:
            raise ValueError(
                "actor.ppo.overlong_max_tokens: None with overlong_tokens set; set it, or load the config "
                "with services.config.loader, which fills it from gconfig.max_new_tokens"
            )
        rewards = [
            r
            + overlong_penalty(
                n, window=ppo.overlong_tokens, factor=ppo.overlong_penalty_factor, max_tokens=ppo.overlong_max_tokens
            )
            for r, n in zip(rewards, lengths, strict=True)
        ]
    out = group_advantages(
        rewards,
        normalise=ppo.reward_norm,
        group_adv_norm=ppo.group_adv_norm,
        adv_norm_std=ppo.adv_norm_std,
        batch_std=ppo.batch_std,
        leave_one_out=ppo.leave_one_out,
        reward_scaling=ppo.reward_scaling,
        reward_bias=ppo.reward_bias,
        reward_clip=ppo.reward_clip,
        eps=ppo.norm_eps,
    )
    if ppo.batch_adv_norm:
        flat = batch_normalise(torch.cat(out), torch.cat(lengths), use_std=ppo.batch_adv_norm_std, eps=ppo.norm_eps)
        out = list(flat.split([len(r) for r in rewards]))
    return out


def to_samples(groups: list[Trajectory], ppo: PPOConfig) -> list[Sample]:
    """Flatten groups into samples carrying their advantage (`advantages`). Completions with no
    token still count for their group's mean and std but produce no sample."""
    if not groups:
        raise ValueError("groups: a train step needs at least one trajectory")
    rewards = [torch.tensor([c.reward for c in g.completions], dtype=torch.float64) for g in groups]
    lengths = [torch.tensor([len(c.token_ids) for c in g.completions], dtype=torch.long) for g in groups]
    samples = []
    for index, (group, adv) in enumerate(zip(groups, advantages(rewards, lengths, ppo))):
        if (why := problem(group)) is not None:
            raise ValueError(f"trajectory {group.trajectory_id}: {why}")
        for completion, a in zip(group.completions, adv.tolist()):
            if not completion.token_ids:
                continue
            samples.append(
                Sample(
                    input_ids=list(group.prompt_token_ids) + list(completion.token_ids),
                    prompt_len=len(group.prompt_token_ids),
                    behave_logprobs=list(completion.logprobs),
                    versions=list(completion.versions),
                    advantage=a,
                    group=index,
                )
            )
    return samples


def split_minibatches(samples: list[Sample], n: int, *, token_level: bool = True) -> list[list[Sample]]:
    """`n` contiguous minibatches (one optimiser step each), with loss weights that make each
    minibatch's loss a mean: over its completion tokens (token-level), or over its sequences
    of per-sequence token means."""
    if n < 1:
        raise ValueError(f"actor.ppo.ppo_n_minibatches: {n} must be >= 1")
    if len(samples) < n:
        raise ValueError(
            f"actor.ppo.ppo_n_minibatches: {n} exceeds the {len(samples)} non-empty completions "
            "of this batch; lower it or raise rollout.consumer_batch_size"
        )
    size, extra = divmod(len(samples), n)
    out, start = [], 0
    for i in range(n):
        stop = start + size + (1 if i < extra else 0)
        mb = samples[start:stop]
        start = stop
        total = sum(s.completion_len for s in mb)
        if token_level:
            out.append([replace(s, token_weight=1.0 / total) for s in mb])
        else:
            out.append([replace(s, token_weight=1.0 / (len(mb) * s.completion_len)) for s in mb])
    return out


def _pack(samples: list[Sample], max_tokens: int) -> list[list[Sample]]:
    """Greedy in order: a micro-batch grows while its padded size stays within max_tokens
    (a single over-long sample gets a micro-batch of its own)."""
    packs: list[list[Sample]] = []
    current: list[Sample] = []
    longest = 0
    for s in samples:
        new_longest = max(longest, len(s.input_ids))
        if current and new_longest * (len(current) + 1) > max_tokens:
            packs.append(current)
            current, new_longest = [], len(s.input_ids)
        current.append(s)
        longest = new_longest
    if current:
        packs.append(current)
    return packs


def plan_micro_batches(minibatch: list[Sample], rank: int, world_size: int, max_tokens: int) -> list[list[Sample]]:
    """This rank's micro-batches of `minibatch`: samples are dealt round-robin to ranks, then
    packed; every rank gets the same number of micro-batches, a rank short of work gets
    zero-weight copies of a sample so its forward/backward still joins the collectives."""
    if max_tokens < 1:
        raise ValueError(f"actor.mb_spec_max_tokens: {max_tokens} must be >= 1")
    shards = [minibatch[r::world_size] for r in range(world_size)]
    counts = [len(_pack(shard, max_tokens)) for shard in shards]
    mine = _pack(shards[rank], max_tokens)
    filler = replace(minibatch[0], token_weight=0.0)
    while len(mine) < max(counts):
        mine.append([filler])
    return mine


@dataclass
class MicroBatch:
    """Right-padded tensors. Per-token tensors cover the target columns `first_target`..L-1
    (the first completion token of the shortest prompt onwards): logits are only needed
    there, which `logits_to_keep` exploits."""

    input_ids: Tensor
    attention_mask: Tensor
    targets: Tensor
    loss_weights: Tensor
    behave_logprobs: Tensor
    versions: Tensor
    advantages: Tensor
    groups: Tensor
    """[rows]: each row's trajectory index in the step's batch (`Sample.group`)"""

    @property
    def logits_to_keep(self) -> int:
        return self.targets.shape[1] + 1


def collate(samples: list[Sample], pad_id: int = 0) -> MicroBatch:
    """`samples` as right-padded tensors. A fixed number of tensor operations whatever the
    batch's size (every field filled through a row mask from one flat list): the trainer's step
    thread collates each micro-batch twice a step, holding the GIL throughout, and a small tensor
    op per row and field cost ~30 us a sample a collate (arith3's 8 runs of 128 samples: ~60 ms
    a joint step, against ~8 ms so)."""
    if not samples:
        raise ValueError("collate: empty micro-batch")
    length = max(len(s.input_ids) for s in samples)
    first_target = min(s.prompt_len for s in samples)
    if first_target < 1:
        raise ValueError("collate: every sample needs at least one prompt token")
    b, width = len(samples), length - first_target
    for s in samples:
        if len(s.behave_logprobs) != s.completion_len or len(s.versions) != s.completion_len:
            raise ValueError(
                f"collate: a sample of {s.completion_len} completion tokens has {len(s.behave_logprobs)} "
                f"behaviour logprobs and {len(s.versions)} versions; it needs one of each per token"
            )
    ends = torch.tensor([len(s.input_ids) for s in samples], dtype=torch.long)[:, None]
    starts = torch.tensor([s.prompt_len for s in samples], dtype=torch.long)[:, None]
    tokens = torch.arange(length) < ends  # [b, length]: each row's tokens
    columns = torch.arange(first_target, length)
    completion = (columns >= starts) & (columns < ends)  # [b, width]: each row's completion tokens
    input_ids = torch.full((b, length), pad_id, dtype=torch.long)
    input_ids[tokens] = torch.tensor([t for s in samples for t in s.input_ids], dtype=torch.long)
    attention_mask = tokens.long()
    weights = torch.where(completion, torch.tensor([s.token_weight for s in samples])[:, None], 0.0)
    behave = torch.zeros((b, width))
    behave[completion] = torch.tensor([x for s in samples for x in s.behave_logprobs], dtype=behave.dtype)
    versions = torch.zeros((b, width), dtype=torch.long)
    versions[completion] = torch.tensor([v for s in samples for v in s.versions], dtype=torch.long)
    advantages = torch.where(completion, torch.tensor([s.advantage for s in samples])[:, None], 0.0)
    groups = torch.tensor([s.group for s in samples], dtype=torch.long)
    return MicroBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        targets=input_ids[:, first_target:],
        loss_weights=weights,
        behave_logprobs=behave,
        versions=versions,
        advantages=advantages,
        groups=groups,
    )
