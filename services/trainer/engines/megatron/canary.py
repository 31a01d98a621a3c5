"""The load canary from a Megatron model: the run's fixed prompts decoded greedily under the
adapter the model holds now, as `services.trainer.canary.reference` decodes an HF model.

Invariant: the canary is computed from the trainer's own Megatron model in its own dtype (the
frozen base in `actor.dtype`, the adapter's copies cast from the fp32 masters, which is what
the published version carries), never from the converted PEFT tensors: a replica's check then
covers the conversion too. Logits are gathered over tensor-parallel ranks and cut to the HF
vocabulary (Megatron may pad it), so every rank returns the same canary.

Without pipeline or expert parallelism only: under either, a forward is megatron-core's
schedule or expert dispatch over several ranks, and those runs publish no canary (their
replicas serve the version unchecked, as every Megatron run did before).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from proto.messages import Canary, Dtype
from services.trainer import canary as trainer_canary
from services.trainer.engines.megatron.step import causal_mask


class _HFCall(nn.Module):
    """A Megatron `GPTModel` called as `reference` calls an HF causal LM: `model(input_ids=...)
    .logits` over the whole vocabulary."""

    def __init__(self, model: nn.Module, vocab_size: int, gather: object | None):
        super().__init__()
        self.model, self.vocab_size, self.gather = model, vocab_size, gather

    def forward(self, input_ids: torch.Tensor) -> SimpleNamespace:
        b, length = input_ids.shape
        position_ids = torch.arange(length, device=input_ids.device).unsqueeze(0).expand(b, -1)
        logits = self.model(input_ids, position_ids, causal_mask(length, input_ids.device))
        if self.gather is not None:
            logits = self.gather(logits)  # type: ignore[operator]
        return SimpleNamespace(logits=logits[..., : self.vocab_size])


@torch.no_grad()
def megatron_canary(
    model: nn.Module, vocab_size: int, seed: int, dtype: Dtype, tp_gather: object | None = None
) -> Canary:
    """`tp_gather`: megatron-core's `gather_from_tensor_model_parallel_region` under TP > 1."""
    with trainer_canary.evaluating(model):
        prompt_ids = trainer_canary.prompts(vocab_size, seed=seed)
        return trainer_canary.reference(_HFCall(model, vocab_size, tp_gather), prompt_ids, dtype)
