"""`lora.set_active_adapter` leaves a fleet's shared model exactly as peft's `set_adapter` does."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from services.config.schema import ActorConfig
from services.trainer.lora import add_lora, set_active_adapter, wrap_lora


def fleet_model():
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=64)  # fmt: skip
    model = wrap_lora(transformers.Qwen2ForCausalLM(cfg), ActorConfig(lora_rank=4))
    add_lora(model, ActorConfig(lora_rank=8, target_modules=["q_proj", "v_proj"]), "run2")
    add_lora(model, ActorConfig(lora_rank=2), "run3")
    for name, p in model.named_parameters():
        if "lora_B" in name:  # B is zero at first: every adapter would answer alike
            p.data.normal_(generator=torch.Generator().manual_seed(hash(name) % 2**31))
    return model


def state(model):
    flags = {name: p.requires_grad for name, p in model.named_parameters()}
    active = {name: list(m.active_adapters) for name, m in model.named_modules() if hasattr(m, "_active_adapter")}
    return flags, active, model.active_adapter, model.base_model.active_adapter


def test_switching_leaves_the_model_as_peft_does():
    ours = fleet_model()
    peft_side = copy.deepcopy(ours)
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(1))
    for adapter in ("run2", "run3", "default", "run3", "run2"):
        set_active_adapter(ours, adapter)
        peft_side.set_adapter(adapter)
        assert state(ours) == state(peft_side), adapter
        with torch.no_grad():
            assert torch.equal(ours(input_ids=ids).logits, peft_side(input_ids=ids).logits), adapter


def test_an_unknown_adapter_is_refused_by_name():
    with pytest.raises(ValueError, match="run9.*add_lora"):
        set_active_adapter(fleet_model(), "run9")
