"""Mixed precision for LoRA training: a frozen base in the compute dtype, fp32 adapter masters.

The base weights never change, so they stay in `actor.dtype` (bf16 on GPUs: half the memory
of fp32). The LoRA parameters, their gradients and the optimizer state are fp32: an Adam step
of lr 3e-5 is far below half a bf16 ulp of a typical LoRA-A entry (~1e-3 at 0.17), so a bf16
adapter silently keeps most of its entries unchanged. The forward runs under
`torch.autocast(compute dtype)`: matmuls (the LoRA ones too) take bf16 copies of the fp32
masters, and the gradients land on the fp32 masters in fp32. Log-softmax and the loss are
computed outside autocast, in fp32.

Why autocast and not FSDP2's `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`:
the single-process trainer (one GPU, the common case) is not wrapped by FSDP2 and would need
autocast anyway, and with one mechanism for both the sharded step still equals the
one-process step in bf16 as it does in fp32. FSDP2 all-gathers the mixed bf16/fp32 layer
groups as bytes; the adapter is a few per cent of a layer's bytes (r=16 on a 7B layer: ~1 %), so gathering
it in fp32 costs little, and its gradients are reduce-scattered in fp32.

The published adapter is cast once, on the way out, to the serving dtype (`actor.dtype`,
recorded in `LoraSpec.dtype`); checkpoints keep the fp32 masters beside it.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from services.common.adapter_io import DTYPES

MASTER_DTYPE = torch.float32
MASTERS_KEY = "fp32_adapter"
"""the optimizer-state key under which a checkpoint keeps the fp32 adapter masters"""


def compute_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"actor.dtype: {name!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[name]


def upcast(params: list[nn.Parameter]) -> None:
    """Make `params` (the adapter) fp32 masters in place; the modules keep the same objects."""
    for p in params:
        if p.dtype != MASTER_DTYPE:
            p.data = p.data.to(MASTER_DTYPE)


def forward_context(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """Autocast to `dtype` for the model's forward (and the recompute under gradient
    checkpointing, which restores the same autocast state); nothing in fp32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)
