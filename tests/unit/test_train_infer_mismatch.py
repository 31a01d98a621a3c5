"""Issue 28 item 3: the train/inference mismatch (`services.trainer.mismatch`), its threshold in
the FSDP2 step, and the trainer's canary (`FSDP2Engine.canary`)."""

from __future__ import annotations

import math
import time

import msgspec
import pytest
import torch
from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

from proto.messages import Completion, MismatchFigures, Trajectory
from services.common import adapter_io
from services.config.loader import ConfigError, load_config
from services.config.schema import LorabusConfig, PPOConfig
from services.rollout.canary import gap
from services.rollout.engines.base import GenResult
from services.trainer import batching, mismatch
from services.trainer import canary as trainer_canary
from services.trainer.engines.fsdp2 import FSDP2Engine
from tests.fixtures.tiny import tiny_qwen2

TEMPERATURE = 0.8


def test_k3_is_zero_on_agreement_positive_otherwise_and_finite():
    trainer = torch.tensor([-1.0, -1.0, -0.5, -3.0, 0.0])
    behave = torch.tensor([-1.0, -1.1, -2.5, -0.5, -400.0])
    kl, ab = mismatch.token_terms(trainer, behave)
    assert kl[0] == 0 and ab[0] == 0
    assert (kl[1:] > 0).all() and torch.isfinite(kl).all()
    r = 0.1
    assert kl[1].item() == pytest.approx(math.exp(r) - 1 - r) and kl[1].item() == pytest.approx(r * r / 2, rel=0.05)
    assert ab.tolist()[:4] == pytest.approx([0.0, 0.1, 2.0, 2.5])
    assert ab[4].item() == mismatch.R_CLAMP  # clamped: a figure, not an inf


def test_k3_mean_over_tokens_sampled_from_the_behaviour_policy_estimates_the_kl():
    g = torch.Generator().manual_seed(0)
    behave = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    trainer = torch.tensor([0.4, 0.35, 0.2, 0.05]).log()
    exact = float((behave.exp() * (behave - trainer)).sum())  # KL(behave || trainer)
    tokens = torch.multinomial(behave.exp(), 200_000, replacement=True, generator=g)
    kl, _ = mismatch.token_terms(trainer[tokens], behave[tokens])
    assert float(kl.mean()) == pytest.approx(exact, rel=0.03)


def sample(tokens: list[int], behave: list[float], versions: list[int], group: int, weight: float = 1.0):
    return batching.Sample(input_ids=[3, 4] + tokens, prompt_len=2, behave_logprobs=behave, versions=versions,
                           advantage=0.0, token_weight=weight, group=group)  # fmt: skip


def test_tally_counts_weighed_tokens_per_group_and_splits_on_policy_from_older():
    samples = [
        sample([5, 6, 7], [-1.0, -1.0, -1.0], [4, 4, 4], group=0),
        sample([5, 6], [-2.0, -1.0], [3, 3], group=1),
        sample([5, 6], [-9.0, -9.0], [4, 4], group=1, weight=0.0),  # a filler row: never counted
    ]
    mb = batching.collate(samples)
    trainer = torch.full(mb.behave_logprobs.shape, -1.0)  # the trainer says -1 everywhere
    tally = mismatch.Tally.empty(2)
    tally.add(mb, trainer, head_version=4)
    k1 = math.e - 2  # r = 1
    assert tally.group_kl().tolist() == pytest.approx([0.0, k1 / 2])
    report = tally.report()
    assert report.estimator == "k3"
    assert report.on_policy == MismatchFigures(tokens=3, kl_mean=0.0, kl_max=0.0, abs_mean=0.0, abs_max=0.0)
    every = report.all_tokens
    assert (every.tokens, every.abs_max) == (5, 1.0)
    assert every.kl_mean == pytest.approx(k1 / 5) and every.kl_max == pytest.approx(k1)
    assert tally.beyond(None) == {}
    refused = tally.beyond(0.1)
    assert list(refused) == [1]
    assert refused[1].startswith(
        "train_infer_kl: mean per-token KL 0.3591 over 2 tokens exceeds actor.max_train_infer_kl 0.1"
    )


