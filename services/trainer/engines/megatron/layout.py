"""Where each rank's adapter tensors sit in the whole model, and the whole adapter put together.

Invariant: `globalize` renames a rank's tensors from the numbering of its own module tree to
the full model's (layer `L` of a pipeline stage whose first layer is global layer `offset` is
`decoder.layers.<offset + L>`; local expert `e` of expert-parallel rank `r` holding `n` experts
is `local_experts.<r * n + e>`), and `assemble` gives exactly the adapter a one-rank model of
the same depth and expert count would hold: every global name once, tensor-parallel slices
merged by `state.merge_tp`. A name held by two ranks of the same tensor-parallel rank (data
or expert-data replicas, or dense layers repeated over expert-parallel ranks) must be the same
tensor there; it is taken once.

Why names are rewritten rather than kept per stage: the converter to PEFT
(`services.common.megatron_to_hf.convert`) and every consumer want the model's own layer and
expert numbers, and a checkpoint's shards keep local names (a resume has the same layout).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import torch

from services.trainer.engines.megatron.state import AdapterStateError, merge_tp

_LAYER = re.compile(r"(^|\.)decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


def globalize(state: Mapping[str, torch.Tensor], layer_offset: int, expert_offset: int = 0) -> dict[str, torch.Tensor]:
    """One rank's adapter under the full model's layer and expert numbers."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        new = _LAYER.sub(lambda m: f"{m[1]}decoder.layers.{int(m[2]) + layer_offset}.", name, count=1)
        new = _EXPERT.sub(lambda m: f".local_experts.{int(m[1]) + expert_offset}.", new, count=1)
        if new in out:
            raise AdapterStateError(f"{name}: renamed to {new}, which another tensor of this rank already has")
        out[new] = tensor
    return out


def layer_offset(layer_numbers: Sequence[int]) -> int:
    """The global index of a stage's first layer, from megatron-core's 1-based global
    `TransformerLayer.layer_number` of each local layer in order (contiguous, or the stage's
    local index would not map to one offset)."""
    if not layer_numbers:
        raise AdapterStateError("layer_numbers: this pipeline stage holds no transformer layer")
    first = layer_numbers[0] - 1
    if list(layer_numbers) != list(range(first + 1, first + 1 + len(layer_numbers))):
        raise AdapterStateError(f"layer_numbers: {list(layer_numbers)} are not contiguous on one stage")
    return first


def assemble(parts: Sequence[tuple[int, Mapping[str, torch.Tensor]]], tp_size: int) -> dict[str, torch.Tensor]:
    """Every rank's `(tensor-parallel rank, globalized state)` -> the whole adapter."""
    by_tp: list[dict[str, torch.Tensor]] = [{} for _ in range(tp_size)]
    for tp_rank, state in parts:
        if not 0 <= tp_rank < tp_size:
            raise AdapterStateError(f"tp_rank: {tp_rank} is outside tensor_model_parallel_size {tp_size}")
        held = by_tp[tp_rank]
        for name, tensor in state.items():
            if name not in held:
                held[name] = tensor
            elif not torch.equal(held[name], tensor):
                # replicas that drifted apart mean a missed gradient reduction: publishing
                # either one would hide it
                raise AdapterStateError(f"{name}: two replicas of TP rank {tp_rank} hold different values")
    return merge_tp(by_tp)
