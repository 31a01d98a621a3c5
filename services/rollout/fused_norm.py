"""RMSNorm for the rollout's model in as few kernels as the device allows.

transformers writes RMSNorm as five to seven elementwise and reduce kernels (cast, square, mean,
add eps, rsqrt, scale, cast back); on an H200 those were about 0.65 of the 8.6 ms of a 1.5B
batch-64 decode step. Where Triton runs (CUDA; its interpreter in tests) `norm_kernel` computes
the whole norm in one launch: no casts to float32 and back, no separate weight multiply.
Elsewhere, and where the kernel does not take a call, `F.rms_norm` computes the same float32
formula in one kernel where torch has a fused one, and the cast back and the weight multiply
stay as transformers does them. Either way the result equals the module's own up to the float
reduction order of the squares.

`fuse(model)` replaces only the norms that prove equal: every module whose class name ends in
`RMSNorm` and has a 1-D `weight` and a `variance_epsilon` is run once beside its replacement on a
probe input; a variant that computes something else (Gemma's `1 + weight`, another eps placement)
differs and keeps its own module. Torch and Triton only (the GPU image has no more).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.rollout import norm_kernel


class RMSNorm(nn.Module):
    """`weight * rms_norm(x in float32).to(x.dtype)`, the weight shared with the module replaced;
    one `norm_kernel` launch where it runs."""

    def __init__(self, weight: nn.Parameter, eps: float):
        super().__init__()
        self.weight = weight
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out = norm_kernel.normalize(hidden_states, self.weight, self.variance_epsilon)
        if out is not None:
            return out
        normed = F.rms_norm(hidden_states.float(), self.weight.shape, eps=self.variance_epsilon)
        return self.weight * normed.to(hidden_states.dtype)


def _candidate(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__.endswith("RMSNorm")
        and isinstance(weight, nn.Parameter)
        and weight.dim() == 1
        and isinstance(getattr(module, "variance_epsilon", None), float)
    )


@torch.no_grad()
def _same(own: nn.Module, fused: RMSNorm) -> bool:
    g = torch.Generator().manual_seed(0)
    probe = (torch.randn(4, fused.weight.shape[0], generator=g) * 3).to(fused.weight.device, fused.weight.dtype)
    want, got = own(probe), fused(probe)
    return want.shape == got.shape and bool(torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2))


def fuse(model: nn.Module) -> int:
    """Swap in `RMSNorm` for every equal norm of `model`; returns how many were swapped."""
    swaps = []
    for name, module in model.named_modules():
        if _candidate(module):
            fused = RMSNorm(module.weight, module.variance_epsilon)
            if _same(module, fused):
                swaps.append((name, fused))
    for name, fused in swaps:
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, fused)
    return len(swaps)
