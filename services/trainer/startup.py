"""Building the trainer's model without one full copy per rank.

One process: the base is read and moved to the device, one copy at a time.
N ranks (torchrun): rank 0 reads the checkpoint on the CPU; the other ranks build the same
architecture on the meta device (no storage). Every rank wraps LoRA and shards with FSDP2;
the meta ranks then allocate only their shards (`to_empty`) and the weights arrive from
rank 0 through torch's `set_model_state_dict(..., broadcast_from_rank0=True)`, one tensor
at a time. Host memory at start is therefore one full copy on rank 0 and a shard elsewhere,
instead of a full copy on every rank (`benchmarks/trainer_start_memory.py` measures it).
Rank 0's LoRA initialisation travels with the weights, so the ranks agree on it by
construction. Buffers that are not in the state dict (rotary `inv_freq`) are broadcast too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from services.common.adapter_io import DTYPES
from services.config.schema import ActorConfig

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def load_base(actor: ActorConfig, device: torch.device, rank: int, world_size: int) -> PreTrainedModel:
    """The base model in `actor.dtype`: on `device` for one process; under torchrun real
    weights on rank 0's CPU and an empty (meta) skeleton on the other ranks."""
    from services.common.models import load_base_model

    if world_size == 1:
        return load_base_model(actor.path, actor.dtype, str(device))
    if rank == 0:
        return load_base_model(actor.path, actor.dtype, "cpu")
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(actor.path)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=DTYPES[actor.dtype])


def on_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def full_state(model: nn.Module, rank: int) -> dict[str, torch.Tensor]:
    """Rank 0's whole state dict (base and LoRA init), taken before sharding; empty elsewhere."""
    return {k: v.detach() for k, v in model.state_dict().items()} if rank == 0 else {}


def receive_weights(model: nn.Module, state: dict[str, torch.Tensor], device: torch.device) -> None:
    """After `fully_shard`: give meta ranks storage for their shards, then load rank 0's
    `state` into every rank's shards (a collective: every rank calls, with the same model)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if on_meta(model):
        model.to_empty(device=device)
    # torch types the state as an invariant dict of its ValueType union; a dict of tensors is one
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))  # type: ignore[arg-type]
    with torch.no_grad():
        for _, buf in model.named_buffers():
            dist.broadcast(buf, src=0)


def enable_gradient_checkpointing(model: PreTrainedModel) -> None:
    """Recompute each decoder layer in the backward pass (non-reentrant, as AReaL does).

    Non-reentrant checkpointing needs no input that requires grad, so peft's usual
    `enable_input_require_grads` is not needed; transformers adds it anyway for models that
    take `input_ids` (harmless). FSDP2 composes with it: recent transformers checkpoint the layer's
    `forward`, leaving FSDP2's hooks outside; older ones checkpoint `__call__`, and then
    FSDP2's pre-forward hook does nothing in the recompute, for which its pre-backward hook
    has already gathered the layer."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:  # transformers >= 5.2x; `gradient_checkpointing_enable` is its old name
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def disable_dropout(model: nn.Module) -> int:
    """Every dropout of `model` off (AReaL's `disable_dropout`): `nn.Dropout` modules, and the
    `attention_dropout` rate HF attention modules and configs read at each forward. Returns how
    many were on."""
    changed = 0
    for module in model.modules():
        if isinstance(module, nn.Dropout) and module.p != 0:
            module.p = 0.0
            changed += 1
        rate = getattr(module, "attention_dropout", None)
        if isinstance(rate, float) and rate != 0:
            module.attention_dropout = 0.0  # type: ignore[assignment]  # a float, not a submodule
            changed += 1
        config = getattr(module, "config", None)
        for name in ("attention_dropout", "hidden_dropout", "dropout"):
            value = getattr(config, name, None)
            if isinstance(value, float) and value != 0:
                setattr(config, name, 0.0)
                changed += 1
    return changed
