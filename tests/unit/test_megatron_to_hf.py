"""Megatron-bridge LoRA -> HF PEFT conversion, checked by the math it must preserve.

Each test builds random HF-layout weights, fuses them into Megatron's layout here (independently
of the converter: per-group concatenation, not the converter's view/split), applies a random
LoRA on the fused layer, converts that LoRA, applies the converted LoRA on the HF layout, and
requires the same outputs. Shapes are the real ones of Qwen3-0.6B and Qwen3-30B-A3B.
"""

from __future__ import annotations

import copy

import pytest
import torch

from proto.messages import LoraSpec
from services.common import adapter_io
from services.common.megatron_to_hf import (
    ConversionError,
    ModelShape,
    convert,
    merge_ep_shards,
    target_modules_of,
)

QWEN3_0_6B = ModelShape(
    num_layers=2,
    hidden=1024,
    num_attention_heads=16,
    num_query_groups=8,
    head_dim=128,
    ffn_hidden=3072,
)
QWEN3_30B_A3B = ModelShape(
    num_layers=1,
    hidden=2048,
    num_attention_heads=32,
    num_query_groups=4,
    head_dim=128,
    ffn_hidden=6144,
    num_experts=128,
    moe_ffn_hidden=768,
)
RANK = 8
SCALE = 2.0  # alpha / r


def lora_apply(x, w, a, b):
    return x @ (w + SCALE * b @ a).T


def fuse_qkv(q, k, v, shape: ModelShape):
    """Megatron's linear_qkv order along dim 0: per KV group, its query heads, its key, its value."""
    hd, qpg = shape.head_dim, shape.q_per_group
    rows = []
    for g in range(shape.num_query_groups):
        rows += [q[g * qpg * hd : (g + 1) * qpg * hd], k[g * hd : (g + 1) * hd], v[g * hd : (g + 1) * hd]]
    return torch.cat(rows, dim=0)


def hf_key(module: str, which: str) -> str:
    return adapter_io.peft_key(module, which)


def rand(*shape):
    return torch.randn(*shape) / shape[-1] ** 0.5


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def test_dense_qwen3_0_6b_outputs_match():
    s = QWEN3_0_6B
    q_out, kv_out = s.num_attention_heads * s.head_dim, s.num_query_groups * s.head_dim
    x = rand(5, s.hidden)
    state, checks = {}, []
    for layer in range(s.num_layers):
        p = f"decoder.layers.{layer}"
        wq, wk, wv = rand(q_out, s.hidden), rand(kv_out, s.hidden), rand(kv_out, s.hidden)
        wo = rand(s.hidden, q_out)
        wg, wu, wd = rand(s.ffn_hidden, s.hidden), rand(s.ffn_hidden, s.hidden), rand(s.hidden, s.ffn_hidden)
        fused = {
            "self_attention.linear_qkv": fuse_qkv(wq, wk, wv, s),
            "self_attention.linear_proj": wo,
            "mlp.linear_fc1": torch.cat([wg, wu]),
            "mlp.linear_fc2": wd,
        }
        for module, w in fused.items():
            state[f"{p}.{module}.adapter.linear_in.weight"] = rand(RANK, w.shape[1])
            state[f"{p}.{module}.adapter.linear_out.weight"] = rand(w.shape[0], RANK)
        checks.append(
            (layer, fused, dict(q_proj=wq, k_proj=wk, v_proj=wv, o_proj=wo, gate_proj=wg, up_proj=wu, down_proj=wd))
        )

    out = convert(state, s)
    assert len(out) == s.num_layers * 7 * 2
    assert target_modules_of(out) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )

    for layer, fused, hf in checks:
        p = f"decoder.layers.{layer}"

        def megatron(module, inp):
            return lora_apply(
                inp,
                fused[module],
                state[f"{p}.{module}.adapter.linear_in.weight"],
                state[f"{p}.{module}.adapter.linear_out.weight"],
            )

        def peft(module_path, inp):
            name = module_path.rsplit(".", 1)[1]
            return lora_apply(inp, hf[name], out[hf_key(module_path, "A")], out[hf_key(module_path, "B")])

        m = f"model.layers.{layer}"
        yq, yk, yv = (peft(f"{m}.self_attn.{n}", x) for n in ("q_proj", "k_proj", "v_proj"))
        expected = megatron("self_attention.linear_qkv", x)
        torch.testing.assert_close(fuse_qkv(yq.T, yk.T, yv.T, s).T, expected, rtol=1e-4, atol=1e-4)
        # the split must not be the identity on a wrong layout: q alone differs from the fused head
        assert not torch.allclose(yq, expected[:, : yq.shape[1]], atol=1e-3)

        h = rand(5, q_out)
        torch.testing.assert_close(
            peft(f"{m}.self_attn.o_proj", h), megatron("self_attention.linear_proj", h), rtol=1e-4, atol=1e-4
        )
        yg, yu = peft(f"{m}.mlp.gate_proj", x), peft(f"{m}.mlp.up_proj", x)
        torch.testing.assert_close(torch.cat([yg, yu], dim=1), megatron("mlp.linear_fc1", x), rtol=1e-4, atol=1e-4)
        f = rand(5, s.ffn_hidden)
        torch.testing.assert_close(peft(f"{m}.mlp.down_proj", f), megatron("mlp.linear_fc2", f), rtol=1e-4, atol=1e-4)


