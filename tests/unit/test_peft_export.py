"""Exported PEFT directories load with `PeftModel.from_pretrained` and reproduce the model that
produced the adapter: the hf-peft path (standardised keys) and the megatron-bridge path
(fused tensors converted on export), on tiny random Qwen2/Qwen3 models."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from proto.messages import LoraSpec
from services.common import adapter_io
from services.common.lora_targets import HF_LINEAR
from services.common.megatron_to_hf import ModelShape
from services.config.schema import StoreConfig
from services.exporter.peft_dir import (
    existing_sha256,
    load_model_shape,
    peft_files,
    version_uri,
    write_export,
)

TARGETS = list(HF_LINEAR)
RANK, ALPHA = 4, 8.0
SMALL = dict(
    vocab_size=80,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def no_shape() -> ModelShape:
    raise AssertionError("the hf-peft layout must not need the model shape")


def lora_model(base):
    model = get_peft_model(
        copy.deepcopy(base),
        LoraConfig(
            r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM"
        ),
    )
    return model.eval()


def randomize_lora(model, seed: int) -> None:
    """A stand-in for a training step: every A and B gets new values (B non-zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def lora_tensors(model, dtype=torch.float32) -> dict[str, torch.Tensor]:
    return {adapter_io.standardize_key(n): p.detach().to(dtype) for n, p in model.named_parameters() if "lora_" in n}


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.float()


@pytest.fixture(scope="module")
def qwen2():
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(**SMALL)).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hf_peft_versions_round_trip(tmp_path, qwen2, dtype):
    base = copy.deepcopy(qwen2).to(dtype)
    source = lora_model(base)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(5))
    export_uri = f"file://{tmp_path}/export"
    spec = LoraSpec(
        rank=RANK, alpha=ALPHA, target_modules=TARGETS, dtype=adapter_io.dtype_name(dtype), base_model="tiny-qwen2"
    )
    previous = None
    for version in range(3):
        randomize_lora(source, seed=version)
        files = peft_files(adapter_io.to_bytes(lora_tensors(source, dtype)), "hf-peft", spec, no_shape)
        assert write_export(export_uri, version, files, StoreConfig()) == f"file://{tmp_path}/export/v{version}"
        assert existing_sha256(export_uri, version, StoreConfig()) == files.sha256

        loaded = PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "export" / f"v{version}").eval()
        got, want = logits(loaded, ids), logits(source, ids)
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        else:  # peft upcasts the loaded bf16 adapter to fp32; the source's was fp32 all along
            torch.testing.assert_close(got, want, rtol=0.05, atol=0.05)
        assert (got - logits(base, ids)).abs().max() > 0.05  # the adapter matters
        if previous is not None:
            assert (got - previous).abs().max() > 0.05  # each version is its own adapter
        previous = got
    config = json.loads((tmp_path / "export" / "v2" / adapter_io.CONFIG_NAME).read_text())
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (RANK, ALPHA, sorted(TARGETS))


def test_standard_bytes_pass_through_and_default_keys_are_standardised(qwen2):
    source = lora_model(qwen2)
    randomize_lora(source, seed=3)
    spec = LoraSpec(rank=RANK, alpha=ALPHA, target_modules=TARGETS, base_model="tiny")
    standard = adapter_io.to_bytes(lora_tensors(source))
    assert peft_files(standard, "hf-peft", spec, no_shape).weights is standard

    with_default = {n: p.detach() for n, p in source.named_parameters() if "lora_" in n}
    assert any(".default." in k for k in with_default)
    files = peft_files(adapter_io.to_bytes(with_default), "hf-peft", spec, no_shape)
    assert files.weights == standard


@pytest.mark.parametrize(
    ("data", "layout", "match"),
    [
        (b"not safetensors", "hf-peft", "payload: not a safetensors file"),
        (
            adapter_io.to_bytes({"model.layers.0.mlp.gate_proj.weight": torch.zeros(2, 2)}),
            "hf-peft",
            "is not a PEFT LoRA key",
        ),
        (adapter_io.to_bytes({"x.lora_A.weight": torch.zeros(2, 2)}), "onnx", "layout: 'onnx'"),
    ],
)
def test_bad_payloads(data, layout, match):
    spec = LoraSpec(rank=RANK, alpha=ALPHA, target_modules=TARGETS, base_model="tiny")
    with pytest.raises(ValueError, match=match):
        peft_files(data, layout, spec, no_shape)


