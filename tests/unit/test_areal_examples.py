"""AReaL 1.0.4's own example files for its PPO variants (examples/math, copied unchanged under
tests/fixtures/areal/): each translates with no problem, what it sets beyond GRPO becomes the
native field that does the same, and it loads as a LoRA run once AReaL's own LoRA keys are given
on the command line (these files train full weights, which lorabus never does, and say so by
name). The variants' numbers are checked against AReaL's functions in test_areal_reference.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest
from omegaconf import OmegaConf

from services.config import areal
from services.config.loader import ConfigError, load_config

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "areal"
LORA = ["actor.use_lora=true", "rollout.use_lora=true", "actor.lora_rank=16"]
"""AReaL's own keys, as its launcher takes them: the full-weight examples as LoRA runs"""


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setenv(areal.REPORTED_ENV, "1")


def _translated(name: str) -> areal.Translation:
    return areal.translate(cast("dict[str, Any]", OmegaConf.to_container(OmegaConf.load(FIXTURES / name))))


def _row(t: areal.Translation, key: str) -> areal.Row:
    return next(r for r in t.rows if r.areal == key)


def test_gspo_example_translates_to_the_sequence_level_ratio():
    t = _translated("gsm8k_gspo.yaml")
    assert t.problems == []
    assert _row(t, "actor.importance_sampling_level").became == "actor.ppo.importance_sampling_level = 'sequence'"
    assert t.tree["actor"]["ppo"]["importance_sampling_level"] == "sequence"


def test_gspo_example_loads_as_a_lora_run():
    p = load_config(FIXTURES / "gsm8k_gspo.yaml", LORA, read_data=False).actor.ppo
    assert p.importance_sampling_level == "sequence"
    assert (p.eps_clip, p.use_decoupled_loss, p.behav_imp_weight_cap, p.behav_imp_weight_mode) == (
        0.4,
        True,
        5.0,
        "mask",
    )
    assert (p.group_adv_norm, p.adv_norm_std, p.batch_adv_norm, p.reward_scaling, p.reward_bias) == (
        True,
        True,
        True,
        10.0,
        -0.5,
    )


def test_a_file_without_the_key_keeps_areal_s_token_level_ratio():
    t = _translated("gsm8k_grpo_lora.yaml")
    assert t.tree["actor"]["ppo"]["importance_sampling_level"] == "token"
    assert _row(t, "actor.importance_sampling_level").value == "'token' (AReaL default)"


def test_the_example_s_full_weights_and_an_unknown_ratio_level_are_refused_by_name():
    with pytest.raises(ConfigError) as e:
        load_config(FIXTURES / "gsm8k_gspo.yaml", read_data=False)
    assert any(p.startswith("actor.use_lora: false") for p in e.value.problems), e.value.problems
    with pytest.raises(ConfigError) as e:
        load_config(FIXTURES / "gsm8k_gspo.yaml", [*LORA, "actor.importance_sampling_level=seq"], read_data=False)
    (problem,) = e.value.problems
    assert problem.startswith("actor.ppo.importance_sampling_level") and "actor.importance_sampling_level" in problem


def test_dapo_example_translates_to_the_overlong_penalty_and_asymmetric_clip():
    t = _translated("gsm8k_dapo_dynamic_bs.yaml")
    assert t.problems == []
    p = t.tree["actor"]["ppo"]
    assert (p["overlong_tokens"], p["overlong_penalty_factor"], p["overlong_max_tokens"]) == (512, 1.0, 4096)
    assert (p["eps_clip"], p["eps_clip_higher"]) == (0.2, 0.28)
    # with no trajectory ever rejected, AReaL's dynamic batches are full ones
    assert _row(t, "dynamic_bs").became == "-" and "reject" in _row(t, "dynamic_bs").note


def test_dapo_example_loads_as_a_lora_run():
    cfg = load_config(FIXTURES / "gsm8k_dapo_dynamic_bs.yaml", LORA, read_data=False)
    p = cfg.actor.ppo
    assert (p.overlong_tokens, p.overlong_penalty_factor, p.overlong_max_tokens) == (512, 1.0, 4096)
    assert cfg.gconfig.max_new_tokens == 4096 and cfg.rollout.consumer_batch_size == 256


def test_overlong_settings_areal_would_not_run_are_refused_by_name():
    def problems(**actor: Any) -> list[str]:
        tree = cast("dict[str, Any]", OmegaConf.to_container(OmegaConf.load(FIXTURES / "gsm8k_dapo_dynamic_bs.yaml")))
        tree["actor"].update(actor)
        tree["actor"] = {k: v for k, v in tree["actor"].items() if v is not ...}
        return areal.translate(tree).problems

    (problem,) = problems(overlong_tokens=...)
    assert problem.startswith("actor.overlong_reward_penalty: True needs actor.overlong_tokens")
    (problem,) = problems(overlong_penalty_factor=None)
    assert problem.startswith("actor.overlong_reward_penalty: True needs actor.overlong_penalty_factor")
    # off, the window and factor are AReaL's leftovers: reported, not applied
    t = _translated("gsm8k_grpo_lora.yaml")
    assert "overlong_tokens" not in t.tree["actor"]["ppo"]
    with pytest.raises(ConfigError) as e:
        load_config(FIXTURES / "gsm8k_dapo_dynamic_bs.yaml", [*LORA, "actor.max_new_tokens=9000"], read_data=False)
    (problem,) = e.value.problems
    assert problem.startswith("actor.ppo.overlong_max_tokens: 9000 less overlong_tokens 512 is not below")


def test_sapo_example_translates_to_the_soft_gate_against_the_behaviour_policy():
    t = _translated("gsm8k_sapo.yaml")
    assert t.problems == []
    p = t.tree["actor"]["ppo"]
    assert (p["use_sapo_loss"], p["sapo_tau_pos"], p["sapo_tau_neg"], p["use_decoupled_loss"]) == (
        True,
        1.0,
        1.05,
        False,
    )
    cfg = load_config(FIXTURES / "gsm8k_sapo.yaml", LORA, read_data=False)
    assert cfg.actor.ppo.use_sapo_loss and not cfg.actor.ppo.use_decoupled_loss
    # off, its temperatures are reported as unused, not applied
    t = _translated("gsm8k_grpo_lora.yaml")
    assert "use_sapo_loss" not in t.tree["actor"]["ppo"]


def test_sapo_with_the_decoupled_loss_is_refused_by_name_as_areal_refuses_it():
    with pytest.raises(ConfigError) as e:
        load_config(FIXTURES / "gsm8k_sapo.yaml", [*LORA, "actor.use_decoupled_loss=true"], read_data=False)
    (problem,) = e.value.problems
    assert problem.startswith("actor.ppo.use_sapo_loss: true with actor.ppo.use_decoupled_loss: true")
