import pytest
import torch
from peft import PeftModel
from transformers import Qwen2ForCausalLM

from services.common import adapter_io
from services.config.schema import ActorConfig
from services.trainer.lora import adapter_state, lora_parameters, lora_spec, wrap_lora
from tests.fixtures.tiny import tiny_qwen2 as fixture_qwen2

HF_LINEAR = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


def tiny_qwen2(seed: int = 0) -> Qwen2ForCausalLM:
    return fixture_qwen2(seed, vocab_size=96, max_position_embeddings=128)


def test_adapter_keys_shapes_and_zero_b():
    actor = ActorConfig(path="tiny", lora_rank=4, lora_alpha=8.0)
    model = wrap_lora(tiny_qwen2(), actor)
    state = adapter_state(lora_parameters(model))
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
    assert spec.target_modules == HF_LINEAR
    assert (spec.rank, spec.alpha, spec.dtype, spec.base_model) == (4, 8.0, "float32", "tiny")


def test_base_stays_in_compute_dtype_adapter_is_fp32_and_leaves_in_serving_dtype():
    base = tiny_qwen2().to(torch.bfloat16)
    actor = ActorConfig(lora_rank=2, target_modules=["q_proj", "v_proj"], dtype="bfloat16")
    model = wrap_lora(base, actor)
    assert {p.dtype for p in model.parameters() if not p.requires_grad} == {torch.bfloat16}
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    spec = lora_spec(model, actor)
    assert spec.target_modules == ["q_proj", "v_proj"] and spec.dtype == "bfloat16"
    assert {t.dtype for t in adapter_state(lora_parameters(model), torch.bfloat16).values()} == {torch.bfloat16}
    assert {t.dtype for t in adapter_state(lora_parameters(model)).values()} == {torch.float32}


def test_saved_adapter_reloads_with_peft_and_gives_same_logits(tmp_path):
    actor = ActorConfig(path="tiny", lora_rank=4, lora_alpha=8.0)
    model = wrap_lora(tiny_qwen2(), actor)
    with torch.no_grad():  # make B non-zero so the adapter changes the output
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    weights = adapter_io.to_bytes(adapter_state(lora_parameters(model)))
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


# --- pure trainer logic next to LoRA: batching plan, checkpoint files, resume decisions ----


def _sample(n_prompt: int, n_completion: int, adv: float = 1.0):
    from services.trainer.batching import Sample

    return Sample(
        input_ids=list(range(1, n_prompt + n_completion + 1)),
        prompt_len=n_prompt,
        behave_logprobs=[-1.0] * n_completion,
        versions=[0] * n_completion,
        advantage=adv,
    )


def test_micro_batch_plan_is_equal_length_on_every_rank():
    from services.trainer.batching import collate, plan_micro_batches, split_minibatches

    (mb,) = split_minibatches([_sample(3, 5), _sample(2, 2), _sample(4, 1)], 1)
    assert sum(s.token_weight * s.completion_len for s in mb) == pytest.approx(1.0)
    plans = [plan_micro_batches(mb, r, 2, max_tokens=8) for r in range(2)]
    assert len(plans[0]) == len(plans[1]) == 2  # rank 0: 8 + 5 tokens; rank 1: one of 4
    assert plans[1][1][0].token_weight == 0.0  # filler keeps rank 1 in the collectives
    batch = collate(plans[0][0])
    # targets start at the first completion token of the shortest prompt (3 here)
    assert batch.targets.shape == (1, 5) and batch.loss_weights.count_nonzero() == 5
    assert batch.logits_to_keep == 6


