"""Adapter state of a Megatron model in megatron-bridge naming, as pure tensor code.

megatron-bridge's `LoRALinear` wraps a linear as `<linear>.to_wrap` (the frozen base) and
`<linear>.adapter` (a `ParallelLinearAdapter`), so the trainable tensors are named
`decoder.layers.L.<module>.adapter.linear_in.weight` (LoRA A, `[r, in]`) and
`....adapter.linear_out.weight` (LoRA B, `[out, r]`), output = base(x) + alpha/r * B(A(x)).

Under tensor parallelism each rank holds a slice (megatron-bridge `ParallelLinearAdapter`):

| base layer | linear_in (A) | linear_out (B) |
|---|---|---|
| column-parallel (`linear_qkv`, `linear_fc1`) | rows split: `[r/tp, in]` | rows split: `[out/tp, r]` |
| row-parallel (`linear_proj`, `linear_fc2`) | columns split: `[r, in/tp]` | rows split: `[out/tp, r]` |

`linear_qkv` is split by whole KV groups, so concatenating the B slices keeps Megatron's
per-group order. `linear_fc1` of a gated MLP is not: every rank's slice is `[its gate rows;
its up rows]`, so the gathered B must be de-interleaved into `[all gate; all up]` before it
is the layout `services.common.megatron_to_hf.convert` expects.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

import torch

from services.common.lora_targets import for_backend
from services.common.megatron_to_hf import ModelShape, convert
from services.config.schema import ActorConfig

_ADAPTER = re.compile(
    r"^(?P<module>.*\.(?P<linear>linear_qkv|linear_proj|linear_fc1|linear_fc2))"
    r"\.adapter\.linear_(?P<side>in|out)\.weight(?P<expert>\d*)$"
)
COLUMN_PARALLEL = ("linear_qkv", "linear_fc1")
ROW_PARALLEL = ("linear_proj", "linear_fc2")


class AdapterStateError(ValueError):
    pass


def megatron_targets(actor: ActorConfig) -> list[str]:
    """`actor.target_modules` as the names megatron-bridge's `LoRA(target_modules=...)` takes:
    empty / all-linear -> the four linear layers; anything else must be one of them (this engine
    asks for Megatron names whatever `actor.backend` says)."""
    try:
        return for_backend(actor.target_modules, "megatron")
    except ValueError as exc:
        raise AdapterStateError(str(exc)) from None


def strip_wrappers(name: str) -> str:
    """DDP / Float16Module add `module.` prefixes; they carry no meaning in the adapter name."""
    while name.startswith("module."):
        name = name[len("module.") :]
    return name


def is_adapter_name(name: str) -> bool:
    return _ADAPTER.match(strip_wrappers(name)) is not None


def adapter_named_parameters(
    named: Iterable[tuple[str, torch.nn.Parameter]],
) -> list[tuple[str, torch.nn.Parameter]]:
    """The LoRA tensors among a Megatron model's named parameters, under their bridge names.

    Only adapter tensors may be trainable: a trainable base weight means LoRA was not applied
    the way the engine expects (it would be silently left out of checkpoints and exports)."""
    out = []
    for raw, p in named:
        name = strip_wrappers(raw)
        if is_adapter_name(name):
            out.append((name, p))
        elif p.requires_grad:
            raise AdapterStateError(
                f"{raw}: a trainable parameter that is not a LoRA adapter tensor; the base model "
                "must be frozen (megatron-bridge's LoRA freezes it when applied with training=True)"
            )
    if not out:
        raise AdapterStateError(
            "the model has no `.adapter.linear_in/out.weight` tensors; apply megatron-bridge's LoRA to it first"
        )
    return out


def tp_split(name: str, tensor: torch.Tensor, tp_size: int) -> list[torch.Tensor]:
    """The slices each TP rank holds of a full adapter tensor (the inverse of `merge_tp`)."""
    m = _match(name)
    if tp_size == 1:
        return [tensor]
    side, linear = m["side"], m["linear"]
    if side == "in" and linear in ROW_PARALLEL:
        return list(tensor.chunk(tp_size, dim=1))
    if side == "out" and linear == "linear_fc1":
        gate, up = tensor.chunk(2, dim=0)
        return [torch.cat(pair, dim=0) for pair in zip(gate.chunk(tp_size), up.chunk(tp_size))]
    return list(tensor.chunk(tp_size, dim=0))


def merge_tp(shards: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Per-TP-rank adapter states (index = TP rank) -> the full (tp = 1) adapter state."""
    if not shards:
        raise AdapterStateError("shards: need at least one TP rank's adapter state")
    names = set(shards[0])
    for rank, shard in enumerate(shards[1:], start=1):
        if set(shard) != names:
            diff = sorted(names ^ set(shard))[:3]
            raise AdapterStateError(f"TP rank {rank}: holds different adapter tensors ({diff})")
    merged: dict[str, torch.Tensor] = {}
    for name in sorted(names):
        m = _match(name)
        parts = [shard[name] for shard in shards]
        if len(parts) == 1:
            merged[name] = parts[0]
        elif m["expert"] or ".experts." in name:
            raise AdapterStateError(
                f"{name}: expert adapters under tensor parallelism are not supported; use "
                "expert_model_parallel_size for MoE layers and tensor_model_parallel_size 1"
            )
        elif m["side"] == "in" and m["linear"] in ROW_PARALLEL:
            merged[name] = torch.cat(parts, dim=1)
        elif m["side"] == "out" and m["linear"] == "linear_fc1":
            halves = [p.chunk(2, dim=0) for p in parts]
            merged[name] = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
        else:
            merged[name] = torch.cat(parts, dim=0)
    return merged


def to_hf(state: Mapping[str, torch.Tensor], shape: ModelShape) -> dict[str, torch.Tensor]:
    """The hand-off to the exporter's converter: full bridge-named state -> PEFT tensors in
    fp32 (the master copy, what vLLM/SGLang/peft load), keyed as `adapter_io` expects."""
    return {k: v.float().contiguous() for k, v in convert(dict(state), shape).items()}


def _match(name: str) -> re.Match:
    m = _ADAPTER.match(strip_wrappers(name))
    if m is None:
        raise AdapterStateError(
            f"{name}: not a megatron-bridge adapter tensor "
            "(<module>.linear_{qkv,proj,fc1,fc2}.adapter.linear_{in,out}.weight)"
        )
    return m