def test_load_model_shape_names_the_field(tmp_path):
    with pytest.raises(ValueError, match="actor.path: .* has no config.json"):
        load_model_shape(str(tmp_path))
    Qwen3Config(**SMALL, head_dim=8).save_pretrained(tmp_path)
    assert load_model_shape(str(tmp_path)).head_dim == 8


# --- megatron-bridge payload -> PEFT dir, checked on a real Qwen3 ----------------------------


def fuse_qkv_rows(q, k, v, groups: int, q_per_group: int, head_dim: int):
    rows = []
    for g in range(groups):
        rows += [
            q[g * q_per_group * head_dim : (g + 1) * q_per_group * head_dim],
            k[g * head_dim : (g + 1) * head_dim],
            v[g * head_dim : (g + 1) * head_dim],
        ]
    return torch.cat(rows)


def test_megatron_payload_exports_to_an_equivalent_peft_dir(tmp_path):
    torch.manual_seed(0)
    cfg = Qwen3Config(**SMALL, head_dim=8)
    cfg.save_pretrained(tmp_path / "base")
    base = Qwen3ForCausalLM(cfg).eval()
    source = lora_model(base)
    randomize_lora(source, seed=11)
    # Megatron has one A per fused layer: make q/k/v (and gate/up) share theirs, as training would.
    params = dict(source.named_parameters())
    key = "base_model.model.model.layers.{}.{}.lora_{}.default.weight"
    with torch.no_grad():
        for layer in range(2):
            for first, others in (
                ("self_attn.q_proj", ("self_attn.k_proj", "self_attn.v_proj")),
                ("mlp.gate_proj", ("mlp.up_proj",)),
            ):
                for other in others:
                    params[key.format(layer, other, "A")].copy_(params[key.format(layer, first, "A")])

    def p(layer, module, which):
        return params[key.format(layer, module, which)].detach()

    state = {}
    for layer in range(2):
        d = f"decoder.layers.{layer}"
        state[f"{d}.self_attention.linear_qkv.adapter.linear_in.weight"] = p(layer, "self_attn.q_proj", "A")
        state[f"{d}.self_attention.linear_qkv.adapter.linear_out.weight"] = fuse_qkv_rows(
            p(layer, "self_attn.q_proj", "B"),
            p(layer, "self_attn.k_proj", "B"),
            p(layer, "self_attn.v_proj", "B"),
            groups=2,
            q_per_group=2,
            head_dim=8,
        )
        state[f"{d}.self_attention.linear_proj.adapter.linear_in.weight"] = p(layer, "self_attn.o_proj", "A")
        state[f"{d}.self_attention.linear_proj.adapter.linear_out.weight"] = p(layer, "self_attn.o_proj", "B")
        state[f"{d}.mlp.linear_fc1.adapter.linear_in.weight"] = p(layer, "mlp.gate_proj", "A")
        state[f"{d}.mlp.linear_fc1.adapter.linear_out.weight"] = torch.cat(
            [p(layer, "mlp.gate_proj", "B"), p(layer, "mlp.up_proj", "B")]
        )
        state[f"{d}.mlp.linear_fc2.adapter.linear_in.weight"] = p(layer, "mlp.down_proj", "A")
        state[f"{d}.mlp.linear_fc2.adapter.linear_out.weight"] = p(layer, "mlp.down_proj", "B")

    spec = LoraSpec(
        rank=RANK,
        alpha=ALPHA,
        base_model="tiny-qwen3",
        target_modules=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
    )
    files = peft_files(
        adapter_io.to_bytes(state), "megatron-bridge", spec, lambda: load_model_shape(str(tmp_path / "base"))
    )
    assert sorted(files.lora.target_modules) == sorted(TARGETS)
    uri = f"file://{tmp_path}/export"
    write_export(uri, 7, files, StoreConfig())
    assert version_uri(uri, 7) == f"file://{tmp_path}/export/v7"

    loaded = PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "export" / "v7").eval()
    ids = torch.randint(0, SMALL["vocab_size"], (2, 9))
    torch.testing.assert_close(logits(loaded, ids), logits(source, ids), rtol=0, atol=1e-5)