def test_a_batch_without_tokens_of_the_held_version_has_no_on_policy_figure():
    mb = batching.collate([sample([5], [-1.0], [1], group=0)])
    tally = mismatch.Tally.empty(1)
    tally.add(mb, torch.full(mb.behave_logprobs.shape, -1.0), head_version=2)
    assert tally.report().on_policy is None and tally.report().all_tokens.tokens == 1


@pytest.mark.parametrize("value", [0, -1e-3, "nan"])
def test_the_threshold_must_be_positive(tmp_path, value):
    path = tmp_path / "c.yaml"
    path.write_text(f"run: r\nactor:\n  path: tiny\n  max_train_infer_kl: {value}\n")
    with pytest.raises(ConfigError, match=r"actor.max_train_infer_kl: .*, a KL threshold must be > 0; set a posi"):
        load_config(path)


def engine_config(threshold: float | None = None, dtype: str = "float32") -> LorabusConfig:
    return msgspec.convert(
        {
            "run": "m",
            "total_train_steps": 10,
            "gconfig": {"n_samples": 2, "temperature": TEMPERATURE, "lora_name": "m"},
            "actor": {"path": "tiny", "device": "cpu", "dtype": dtype, "lora_rank": 4, "lora_alpha": 8.0,
                      "optimizer": {"lr": 0.05}, "max_train_infer_kl": threshold},
        },
        LorabusConfig,
    )  # fmt: skip


@torch.no_grad()
def trainer_logprobs(engine: FSDP2Engine, prompt: list[int], tokens: list[int]) -> list[float]:
    """What a replica serving the engine's current adapter would report, at the temperature."""
    engine.model.eval()
    logits = engine.model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    engine.model.train()
    lp = (logits / TEMPERATURE).log_softmax(-1)
    return lp.gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def batch(engine: FSDP2Engine, version: int, shift: dict[int, float]) -> list[Trajectory]:
    """Three groups whose behaviour logprobs are the engine's own, group i's moved by shift[i]."""
    g = torch.Generator().manual_seed(1)
    groups = []
    for i in range(3):
        prompt = [3, 4, 5 + i]
        completions = []
        for k in range(2):
            tokens = [int(t) for t in torch.randint(2, 90, (4,), generator=g)]
            lps = [lp - shift.get(i, 0.0) for lp in trainer_logprobs(engine, prompt, tokens)]
            completions.append(Completion(token_ids=tokens, logprobs=lps, versions=[version] * 4, reward=float(k)))
        groups.append(Trajectory(run="m", trajectory_id=f"t{i}", grant_id="g", replica="r", prompt_id="p",
                                 prompt_token_ids=prompt, completions=completions, started_at=time.time(),
                                 finished_at=time.time()))  # fmt: skip
    return groups


def adapter(engine: FSDP2Engine) -> dict[str, torch.Tensor]:
    return engine.adapter_state()


def test_the_step_reports_a_near_zero_gap_when_the_rollout_is_the_trainer():
    engine = FSDP2Engine(engine_config(), base=tiny_qwen2())
    stats = engine.train_step(batch(engine, 0, {}), head_version=0)
    m = stats.mismatch
    assert m is not None and m.on_policy is not None and m.refused_groups == 0
    assert m.on_policy.tokens == m.all_tokens.tokens == 24 == stats.tokens
    assert m.on_policy.kl_max < 1e-10 and m.on_policy.abs_max < 1e-5
    assert stats.group_kl == pytest.approx([0.0, 0.0, 0.0], abs=1e-10) and stats.refused == {}


