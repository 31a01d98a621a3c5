"""Adapters the benchmarks make up: random LoRA tensors for a model's linear layers, and the
AdapterReady event that announces a version of one.

Invariant: the tensors depend on the model's shapes, the rank, the seed and the dtype only
(a CPU generator, whatever the model's device), so runs on different machines load the same
bytes; the event is a well-formed one of trainer epoch `e0`, so the real replica code takes it.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from proto.messages import AdapterReady, LoraSpec, Payload
from services.common import adapter_io
from services.common.lora_targets import HF_LINEAR


def random_lora(model: nn.Module, rank: int, seed: int, dtype: torch.dtype, b_scale: float) -> dict[str, torch.Tensor]:
    """A (PEFT-named) LoRA pair for every all-linear layer of `model`: A ~ N(0, 1/in_features),
    B ~ N(0, b_scale^2), on the CPU."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and name.rsplit(".", 1)[-1] in HF_LINEAR:
            a = torch.randn(rank, mod.in_features, generator=g) / mod.in_features**0.5
            b = torch.randn(mod.out_features, rank, generator=g) * b_scale
            out[adapter_io.peft_key(name, "A")] = a.to(dtype)
            out[adapter_io.peft_key(name, "B")] = b.to(dtype)
    return out


def adapter_event(version: int, lora: LoraSpec, payloads: list[Payload], run: str = "bench") -> AdapterReady:
    """`version` of the `bench` adapter, trained at step `version`, created now."""
    return AdapterReady(
        run=run,
        trainer_epoch="e0",
        lora_name="bench",
        version=version,
        trainer_step=version,
        created_at=time.time(),
        lora=lora,
        payloads=payloads,
    )
