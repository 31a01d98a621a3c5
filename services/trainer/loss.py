"""GRPO advantages and the decoupled PPO objective (AReaL), as pure tensor functions.

Three policies appear in the loss:
- pi_behave: the policy that generated a token (the rollout's logprobs, possibly several
  versions old);
- pi_prox: the trainer's policy at the start of this step (logprobs recomputed with no grad);
- pi_theta: the policy being optimised.
The PPO ratio is taken against pi_prox, so clipping bounds the update relative to the current
version no matter how stale the sample is; staleness is corrected by the behaviour importance
weight pi_prox / pi_behave, which is capped (mask or clamp) so that very stale tokens cannot
dominate the gradient.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

import torch
from torch import Tensor

ADV_EPS = 1e-6
"""added to the std so that a group of nearly equal rewards does not explode"""


def shape_rewards(rewards: Tensor, *, scaling: float = 1.0, bias: float = 0.0, clip: float | None = None) -> Tensor:
    """AReaL's reward shaping: (r + bias) * scaling, then clipped to [-clip, clip]."""
    shaped = (rewards + bias) * scaling
    return shaped if clip is None else shaped.clamp(-clip, clip)


def overlong_penalty(lengths: Tensor, *, window: int, factor: float, max_tokens: int) -> Tensor:
    """DAPO's soft overlong punishment, as AReaL's `reward_overlong_penalty`: 0 for a completion
    of up to `max_tokens - window` tokens, then falling by `factor` over the last `window` tokens
    (-factor at `max_tokens`); added to the raw reward, before shaping."""
    excess = lengths.double() - (max_tokens - window)
    return (-excess / window * factor).clamp(max=0.0)


def _means(values: Tensor, leave_one_out: bool) -> Tensor:
    """Each value's baseline: the mean of `values`, or with `leave_one_out` the mean of the
    others (RLOO; a lone value's is 0, as AReaL's)."""
    n = values.numel()
    if not leave_one_out:
        return values.mean().expand_as(values)
    if n <= 1:
        return torch.zeros_like(values)
    return (values.sum() - values) / (n - 1)


def _std(centred: Tensor) -> Tensor:
    """The unbiased std of values around their baselines (1 for a lone value, as AReaL's)."""
    n = centred.numel()
    return (centred.square().sum() / (n - 1)).sqrt() if n > 1 else centred.new_ones(())


def batch_normalise(advantages: Tensor, tokens: Tensor, *, use_std: bool = True, eps: float = ADV_EPS) -> Tensor:
    """AReaL's batch-level `adv_norm` for per-completion advantages: AReaL normalises per
    token over the batch's completion tokens, and every token of a completion carries the
    completion's advantage, so each completion counts with its token count. The std is
    unbiased over tokens, as AReaL's (std_unbiased: true)."""
    w = tokens.double()
    n = w.sum()
    if n <= 0:
        return advantages
    a = advantages.double()
    centred = a - (w * a).sum() / n
    if not use_std or n < 2:
        return centred.float()
    std = ((w * centred**2).sum() / (n - 1)).sqrt()
    return (centred / (std + eps)).float()


def group_advantages(
    groups: list[Tensor],
    *,
    normalise: bool = True,
    group_adv_norm: bool = True,
    adv_norm_std: bool = True,
    batch_std: bool = False,
    leave_one_out: bool = False,
    reward_scaling: float = 1.0,
    reward_bias: float = 0.0,
    reward_clip: float | None = None,
    eps: float = ADV_EPS,
) -> list[Tensor]:
    """One advantage per completion. `groups[i]` holds the rewards of prompt i's completions.

    With `group_adv_norm` each reward is centred on its group's mean (GRPO), without it on the
    whole batch's; `leave_one_out` centres on the mean of the others instead (RLOO). With
    `adv_norm_std` the centred rewards are divided by their std, within the same level, or with
    `batch_std` over the whole batch (LitePPO's group mean and batch std). A group whose rewards
    are all equal carries no signal about which completion is better and gets advantage 0
    everywhere. Without `normalise` the shaped rewards are the advantages (AReaL's
    `reward_norm: null`). AReaL's `Normalization`, for rewards one per completion.
    """
    if not groups:
        raise ValueError("groups: need at least one group of rewards")
    shaped = [shape_rewards(g.double(), scaling=reward_scaling, bias=reward_bias, clip=reward_clip) for g in groups]
    if not normalise:
        return [g.float() for g in shaped]
    sizes = [g.numel() for g in shaped]
    levels = shaped if group_adv_norm else [torch.cat(shaped)]
    centred_levels = [v - _means(v, leave_one_out) for v in levels]
    centred = torch.cat(centred_levels)
    if adv_norm_std:
        if group_adv_norm and not batch_std:
            stds = torch.cat([_std(c).expand_as(c) for c in centred_levels])
        else:
            stds = _std(centred).expand_as(centred)
        centred = centred / (stds + eps)
    return [a.float() for a in centred.split(sizes)]


