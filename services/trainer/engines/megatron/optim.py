"""The adapter's optimizer: fp32 master weights for bf16 LoRA tensors, no distributed optimizer.

megatron-bridge creates the adapter in the model's dtype (bf16), and an Adam update of a
bf16 tensor loses most of its bits (lr * 1e-3-sized steps vanish against bf16's 8-bit
mantissa). Megatron's own answer is the mixed-precision optimizer with fp32 main params; for
a few million adapter parameters the same thing is a dozen lines of torch: the optimizer
steps fp32 masters, the model's bf16 tensors are copied from them after each step. The
distributed optimizer (ZeRO-1 over contiguous buffers of all parameters) is off: LoRA
turns it off in AReaL too, and sharding a state this small gains nothing.

Collectives are passed in, so the class is plain torch and runs on one CPU process in tests:
`dp_group` sums gradients over data-parallel replicas (loss weights are already shares of
the whole batch, so a sum, not a mean, gives the batch gradient); `mp_group` completes the
gradient norm over tensor/pipeline-parallel slices.

Expert adapters (`.experts.` in the name) under expert parallelism: each expert lives on one
expert-parallel rank and the token dispatcher brings it every data-parallel rank's tokens, so
its gradient is already summed over those; it is summed only over `expert_dp_group` (ranks
holding the same experts for other data), and its share of the norm is completed over
`expert_mp_group` (expert x tensor x pipeline ranks: each holds different experts).
Without expert groups, expert adapters are treated as dense ones (expert parallel size 1).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn


class MasterAdapterOptimizer:
    def __init__(
        self,
        named_params: Sequence[tuple[str, nn.Parameter]],
        make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
        *,
        dp_group: dist.ProcessGroup | None = None,
        mp_group: dist.ProcessGroup | None = None,
        expert_dp_group: dist.ProcessGroup | None = None,
        expert_mp_group: dist.ProcessGroup | None = None,
    ):
        if not named_params:
            raise ValueError("named_params: the adapter has no parameters to optimise")
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        for n, p in named_params:
            if not p.requires_grad:
                raise ValueError(f"{n}: adapter parameter does not require grad")
        # fp32 params are their own masters (no copy, no extra memory)
        self.masters = [
            p if p.dtype == torch.float32 else nn.Parameter(p.detach().float().clone()) for p in self.params
        ]
        self.optimizer = make_optimizer(self.masters)
        self.dp_group, self.mp_group = dp_group, mp_group
        split = expert_mp_group is not None
        self.expert_dp_group = expert_dp_group if split else dp_group
        self.expert = [split and ".experts." in n for n in self.names]
        self.expert_mp_group = expert_mp_group

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        for m in self.masters:
            m.grad = None

    def _sync_grads(self) -> None:
        for p, m, expert in zip(self.params, self.masters, self.expert):
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            group = self.expert_dp_group if expert else self.dp_group
            if group is not None and dist.get_world_size(group) > 1:
                grad = grad.float()
                dist.all_reduce(grad, group=group)
            m.grad = grad.float() if m is not p else grad

    def grad_norm(self) -> float:
        device = self.masters[0].device
        sums = {e: torch.zeros((), dtype=torch.float64, device=device) for e in (False, True)}
        for m, expert in zip(self.masters, self.expert):
            if m.grad is not None:
                sums[expert] += m.grad.double().pow(2).sum()
        for expert, group in ((False, self.mp_group), (True, self.expert_mp_group)):
            # every rank joins both reductions, holding expert adapters or not
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(sums[expert], group=group)
        return math.sqrt(float(sums[False] + sums[True]))

    def step(self, max_norm: float) -> float:
        """Sync gradients, clip to `max_norm` (<= 0: no clipping), step, copy masters into the
        model's tensors. Returns the pre-clip global gradient norm."""
        self._sync_grads()
        norm = self.grad_norm()
        if max_norm > 0 and math.isfinite(norm) and norm > max_norm:
            coef = max_norm / (norm + 1e-6)
            for m in self.masters:
                if m.grad is not None:
                    m.grad.mul_(coef)
        if math.isfinite(norm):
            self.optimizer.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                if m is not p:
                    p.copy_(m)
        return norm

    def master_state(self) -> dict[str, torch.Tensor]:
        """The fp32 adapter tensors by bridge name (this rank's slices), on CPU."""
        return {n: m.detach().cpu().clone() for n, m in zip(self.names, self.masters)}

    def state_dict(self) -> dict:
        return {"names": list(self.names), "masters": self.master_state(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if list(state["names"]) != self.names:
            missing = sorted(set(self.names) - set(state["names"]))[:3]
            extra = sorted(set(state["names"]) - set(self.names))[:3]
            raise ValueError(
                f"optimizer checkpoint does not fit this adapter (missing {missing}, unexpected "
                f"{extra}); was actor.lora_rank/target_modules or the parallel layout changed?"
            )
        with torch.no_grad():
            for n, p, m in zip(self.names, self.params, self.masters):
                saved = state["masters"][n]
                if tuple(saved.shape) != tuple(p.shape):
                    raise ValueError(f"{n}: checkpoint shape {list(saved.shape)} != {list(p.shape)}")
                m.copy_(saved.to(m.device))
                if m is not p:
                    p.copy_(m)
        self.optimizer.load_state_dict(state["optimizer"])
