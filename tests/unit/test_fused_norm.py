"""Fused RMSNorm: swapped in only where it equals the model's own norm, and the model's outputs
stay those of the original."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from services.rollout import fused_norm
from tests.fixtures.tiny import tiny_qwen2

pytestmark = pytest.mark.unit


class OnePlusRMSNorm(nn.Module):
    """Gemma's form: scales by 1 + weight, so the plain replacement would be wrong."""

    def __init__(self, size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_qwen2_norm_is_swapped_and_the_logits_stay(dtype):
    model = tiny_qwen2(seed=1).to(dtype)
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__.endswith("RMSNorm"):
                m.weight.normal_(1.0, 0.3)
    own = copy.deepcopy(model)
    final_weight = model.model.norm.weight
    layers = model.config.num_hidden_layers
    assert fused_norm.fuse(model) == 2 * layers + 1  # two per layer and the final one
    assert sum(isinstance(m, fused_norm.RMSNorm) for m in model.modules()) == 2 * layers + 1
    assert model.model.norm.weight is final_weight  # the parameter is shared, not copied
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(model(input_ids=ids).logits, own(input_ids=ids).logits, atol=tol, rtol=tol)


def test_a_norm_that_computes_something_else_keeps_its_own_module():
    model = nn.Sequential(OnePlusRMSNorm(8), nn.Linear(8, 8))
    assert fused_norm.fuse(model) == 0
    assert isinstance(model[0], OnePlusRMSNorm)