def test_a_group_beyond_the_threshold_is_refused_and_never_trained():
    engine = FSDP2Engine(engine_config(threshold=0.05), base=tiny_qwen2())
    alone = FSDP2Engine(engine_config(), base=tiny_qwen2())  # the same start: seeded alike
    groups = batch(engine, 0, {1: 1.0})  # group t1's rollout reports logprobs 1 nat too low
    stats = engine.train_step(groups, head_version=0)
    assert list(stats.refused) == ["t1"] and "exceeds actor.max_train_infer_kl 0.05" in stats.refused["t1"]
    assert stats.groups == 2 and stats.mismatch.refused_groups == 1
    assert stats.group_kl[1] == pytest.approx(math.e - 2, rel=1e-4)
    # the whole batch's figure, refused group included: what arrived, not what was trained
    assert stats.mismatch.all_tokens.tokens == 24 and stats.mismatch.all_tokens.abs_max == pytest.approx(1.0, 1e-4)
    # what the step did is exactly a step on the two kept groups
    alone.train_step([groups[0], groups[2]], head_version=0)
    mine, theirs = adapter(engine), adapter(alone)
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_a_step_with_every_group_refused_makes_no_update():
    engine = FSDP2Engine(engine_config(threshold=0.05), base=tiny_qwen2())
    before = adapter(engine)
    stats = engine.train_step(batch(engine, 0, {0: 1.0, 1: -1.0, 2: 0.5}), head_version=0)
    assert stats.groups == 0 and sorted(stats.refused) == ["t0", "t1", "t2"] and engine.step == 0
    after = adapter(engine)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_fewer_completions_than_minibatches_after_a_refusal_still_train():
    cfg = engine_config(threshold=0.05)
    cfg.actor.ppo = PPOConfig(ppo_n_minibatches=6)
    engine = FSDP2Engine(cfg, base=tiny_qwen2())
    stats = engine.train_step(batch(engine, 0, {0: 1.0, 1: 1.0}), head_version=0)  # 2 completions kept
    assert stats.groups == 1 and engine.step == 1


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_trainers_canary_is_what_the_published_adapter_answers(dtype):
    engine = FSDP2Engine(engine_config(dtype=dtype), base=tiny_qwen2())
    engine.train_step(batch(engine, 0, {}), head_version=0)
    canary = engine.canary()
    assert canary.dtype == dtype and len(canary.sequences) == trainer_canary.N_PROMPTS
    assert engine.model.training, "the step's train mode is back after the canary"
    # the published tensors, applied by peft to a fresh base in the serving dtype
    published = engine.adapter_state()
    base = tiny_qwen2().to(adapter_io.DTYPES[dtype])
    peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=8.0, target_modules="all-linear")).eval()
    result = set_peft_model_state_dict(peft, published)
    assert not result.unexpected_keys
    prompts = [s.prompt_token_ids for s in canary.sequences]
    assert prompts == trainer_canary.prompts(engine.vocab_size, seed=engine.actor.seed)
    want = trainer_canary.reference(peft, prompts, dtype)
    if dtype == "float32":
        for got, ref in zip(canary.sequences, want.sequences):
            assert got.token_ids == ref.token_ids and got.logprobs == pytest.approx(ref.logprobs, abs=1e-5)
    # what a replica decides: in bf16 a near-tie may pick another token (then the rest is not compared)
    answers = [GenResult(token_ids=s.token_ids, logprobs=s.logprobs, finish_reason="length") for s in want.sequences]
    measured = gap(canary, answers)
    assert measured.passed, measured.describe(len(answers))


def test_the_batched_reference_equals_one_prompt_at_a_time():
    model = tiny_qwen2().eval()
    prompts = trainer_canary.prompts(96, seed=4)
    together = trainer_canary.reference(model, prompts, "float32")
    for prompt, seq in zip(prompts, together.sequences):
        alone = trainer_canary.reference(model, [prompt], "float32").sequences[0]
        assert alone.token_ids == seq.token_ids and alone.logprobs == pytest.approx(seq.logprobs, abs=1e-5)