@dataclass
class LossStats:
    """Sums over tokens, so micro-batches (and ranks) add up before taking means."""

    tokens: float = 0.0
    clipped: float = 0.0
    """tokens where the clipped surrogate was the active (larger) term"""
    masked: float = 0.0
    """tokens dropped because pi_prox / pi_behave exceeded the cap (mode mask)"""
    clamped: float = 0.0
    """tokens whose pi_prox / pi_behave was cut to the cap (mode clamp)"""
    imp_weight_sum: float = 0.0
    imp_weight_max: float = 0.0
    staleness_sum: float = 0.0
    ratio_sum: float = 0.0
    """pi_theta / pi_prox over the tokens the loss keeps (a masked token adds 0, as AReaL's)"""

    def __add__(self, other: LossStats) -> LossStats:
        merged = {f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)}
        merged["imp_weight_max"] = max(self.imp_weight_max, other.imp_weight_max)
        return LossStats(**merged)

    def as_tensor(self) -> Tensor:
        return torch.tensor([getattr(self, f.name) for f in fields(self)], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, t: Tensor) -> LossStats:
        return cls(**{f.name: float(v) for f, v in zip(fields(cls), t.tolist())})

    def summary(self) -> dict[str, float]:
        """Means over the completion tokens, as AReaL reports a step (`clip_ratio`,
        `importance_weight`, `rs_filtered_fraction` = masked + clamped); the behaviour weight's
        over the tokens kept (`behave_imp_weight`)."""
        n = max(self.tokens, 1.0)
        kept = max(self.tokens - self.masked, 1.0)
        return {
            "tokens": self.tokens,
            "clip_fraction": self.clipped / n,
            "masked_fraction": self.masked / n,
            "clamped_fraction": self.clamped / n,
            "imp_weight_mean": self.imp_weight_sum / kept,
            "imp_weight_max": self.imp_weight_max,
            "ratio_mean": self.ratio_sum / n,
            "mean_staleness": self.staleness_sum / n,
        }


def sequence_ratio(log_ratio: Tensor, advantages: Tensor, keep: Tensor) -> tuple[Tensor, Tensor]:
    """GSPO's sequence-level ratio, as AReaL forms it for padded rows (one completion a row):
    exp of the mean of log(pi_theta / pi_prox) over the row's kept tokens, and the mean of their
    advantages, both given to every kept token (0 elsewhere). The mean, not the sum, keeps the
    ratio of a long completion near 1; the gradient reaches each token through that mean."""
    count = keep.sum(-1, keepdim=True).clamp(min=1).to(log_ratio.dtype)
    zero = torch.zeros_like(log_ratio)
    mean_log = torch.where(keep, log_ratio, zero).sum(-1, keepdim=True) / count
    mean_adv = torch.where(keep, advantages, torch.zeros_like(advantages)).sum(-1, keepdim=True) / count
    ratio = torch.where(keep, mean_log.exp().expand_as(log_ratio), zero)
    return ratio, torch.where(keep, mean_adv.expand_as(advantages), torch.zeros_like(advantages))


def sapo_gate(ratio: Tensor, advantages: Tensor, tau_pos: float, tau_neg: float) -> Tensor:
    """SAPO's soft gate in place of PPO's clip (AReaL's `sapo_loss_fn`): (4 / tau) *
    sigmoid(tau * (ratio - 1)), with tau_pos where the advantage is positive and tau_neg
    elsewhere. Its slope at ratio 1 is 1, so near the sampling policy it is the plain policy
    gradient, and it flattens smoothly as the ratio moves away (a larger tau, sooner)."""
    pos = torch.sigmoid(tau_pos * (ratio - 1.0)) * (4.0 / tau_pos)
    neg = torch.sigmoid(tau_neg * (ratio - 1.0)) * (4.0 / tau_neg)
    return torch.where(advantages > 0, pos, neg)