def test_checkpoint_round_trip_and_prune(tmp_path):
    from services.trainer import checkpoint

    weights = adapter_io.to_bytes({"base_model.model.x.lora_A.weight": torch.ones(2, 2)})
    for step in (1, 2, 3):
        checkpoint.save(
            tmp_path,
            checkpoint.Checkpoint(
                step=step,
                version=step,
                adapter_bytes=weights,
                optimizer={"state": {}, "k": step},
                rng=checkpoint.rng_state(),
                trained_ids=[f"t{step}"],
            ),
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002", "step-00000003"]
    (tmp_path / ".tmp-step-00000004-1").mkdir()  # a crash mid-save leaves no usable state
    latest = checkpoint.load_latest(tmp_path)
    assert (latest.step, latest.version, latest.trained_ids) == (3, 3, ["t3"])
    assert latest.adapter_bytes == weights and latest.optimizer["k"] == 3
    (tmp_path / "step-00000003" / adapter_io.WEIGHTS_NAME).write_bytes(b"damaged")
    with pytest.raises(RuntimeError, match="sha256"):
        checkpoint.load_latest(tmp_path)
    assert checkpoint.load_latest(tmp_path / "missing") is None


def test_resume_plan():
    from services.trainer import checkpoint
    from services.trainer.resume import resume_plan

    ck = checkpoint.Checkpoint(step=3, version=3, adapter_bytes=b"", optimizer={})
    assert resume_plan(None, None) == (0, False)  # fresh: announce v0
    assert resume_plan(ck, 2) == (3, True)  # crash between checkpoint and upload: re-announce
    assert resume_plan(ck, 3) == (3, True)  # crash after upload: idempotent re-announce
    assert resume_plan(ck, 5) == (6, False)  # v4, v5 are lost weights: never reuse their numbers


def test_adapter_key_parsing():
    from services.trainer.publish import adapter_key, parse_adapter_version

    assert adapter_key("run1", 7) == "run1/adapters/v7/adapter_model.safetensors"
    assert parse_adapter_version("run1", adapter_key("run1", 12)) == 12
    assert parse_adapter_version("run1", "run1/adapters/v1/adapter_config.json") is None
    assert parse_adapter_version("run1", "run10/adapters/v1/adapter_model.safetensors") is None


def test_adapter_state_into_the_send_set_writes_what_it_would_return_and_ignores_a_foreign_layout():
    """The XCCL fast path (`into` = the sender's free send set) against the reference path
    (new tensors): the same values, cast the same way, in the very tensors handed in."""
    from services.common import xccl

    actor = ActorConfig(lora_rank=2, target_modules=["q_proj", "v_proj"], dtype="bfloat16")
    model = wrap_lora(tiny_qwen2(), actor)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.5)
    reference = adapter_state(lora_parameters(model), torch.bfloat16)
    plan = xccl.plan_buckets(xccl.manifest_of(reference), 256)  # several buckets, gaps between
    into = xccl.unpack(plan, xccl.alloc_buckets(plan))
    got = adapter_state(lora_parameters(model), torch.bfloat16, into=into)
    assert list(got) == list(reference)
    assert all(got[k] is into[k] for k in got)  # written in place, nothing new
    assert all(torch.equal(got[k], reference[k]) for k in reference)

    wrong = dict(into)
    wrong.popitem()  # one tensor short: not this adapter's layout
    before = {k: t.clone() for k, t in wrong.items()}
    fresh = adapter_state(lora_parameters(model), torch.bfloat16, into=wrong)
    assert all(fresh[k] is not wrong.get(k) for k in fresh)
    assert all(torch.equal(fresh[k], reference[k]) for k in reference)
    assert all(torch.equal(wrong[k], before[k]) for k in wrong)
    fp32 = adapter_state(lora_parameters(model), into=into)  # the masters' dtype is not the set's: ignored
    assert {t.dtype for t in fp32.values()} == {torch.float32}


def test_disable_dropout_makes_a_training_forward_deterministic():
    from services.trainer.startup import disable_dropout

    # a base whose config has attention dropout, as some models ship
    base = fixture_qwen2(0, vocab_size=96, max_position_embeddings=128, attention_dropout=0.5)
    model = wrap_lora(base, ActorConfig(path="tiny", lora_rank=4)).train()
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(1)
    one = model(input_ids=ids).logits
    assert not torch.equal(one, model(input_ids=ids).logits)  # dropout is on in train mode
    assert disable_dropout(model) > 0
    assert torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)
    assert disable_dropout(model) == 0
