import pytest
import torch
from peft import PeftModel
from transformers import Qwen2Config, Qwen2ForCausalLM

from services.common import adapter_io
from services.common.config_schema import ActorConfig
from services.trainer.lora import adapter_state, lora_spec, resolve_target_modules, wrap_lora

ALL_LINEAR = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


def tiny_qwen2(seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                      max_position_embeddings=128)
    return Qwen2ForCausalLM(cfg).eval()


def test_all_linear_resolution():
    assert resolve_target_modules([]) == "all-linear"
    assert resolve_target_modules(["all-linear"]) == "all-linear"
    assert resolve_target_modules(["q_proj"]) == ["q_proj"]
    with pytest.raises(ValueError, match="actor.target_modules"):
        resolve_target_modules(["all-linear", "q_proj"])


def test_adapter_keys_shapes_and_zero_b():
    actor = ActorConfig(path="tiny", lora_rank=4, lora_alpha=8.0)
    model = wrap_lora(tiny_qwen2(), actor)
    state = adapter_state(model)
    # 2 layers x 7 linear modules x (A, B); lm_head is not all-linear
    assert len(state) == 2 * 7 * 2
    for key, t in state.items():
        module, which = adapter_io.parse_peft_key(key)
        assert ".default" not in key and "lm_head" not in module
        if which == "B":
            assert t.shape[1] == 4 and torch.count_nonzero(t) == 0
        else:
            assert t.shape[0] == 4
    q_a = state["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    k_b = state["base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"]
    assert q_a.shape == (4, 32) and k_b.shape == (16, 4)  # kv: 2 heads x head_dim 8
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(trainable) == len(state)
    spec = lora_spec(model, actor)
    assert spec.target_modules == ALL_LINEAR
    assert (spec.rank, spec.alpha, spec.dtype, spec.base_model) == (4, 8.0, "float32", "tiny")


def test_base_stays_in_compute_dtype():
    base = tiny_qwen2().to(torch.bfloat16)
    model = wrap_lora(base, ActorConfig(lora_rank=2, target_modules=["q_proj", "v_proj"]))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert lora_spec(model, ActorConfig(lora_rank=2)).target_modules == ["q_proj", "v_proj"]


def test_saved_adapter_reloads_with_peft_and_gives_same_logits(tmp_path):
    actor = ActorConfig(path="tiny", lora_rank=4, lora_alpha=8.0)
    model = wrap_lora(tiny_qwen2(), actor)
    with torch.no_grad():  # make B non-zero so the adapter changes the output
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    weights = adapter_io.to_bytes(adapter_state(model))
    adapter_io.write_peft_dir(tmp_path, weights, lora_spec(model, actor))

    ids = torch.tensor([[1, 5, 9, 17, 33, 2]])
    reloaded = PeftModel.from_pretrained(tiny_qwen2(), tmp_path).eval()
    with torch.no_grad():
        want = model(input_ids=ids).logits
        got = reloaded(input_ids=ids).logits
        base = tiny_qwen2()(input_ids=ids).logits
    assert not torch.allclose(want, base, atol=1e-3)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_unmatched_target_modules_name_the_field():
    with pytest.raises(ValueError, match="actor.target_modules"):
        wrap_lora(tiny_qwen2(), ActorConfig(lora_rank=2, target_modules=["nonexistent_proj"]))