def decoupled_ppo_loss(
    logprobs: Tensor,
    prox_logprobs: Tensor,
    behave_logprobs: Tensor,
    advantages: Tensor,
    loss_weights: Tensor,
    *,
    eps_clip: float = 0.2,
    eps_clip_higher: float | None = None,
    imp_weight_cap: float | None = 5.0,
    imp_weight_mode: Literal["mask", "clamp", "none"] = "mask",
    use_decoupled_loss: bool = True,
    importance_sampling_level: Literal["token", "sequence"] = "token",
    sapo_taus: tuple[float, float] | None = None,
    staleness: Tensor | None = None,
) -> tuple[Tensor, LossStats]:
    """The decoupled PPO loss, summed over tokens.

    All tensors have the same shape (e.g. [batch, tokens]). `loss_weights` is 0 on padding
    and prompt tokens; on completion tokens it is the token's share of the batch loss
    (1 / total completion tokens of the whole batch for token-level averaging), so summing
    the returned loss over micro-batches gives the batch mean. `advantages` is broadcast per
    token. Without `use_decoupled_loss` this is plain PPO against the behaviour policy
    (pi_prox := pi_behave, no importance weight). `imp_weight_mode` none leaves the behaviour
    weight out (AReaL's decoupled loss without `rejection_sampling`, its default): the ratio is
    still taken against pi_prox. `importance_sampling_level` sequence is GSPO as AReaL has it
    (`sequence_ratio`): each row is one completion and its ratio, clipped, stands for all its tokens.
    `sapo_taus` (tau for positive, for negative advantages) replaces the clip with SAPO's soft
    gate (`sapo_gate`); AReaL allows it only against the behaviour policy (no decoupled loss).
    """
    if imp_weight_mode not in ("mask", "clamp", "none"):
        raise ValueError(f"behav_imp_weight_mode: {imp_weight_mode!r} must be 'mask', 'clamp' or 'none'")
    if importance_sampling_level not in ("token", "sequence"):
        raise ValueError(f"importance_sampling_level: {importance_sampling_level!r} must be 'token' or 'sequence'")
    if eps_clip <= 0:
        raise ValueError(f"eps_clip: {eps_clip} must be > 0")
    if sapo_taus is not None and (use_decoupled_loss or min(sapo_taus) <= 0):
        raise ValueError(f"use_sapo_loss: taus {sapo_taus} need to be > 0, without use_decoupled_loss (as AReaL's)")
    mask = loss_weights > 0
    prox = prox_logprobs if use_decoupled_loss else behave_logprobs
    prox = prox.detach()
    behave = behave_logprobs.detach()
    advantages = advantages.detach()

    # the behaviour weight comes first: the tokens it masks are out of a sequence's mean ratio too
    clamped = torch.zeros_like(mask)
    weighted = use_decoupled_loss and imp_weight_mode != "none"
    if weighted:
        imp_weight = torch.exp(prox - behave)
        if imp_weight_cap is None:
            keep = mask
        elif imp_weight_mode == "mask":
            keep = mask & (imp_weight <= imp_weight_cap)
        else:
            keep = mask
            clamped = mask & (imp_weight > imp_weight_cap)
            imp_weight = imp_weight.clamp(max=imp_weight_cap)
        imp_weight = torch.where(keep, imp_weight, torch.zeros_like(imp_weight))
    else:
        keep = mask
        imp_weight = mask.to(logprobs.dtype)

    if importance_sampling_level == "sequence":
        ratio, advantages = sequence_ratio(logprobs - prox, advantages, keep)
    else:
        ratio = torch.exp(logprobs - prox)
    if sapo_taus is None:
        high = eps_clip if eps_clip_higher is None else eps_clip_higher
        clipped_ratio = ratio.clamp(1.0 - eps_clip, 1.0 + high)
        surrogate = -advantages * ratio
        surrogate_clipped = -advantages * clipped_ratio
        pg = torch.maximum(surrogate, surrogate_clipped)
        # a masked token is out of the loss: it is neither clipped nor counted in the mean ratio
        clipped = (surrogate_clipped > surrogate) & keep
    else:
        pg = -sapo_gate(ratio, advantages, *sapo_taus) * advantages
        clipped = torch.zeros_like(mask)  # the gate bends the gradient; nothing is cut off
    if weighted:
        pg = pg * imp_weight

    loss = torch.where(mask, pg * loss_weights, torch.zeros_like(pg)).sum()
    with torch.no_grad():
        # sums under masks, not boolean indexing, and one copy to the host: each index or
        # float() would wait for the device, ~8 waits a micro-batch (imp_weight and ratio are
        # >= 0, so a max over the zeros left outside `keep` is the max over `keep`, 0 when empty)
        def within(t: Tensor, where: Tensor) -> Tensor:
            return torch.where(where, t.detach(), torch.zeros_like(t)).double()

        none = mask.new_zeros((), dtype=torch.float64)
        kept_weight = within(imp_weight, keep)
        sums = {
            "tokens": mask.double().sum(),
            "clipped": clipped.double().sum(),
            "masked": (mask & ~keep).double().sum(),
            "clamped": clamped.double().sum(),
            "imp_weight_sum": kept_weight.sum(),
            "imp_weight_max": kept_weight.amax(),
            "staleness_sum": within(staleness, mask).sum() if staleness is not None else none,
            "ratio_sum": within(ratio, keep).sum(),
        }
        stats = LossStats(**dict(zip(sums, torch.stack(list(sums.values())).tolist(), strict=True)))
    return loss, stats