def moe_expert_weights(shape, experts):
    return {
        e: (
            rand(shape.moe_ffn_hidden, shape.hidden),
            rand(shape.moe_ffn_hidden, shape.hidden),
            rand(shape.hidden, shape.moe_ffn_hidden),
        )
        for e in experts
    }


def check_expert(out, e, weights, a1, b1, a2, b2, shape):
    """Expert e's fused Megatron fc1/fc2 with LoRA (a1, b1, a2, b2) == converted per-expert LoRA."""
    wg, wu, wd = weights
    x, f = rand(3, shape.hidden), rand(3, shape.moe_ffn_hidden)
    m = f"model.layers.0.mlp.experts.{e}"
    yg = lora_apply(x, wg, out[hf_key(f"{m}.gate_proj", "A")], out[hf_key(f"{m}.gate_proj", "B")])
    yu = lora_apply(x, wu, out[hf_key(f"{m}.up_proj", "A")], out[hf_key(f"{m}.up_proj", "B")])
    yd = lora_apply(f, wd, out[hf_key(f"{m}.down_proj", "A")], out[hf_key(f"{m}.down_proj", "B")])
    torch.testing.assert_close(torch.cat([yg, yu], 1), lora_apply(x, torch.cat([wg, wu]), a1, b1), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(yd, lora_apply(f, wd, a2, b2), rtol=1e-4, atol=1e-4)


SAMPLED = (0, 1, 63, 64, 127)


def test_moe_grouped_adapter_is_replicated_to_every_expert():
    s = QWEN3_30B_A3B
    p = "decoder.layers.0.mlp.experts"
    a1, b1 = rand(RANK, s.hidden), rand(2 * s.moe_ffn_hidden, RANK)
    a2, b2 = rand(RANK, s.moe_ffn_hidden), rand(s.hidden, RANK)
    state = {
        f"{p}.linear_fc1.adapter.linear_in.weight": a1,
        f"{p}.linear_fc1.adapter.linear_out.weight": b1,
        f"{p}.linear_fc2.adapter.linear_in.weight": a2,
        f"{p}.linear_fc2.adapter.linear_out.weight": b2,
    }
    out = convert(state, s)
    assert len(out) == s.num_experts * 3 * 2
    assert target_modules_of(out) == ["down_proj", "gate_proj", "up_proj"]
    weights = moe_expert_weights(s, SAMPLED)
    for e in SAMPLED:
        check_expert(out, e, weights[e], a1, b1, a2, b2, s)
    # every expert got its own storage (safetensors refuses shared tensors)
    adapter_io.from_bytes(adapter_io.to_bytes(out))


def per_expert_shard(shape, layer=0):
    p = f"decoder.layers.{layer}.mlp.experts"
    shard, loras = {}, {}
    for idx in range(shape.experts_per_rank):
        a1, b1 = rand(RANK, shape.hidden), rand(2 * shape.moe_ffn_hidden, RANK)
        a2, b2 = rand(RANK, shape.moe_ffn_hidden), rand(shape.hidden, RANK)
        shard[f"{p}.linear_fc1.adapter.linear_in.weight{idx}"] = a1
        shard[f"{p}.linear_fc1.adapter.linear_out.weight{idx}"] = b1
        shard[f"{p}.linear_fc2.adapter.linear_in.weight{idx}"] = a2
        shard[f"{p}.linear_fc2.adapter.linear_out.weight{idx}"] = b2
        loras[idx] = (a1, b1, a2, b2)
    return shard, loras


def test_moe_per_expert_single_rank():
    s = QWEN3_30B_A3B
    shard, loras = per_expert_shard(s)
    out = convert(shard, s)
    assert len(out) == s.num_experts * 6
    weights = moe_expert_weights(s, SAMPLED)
    for e in SAMPLED:
        check_expert(out, e, weights[e], *loras[e], s)


def test_moe_sequential_mlp_names_are_the_per_expert_scheme():
    """The local layer spec (no Transformer Engine) builds SequentialMLP experts, whose LoRA
    tensors are named `local_experts.<idx>.linear_fc1.adapter...` instead of `...weight<idx>`."""
    s = ModelShape(
        **{**{f: getattr(QWEN3_30B_A3B, f) for f in QWEN3_30B_A3B.__struct_fields__}, "ep_size": 2, "ep_rank": 1}
    )
    shard, _ = per_expert_shard(s)
    renamed = {}
    for name, t in shard.items():
        stem, idx = name.rstrip("0123456789"), name[len(name.rstrip("0123456789")) :]
        head, tail = stem.split(".mlp.experts.")
        renamed[f"{head}.mlp.experts.local_experts.{idx}.{tail}"] = t
    out = convert(renamed, s)
    expected = convert(shard, s)
    assert out.keys() == expected.keys() and all(torch.equal(out[k], expected[k]) for k in out)
    assert min(int(k.split(".experts.")[1].split(".")[0]) for k in out) == s.experts_per_rank  # rank 1's
    bad = {k + ("0" if k.endswith("weight") else ""): v for k, v in renamed.items()}
    with pytest.raises(ConversionError, match="SequentialMLP"):
        convert(bad, s)


def test_moe_per_expert_two_ep_ranks_merged():
    s = ModelShape(**{**{f: getattr(QWEN3_30B_A3B, f) for f in QWEN3_30B_A3B.__struct_fields__}, "ep_size": 2})
    half = s.num_experts // 2
    dense = {
        "decoder.layers.0.self_attention.linear_proj.adapter.linear_in.weight": rand(RANK, 4096),
        "decoder.layers.0.self_attention.linear_proj.adapter.linear_out.weight": rand(2048, RANK),
    }
    shard0, loras0 = per_expert_shard(s)
    shard1, loras1 = per_expert_shard(s)
    out = merge_ep_shards([{**shard0, **dense}, {**shard1, **dense}], s)
    assert len(out) == s.num_experts * 6 + 2
    weights = moe_expert_weights(s, SAMPLED)
    for e in SAMPLED:
        loras = loras0[e] if e < half else loras1[e - half]  # global = idx + rank * E / ep
        check_expert(out, e, weights[e], *loras, s)
    # rank 1's local expert 0 is global expert 64, not 0
    assert not torch.equal(
        out[hf_key("model.layers.0.mlp.experts.0.down_proj", "B")],
        out[hf_key("model.layers.0.mlp.experts.64.down_proj", "B")],
    )

    # a replicated (non-expert) tensor that differs between ranks is a broken gather
    bad = {**shard1, **dense, "decoder.layers.0.self_attention.linear_proj.adapter.linear_in.weight": rand(RANK, 4096)}
    with pytest.raises(ConversionError, match="linear_proj|o_proj"):
        merge_ep_shards([{**shard0, **dense}, bad], s)
    with pytest.raises(ConversionError, match="ep_size is 2"):
        merge_ep_shards([shard0], s)


def test_grouped_with_ep_covers_only_the_ranks_experts():
    s = ModelShape(
        **{**{f: getattr(QWEN3_30B_A3B, f) for f in QWEN3_30B_A3B.__struct_fields__}, "ep_size": 2, "ep_rank": 1}
    )
    p = "decoder.layers.0.mlp.experts.linear_fc2.adapter"
    out = convert({f"{p}.linear_in.weight": rand(RANK, 768), f"{p}.linear_out.weight": rand(2048, RANK)}, s)
    experts = sorted({int(k.split(".experts.")[1].split(".")[0]) for k in out})
    assert experts == list(range(64, 128))


def test_module_wrapper_prefix_is_accepted():
    s = QWEN3_0_6B
    p = "module.module.decoder.layers.1.self_attention.linear_proj.adapter"
    out = convert({f"{p}.linear_in.weight": rand(RANK, 2048), f"{p}.linear_out.weight": rand(1024, RANK)}, s)
    assert sorted(out) == [
        hf_key("model.layers.1.self_attn.o_proj", "A"),
        hf_key("model.layers.1.self_attn.o_proj", "B"),
    ]


@pytest.mark.parametrize(
    ("state", "match"),
    [
        ({"decoder.layers.0.mlp.router.weight": torch.zeros(4, 4)}, "mlp.router.weight: not a megatron"),
        ({"decoder.layers.0.mlp.linear_fc2.adapter.linear_in.weight": torch.zeros(RANK, 3072)}, "partner is missing"),
        (
            {
                "decoder.layers.0.mlp.linear_fc2.adapter.linear_in.weight": torch.zeros(RANK, 3000),
                "decoder.layers.0.mlp.linear_fc2.adapter.linear_out.weight": torch.zeros(1024, RANK),
            },
            r"linear_fc2.adapter.linear_in.weight: shape \[8, 3000\] does not match \[r, 3072\]",
        ),
        (
            {
                "decoder.layers.5.mlp.linear_fc2.adapter.linear_in.weight": torch.zeros(RANK, 3072),
                "decoder.layers.5.mlp.linear_fc2.adapter.linear_out.weight": torch.zeros(1024, RANK),
            },
            "layer 5 is beyond",
        ),
        (
            {
                "decoder.layers.0.mlp.experts.linear_fc2.adapter.linear_in.weight": torch.zeros(RANK, 3072),
                "decoder.layers.0.mlp.experts.linear_fc2.adapter.linear_out.weight": torch.zeros(1024, RANK),
            },
            "num_experts 0",
        ),
        (
            {
                "decoder.layers.0.self_attention.linear_qkv.adapter.linear_in.weight": torch.zeros(RANK, 1024),
                "decoder.layers.0.self_attention.linear_qkv.adapter.linear_out.weight": torch.zeros(3072, RANK),
            },
            r"linear_out.weight: shape \[3072, 8\] does not match \[4096, r\]",
        ),
    ],
)
def test_bad_inputs_name_the_tensor(state, match):
    with pytest.raises(ConversionError, match=match):
        convert(state, QWEN3_0_6B)


def test_expert_index_beyond_the_rank_is_an_error():
    s = ModelShape(**{**{f: getattr(QWEN3_30B_A3B, f) for f in QWEN3_30B_A3B.__struct_fields__}, "ep_size": 2})
    p = "decoder.layers.0.mlp.experts.linear_fc2.adapter"
    with pytest.raises(ConversionError, match="local expert 64 is beyond"):
        convert({f"{p}.linear_in.weight64": rand(RANK, 768), f"{p}.linear_out.weight64": rand(2048, RANK)}, s)


def test_from_hf_config():
    from transformers import Qwen2Config, Qwen3Config, Qwen3MoeConfig

    dense = Qwen3Config(
        hidden_size=1024,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=3072,
    )
    assert ModelShape.from_hf_config(dense) == ModelShape(
        num_layers=28, hidden=1024, num_attention_heads=16, num_query_groups=8, head_dim=128, ffn_hidden=3072
    )
    moe = Qwen3MoeConfig(
        hidden_size=2048,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        intermediate_size=6144,
        num_experts=128,
        moe_intermediate_size=768,
    )
    shape = ModelShape.from_hf_config(moe.to_dict(), ep_size=4, ep_rank=3)
    assert (shape.num_experts, shape.moe_ffn_hidden, shape.experts_per_rank, shape.ep_rank) == (128, 768, 32, 3)
    qwen2 = Qwen2Config(hidden_size=896, num_attention_heads=14, num_key_value_heads=2)
    assert ModelShape.from_hf_config(qwen2).head_dim == 64
    with pytest.raises(ValueError, match="model_type: 'llama'"):
        ModelShape.from_hf_config({"model_type": "llama"})
    with pytest.raises(ValueError, match="ep_size: 3 does not divide"):
        ModelShape.from_hf_config(moe, ep_size=3)


# --- the exported MoE adapter on a real transformers 5 Qwen3-MoE model ----------------------


def tiny_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    return cfg, Qwen3MoeForCausalLM(cfg).eval()


def merged_reference(base, tensors, scale):
    """The base model with W += scale * B @ A applied by hand, in transformers 5's fused layout."""
    model = copy.deepcopy(base)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key in tensors:
            module, which = adapter_io.parse_peft_key(key)
            if which != "A":
                continue
            delta = scale * tensors[adapter_io.peft_key(module, "B")] @ tensors[key]
            parent, name = module.rsplit(".", 1)
            if ".mlp.experts." in module:
                experts, e = parent.rsplit(".", 1)
                e = int(e)
                if name == "down_proj":
                    params[f"{experts}.down_proj"][e] += delta
                else:
                    rows = delta.shape[0]
                    offset = 0 if name == "gate_proj" else rows
                    params[f"{experts}.gate_up_proj"][e, offset : offset + rows] += delta
            else:
                params[f"{module}.weight"] += delta
    return model


@pytest.mark.parametrize("scheme", ["grouped", "per-expert"])
def test_exported_moe_adapter_loads_with_peft(tmp_path, scheme):
    from peft import PeftModel

    torch.manual_seed(1)
    cfg, base = tiny_moe()
    # transformers 5.24 fuses experts into 3-D parameters: the module docstring relies on it
    assert dict(base.named_parameters())["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 32, 32)
    shape = ModelShape.from_hf_config(cfg)
    rank, alpha = 4, 8.0
    state = {}
    for layer in range(2):
        p = f"decoder.layers.{layer}"
        state[f"{p}.self_attention.linear_qkv.adapter.linear_in.weight"] = rand(rank, 32)
        state[f"{p}.self_attention.linear_qkv.adapter.linear_out.weight"] = rand((2 + 2) * 2 * 8, rank)
        state[f"{p}.self_attention.linear_proj.adapter.linear_in.weight"] = rand(rank, 32)
        state[f"{p}.self_attention.linear_proj.adapter.linear_out.weight"] = rand(32, rank)
        for e in range(4) if scheme == "per-expert" else [""]:
            state[f"{p}.mlp.experts.linear_fc1.adapter.linear_in.weight{e}"] = rand(rank, 32)
            state[f"{p}.mlp.experts.linear_fc1.adapter.linear_out.weight{e}"] = rand(2 * 16, rank)
            state[f"{p}.mlp.experts.linear_fc2.adapter.linear_in.weight{e}"] = rand(rank, 16)
            state[f"{p}.mlp.experts.linear_fc2.adapter.linear_out.weight{e}"] = rand(32, rank)
    tensors = convert(state, shape)
    lora = LoraSpec(rank=rank, alpha=alpha, target_modules=target_modules_of(tensors), base_model="tiny-moe")
    adapter_io.write_peft_dir(tmp_path, adapter_io.to_bytes(tensors), lora)

    reference = merged_reference(base, tensors, alpha / rank)
    model = PeftModel.from_pretrained(copy.deepcopy(base), tmp_path).eval()
    ids = torch.randint(0, 96, (2, 9))
    with torch.no_grad():
        got, want, plain = model(ids).logits, reference(ids).logits, base(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got - plain).abs().max() > 1e-2  # the adapter did something
