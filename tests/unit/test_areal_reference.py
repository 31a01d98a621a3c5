"""lorabus against AReaL 1.0.4 itself (its own functions, `tests/fixtures/areal_ref.py`): the
PPO/decoupled loss and its gradient over AReaL's loss options (their defaults, other values
and their absence), the statistics AReaL reports for a step, GRPO advantages with reward and
advantage normalisation, and the GSM8K reward on generated completions.

Each configuration is written in AReaL's keys on AReaL's own example file and goes through
lorabus's translation and loader, so a case passes only if the translation means what AReaL
means and the loss computes what AReaL computes; GSPO's sequence-level ratio
(`importance_sampling_level: sequence`) is one of those options. Options lorabus refuses (dual
clip, M2PO, SAPO, sequence-level rejection sampling) are refused by name in test_areal_keys.py.
"""

from __future__ import annotations

import copy
import itertools
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from omegaconf import OmegaConf

from services.config.loader import config_from_dict
from services.config.schema import PPOConfig
from services.trainer.batching import advantages
from services.trainer.loss import decoupled_ppo_loss, sequence_ratio
from tests.fixtures.areal_ref import INSTALL, ReferenceMissing, load

try:
    REF = load()
except ReferenceMissing as e:  # only the package's absence skips; a failure to load it is a failure
    pytest.skip(f"{e} (the reference is areal==1.0.4's own code: {INSTALL})", allow_module_level=True)

EXAMPLE = cast(
    "dict[str, Any]",
    OmegaConf.to_container(
        OmegaConf.load(Path(__file__).resolve().parents[1] / "fixtures" / "areal" / "gsm8k_grpo_lora.yaml")
    ),
)
TOL = dict(rtol=1e-6, atol=1e-8)


def _ppo(actor: dict[str, Any]) -> PPOConfig:
    """lorabus's loss settings for AReaL's example with `actor` keys replaced (`...` removes)."""
    tree = copy.deepcopy(EXAMPLE)
    for key, value in actor.items():
        if value is ...:
            tree["actor"].pop(key, None)
        else:
            tree["actor"][key] = value
    return config_from_dict(tree, read_data=False).actor.ppo


def _areal_config(actor: dict[str, Any]) -> Any:
    """AReaL's PPOActorConfig for the same keys (its defaults for the rest)."""
    merged = {k: v for k, v in {**EXAMPLE["actor"], **actor}.items() if v is not ...}
    rs = merged.get("rejection_sampling")  # AReaL's default: none
    return dict(
        eps_clip=merged.get("eps_clip", 0.2),
        eps_clip_higher=merged.get("eps_clip_higher"),
        rejection_sampling=None if rs is None else REF.RejectionSamplingConfig(**rs),
        use_decoupled_loss=merged.get("use_decoupled_loss", False),
        importance_sampling_level=merged.get("importance_sampling_level", "token"),
        use_sapo_loss=merged.get("use_sapo_loss", False),
        sapo_tau_pos=merged.get("sapo_tau_pos", 1.0),
        sapo_tau_neg=merged.get("sapo_tau_neg", 1.05),
    )


# --- the loss -------------------------------------------------------------------------------

REJECTION = {
    "absent (AReaL's default)": ...,
    "null": None,
    "mask at 5 (example)": {"metric": "ratio", "upper": 5.0},
    "mask at 1.3": {"metric": "ratio", "upper": 1.3, "action": "mask"},
    "clamp at 1.3": {"metric": "ratio", "upper": 1.3, "action": "clamp"},
    "clamp at 5": {"level": "token", "metric": "ratio", "upper": 5.0, "action": "clamp"},
}
CASES = [
    pytest.param(
        {
            "eps_clip": eps,
            "eps_clip_higher": high,
            "rejection_sampling": rs,
            "use_decoupled_loss": decoupled,
            "recompute_logprob": decoupled,
            "importance_sampling_level": level,
        },
        id=f"eps{eps}-high{high}-rs[{name}]-{'decoupled' if decoupled else 'ppo'}-{'token' if level is ... else level}",
    )
    for eps, high, (name, rs), decoupled, level in itertools.product(
        (0.2, 0.4), (..., 0.28), REJECTION.items(), (True, False), (..., "sequence")
    )
]


SAPO_CASES = [
    pytest.param(
        {
            "use_sapo_loss": True,
            "sapo_tau_pos": pos,
            "sapo_tau_neg": neg,
            "use_decoupled_loss": False,
            "recompute_logprob": False,
            "rejection_sampling": rs,  # the example's, which AReaL ignores without the decoupled loss
            "importance_sampling_level": level,
        },
        id=f"sapo-pos{pos}-neg{neg}-rs[{name}]-{'token' if level is ... else level}",
    )
    for (pos, neg), (name, rs), level in itertools.product(
        ((..., ...), (1.0, 1.05), (0.5, 3.0)),
        [(k, REJECTION[k]) for k in ("absent (AReaL's default)", "mask at 5 (example)")],
        (..., "sequence"),
    )
]
"""SAPO (AReaL's use_sapo_loss, its example's temperatures and others) at both ratio levels"""


def _batch(seed: int) -> dict[str, torch.Tensor]:
    """Logprobs of three policies far enough apart that clipping, masking and clamping engage."""
    g = torch.Generator().manual_seed(seed)
    b, t = 8, 12
    mask = torch.zeros(b, t, dtype=torch.bool)
    for i in range(b):
        start = int(torch.randint(1, 4, (1,), generator=g))
        stop = int(torch.randint(start + 2, t + 1, (1,), generator=g))
        mask[i, start:stop] = True
    behave = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    prox = behave + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.6
    theta = prox + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.4
    adv = torch.randn(b, 1, generator=g, dtype=torch.float64).expand(b, t).clone()
    return dict(theta=theta, prox=prox, behave=behave, adv=adv, mask=mask)


def _areal_loss(x: dict[str, torch.Tensor], cfg: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """AReaL's loss and gradient (ppo_actor_loss_fn, or sapo_loss_fn, in float64 as given) and the statistics its
    step reports (grpo_loss_fn, which takes float32 only)."""
    # without the decoupled loss AReaL's prox is the rollout's logprobs (_compute_advantages)
    prox = x["prox"] if cfg["use_decoupled_loss"] else x["behave"]
    theta = x["theta"].clone().requires_grad_(True)
    if cfg["use_sapo_loss"]:
        loss, _ = REF.sapo_loss_fn(
            logprobs=theta,
            old_logprobs=x["behave"],
            advantages=x["adv"],
            tau_pos=cfg["sapo_tau_pos"],
            tau_neg=cfg["sapo_tau_neg"],
            loss_mask=x["mask"],
            importance_sampling_level=cfg["importance_sampling_level"],
        )
    else:
        loss, _ = REF.ppo_actor_loss_fn(
            logprobs=theta,
            proximal_logprobs=prox,
            old_logprobs=x["behave"],
            advantages=x["adv"],
            eps_clip=cfg["eps_clip"],
            loss_mask=x["mask"],
            eps_clip_higher=cfg["eps_clip_higher"],
            rejection_sampling=cfg["rejection_sampling"],
            importance_sampling_level=cfg["importance_sampling_level"],
        )
    loss.backward()
    REF.stats_tracker.DEFAULT_TRACKER.export(reset=True)
    f32 = {k: v.float() if v.is_floating_point() else v for k, v in x.items()}
    REF.grpo_loss_fn(
        f32["theta"],
        torch.zeros_like(f32["theta"]),
        {"logprobs": f32["behave"], "advantages": f32["adv"], "loss_mask": x["mask"], "prox_logp": prox.float()},
        eps_clip=cfg["eps_clip"],
        eps_clip_higher=cfg["eps_clip_higher"],
        c_clip=None,
        rejection_sampling=cfg["rejection_sampling"],
        importance_sampling_level=cfg["importance_sampling_level"],
        use_sapo_loss=cfg["use_sapo_loss"],
        sapo_tau_pos=cfg["sapo_tau_pos"],
        sapo_tau_neg=cfg["sapo_tau_neg"],
        use_decoupled_loss=cfg["use_decoupled_loss"],
    )
    return loss.detach(), theta.grad, REF.stats_tracker.DEFAULT_TRACKER.export(reset=True)


def _lorabus_loss(x: dict[str, torch.Tensor], p: PPOConfig) -> tuple[torch.Tensor, torch.Tensor, dict]:
    theta = x["theta"].clone().requires_grad_(True)
    weights = x["mask"].double() / x["mask"].sum()
    loss, stats = decoupled_ppo_loss(
        theta,
        x["prox"],
        x["behave"],
        x["adv"],
        weights,
        eps_clip=p.eps_clip,
        eps_clip_higher=p.eps_clip_higher,
        imp_weight_cap=p.behav_imp_weight_cap,
        imp_weight_mode=p.behav_imp_weight_mode,
        use_decoupled_loss=p.use_decoupled_loss,
        importance_sampling_level=p.importance_sampling_level,
        sapo_taus=(p.sapo_tau_pos, p.sapo_tau_neg) if p.use_sapo_loss else None,
    )
    loss.backward()
    return loss.detach(), theta.grad, stats.summary()


@pytest.mark.parametrize("actor", CASES + SAPO_CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_loss_gradient_and_statistics_equal_areal_s(actor, seed):
    x = _batch(seed)
    want_loss, want_grad, reported = _areal_loss(x, _areal_config(actor))
    got_loss, got_grad, stats = _lorabus_loss(x, _ppo(actor))
    torch.testing.assert_close(got_loss, want_loss, **TOL)
    torch.testing.assert_close(got_grad, want_grad, **TOL)
    # AReaL's step statistics, over the completion tokens (its n_valid_tokens)
    # (reported in float32)
    assert stats["clip_fraction"] == pytest.approx(reported["clip_ratio/avg"], abs=1e-6)
    assert stats["ratio_mean"] == pytest.approx(reported["importance_weight/avg"], rel=1e-5)
    if "behave_imp_weight/avg" in reported:
        assert stats["imp_weight_mean"] == pytest.approx(reported["behave_imp_weight/avg"], rel=1e-5)
        assert stats["imp_weight_max"] == pytest.approx(reported["behave_imp_weight/max"], rel=1e-5)
        filtered = stats["masked_fraction"] + stats["clamped_fraction"]
        assert filtered == pytest.approx(reported["rs_filtered_fraction"], abs=1e-6)


def test_the_cases_engage_clipping_masking_and_clamping():
    # guards the comparison above: inputs under which nothing clips or masks would prove little
    x = _batch(0)
    s = _lorabus_loss(x, _ppo({"eps_clip": 0.2, "rejection_sampling": REJECTION["mask at 1.3"]}))[2]
    assert 0.05 < s["clip_fraction"] < 0.9 and 0.05 < s["masked_fraction"] < 0.9
    s = _lorabus_loss(x, _ppo({"eps_clip": 0.2, "rejection_sampling": REJECTION["clamp at 1.3"]}))[2]
    assert 0.05 < s["clamped_fraction"] < 0.9
    # GSPO's one ratio per completion clips whole completions, some and not all of them
    s = _lorabus_loss(x, _ppo({"eps_clip": 0.2, "importance_sampling_level": "sequence"}))[2]
    assert 0.05 < s["clip_fraction"] < 0.9


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sequence_ratio_equals_areal_s_gspo_ratio_and_advantages(seed):
    # advantages that vary along a completion (AReaL's per-token advantages could), and rows
    # with gaps in their mask, where the mean must skip the masked tokens
    x = _batch(seed)
    g = torch.Generator().manual_seed(100 + seed)
    adv = torch.randn(x["adv"].shape, generator=g, dtype=torch.float64)
    keep = x["mask"] & (torch.rand(x["mask"].shape, generator=g) > 0.2)
    log_ratio = x["theta"] - x["prox"]
    want = REF.sequence_level_ratio(log_ratio, adv, keep, None)
    got = sequence_ratio(log_ratio, adv, keep)
    for w, o in zip(want, got, strict=True):
        torch.testing.assert_close(o, w, **TOL)


# --- advantages -----------------------------------------------------------------------------

NORMS = {
    "group/group, batch/batch (example)": (
        {"mean_level": "group", "std_level": "group", "group_size": 4},
        {"mean_level": "batch", "std_level": "batch"},
    ),
    "group/none, adv null": ({"mean_level": "group", "std_level": None, "group_size": 4}, None),
    "batch/batch, batch/none": (
        {"mean_level": "batch", "std_level": "batch"},
        {"mean_level": "batch", "std_level": None},
    ),
    "group/group, adv absent (AReaL's default: none)": (
        {"mean_level": "group", "std_level": "group", "group_size": 4},
        ...,
    ),
    "reward null, batch/batch (AReaL's REINFORCE and agent examples)": (
        None,
        {"mean_level": "batch", "std_level": "batch"},
    ),
    "reward absent (AReaL's default: none), adv null": (..., None),
    "group leave-one-out/none, batch/batch (AReaL's RLOO example)": (
        {"mean_level": "group", "mean_leave1out": True, "std_level": None, "group_size": 4},
        {"mean_level": "batch", "std_level": "batch"},
    ),
    "group leave-one-out/group, adv null": (
        {"mean_level": "group", "mean_leave1out": True, "std_level": "group", "group_size": 4},
        None,
    ),
    "group/batch, batch/batch (AReaL's LitePPO example)": (
        {"mean_level": "group", "std_level": "batch", "group_size": 4},
        {"mean_level": "batch", "std_level": "batch"},
    ),
    "batch leave-one-out/batch, adv null": (
        {"mean_level": "batch", "mean_leave1out": True, "std_level": "batch"},
        None,
    ),
    "group/group eps 1e-3, adv null": (
        {"mean_level": "group", "std_level": "group", "group_size": 4, "eps": 1e-3},
        {"mean_level": "batch", "std_level": "batch", "eps": 1e-3},
    ),
}
SHAPING = {
    "example (x10, -0.5)": {},
    "AReaL defaults": {"reward_scaling": ..., "reward_bias": ...},
    "clipped at 3": {"reward_scaling": 10.0, "reward_bias": -0.5, "reward_clip": 3.0},
    # completions are 1-7 tokens: the windows cover some of them and not others
    "DAPO overlong, last 4 of 8": {
        "overlong_reward_penalty": True,
        "overlong_tokens": 4,
        "overlong_penalty_factor": 1.0,
        "max_new_tokens": 8,
    },
    "DAPO overlong, last 3 of 6 at 0.5, clipped at 3": {
        "overlong_reward_penalty": True,
        "overlong_tokens": 3,
        "overlong_penalty_factor": 0.5,
        "max_new_tokens": 6,
        "reward_clip": 3.0,
    },
}


def _rollout_batch(seed: int, groups: int = 3, n: int = 4) -> dict[str, Any]:
    """AReaL's padded batch: [prompt | completion | padding] rows, one group's rows together."""
    g = torch.Generator().manual_seed(seed)
    rows, t = groups * n, 14
    prompt = torch.randint(2, 5, (rows,), generator=g)
    completion = torch.randint(1, 8, (rows,), generator=g)
    attn = torch.zeros(rows, t, dtype=torch.bool)
    loss_mask = torch.zeros(rows, t, dtype=torch.bool)
    for i in range(rows):
        attn[i, : prompt[i] + completion[i]] = True
        loss_mask[i, prompt[i] : prompt[i] + completion[i]] = True
    # a group with every reward equal carries no signal: its advantage must be 0 in both
    rewards = torch.randint(0, 2, (rows,), generator=g).double()
    rewards[:n] = 1.0
    return dict(
        input_ids=torch.ones(rows, t, dtype=torch.long),
        attention_mask=attn,
        loss_mask=loss_mask.long(),
        logprobs=-torch.rand(rows, t, generator=g),
        rewards=rewards,
        completion=completion,
    )


def _areal_advantages(batch: dict[str, Any], actor: dict[str, Any]) -> torch.Tensor:
    """One advantage per row, read from AReaL's per-token advantages on its completion tokens."""
    merged = {k: v for k, v in {**EXAMPLE["actor"], **actor}.items() if v is not ...}
    norms = {}
    for key in ("reward_norm", "adv_norm"):
        value = merged.get(key)
        norms[key] = None if value is None else REF.NormConfig(**value)
    config = REF.PPOActorConfig(
        reward_scaling=merged.get("reward_scaling", 1.0),
        reward_bias=merged.get("reward_bias", 0.0),
        reward_clip=merged.get("reward_clip", 20.0),
        kl_ctl=0.0,
        use_decoupled_loss=True,
        overlong_reward_penalty=merged.get("overlong_reward_penalty", False),
        overlong_tokens=merged.get("overlong_tokens"),
        overlong_penalty_factor=merged.get("overlong_penalty_factor"),
        max_new_tokens=merged.get("max_new_tokens", 1024),
        **norms,
    )
    actor_ = REF.PPOActor(config, engine=None)
    data = {k: v.clone() for k, v in batch.items() if k != "completion"}
    out = actor_._compute_advantages(data)
    adv, mask = out["advantages"], out["loss_mask"].bool()
    rows = []
    for i in range(adv.shape[0]):
        values = adv[i][mask[i]]
        # every completion token carries the completion's advantage in AReaL too (no critic, γ = λ = 1)
        torch.testing.assert_close(values, values[:1].expand_as(values), rtol=0, atol=1e-6)
        rows.append(values[0])
    return torch.stack(rows).double()


def _lorabus_advantages(batch: dict[str, Any], actor: dict[str, Any], n: int = 4) -> torch.Tensor:
    """What the trainer computes (`batching.advantages`, which `to_samples` calls) from each
    completion's reward and length."""
    p = _ppo(actor)
    rewards = list(batch["rewards"].split(n))
    lengths = list(batch["completion"].split(n))
    return torch.cat(advantages(rewards, lengths, p)).double()


@pytest.mark.parametrize("shaping", SHAPING.values(), ids=list(SHAPING))
@pytest.mark.parametrize("norms", NORMS.values(), ids=list(NORMS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_advantages_equal_areal_s(seed, norms, shaping):
    reward_norm, adv_norm = norms
    actor = {"reward_norm": reward_norm, "adv_norm": adv_norm, **shaping}
    batch = _rollout_batch(seed)
    want = _areal_advantages(batch, actor)
    got = _lorabus_advantages(batch, actor)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# --- the GSM8K reward -----------------------------------------------------------------------

GOLD = {
    "72": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72",
    "-7": "It fell 10 degrees from 3, so 3-10=<<3-10=-7>>-7.\n#### -7",
    "3600": "He planted 60*60=<<60*60=3600>>3600 plants.\n#### 3600",
    "0.5": "Half of it is 1/2=<<1/2=0.5>>0.5.\n#### 0.5",
    "1250000": "So 1,250,000.\n#### 1250000",
    "18": "She sells 16 - 3 - 4 = <<16-3-4=9>>9 eggs.\nShe makes 9 * 2 = $<<9*2=18>>18 every day.\n#### 18",
}
"""GSM8K-form answers (a worked solution ending in `#### N`), as AReaL's reward receives them"""
WRONG = {"72": "71", "-7": "7", "3600": "360", "0.5": "0.25", "1250000": "125000", "18": "9"}
TEMPLATES = {
    "alone": "{a}",
    "the answer is": "The answer is {a}.",
    "work first": "First, 48/2 = 24. Then 48 + 24 = 72 - 1 + 1. So the final answer is {a}.",
    "numbers after": "The answer is {a}. Check: 3 + 4 = 7 and 10 more.",
    "numbers on the next line": "{a}\nWe used 5 steps and 2 checks.",
    "inline latex": "Therefore, the total is ${a}$.",
    "taken back": "Maybe {a}? No wait, it is 13.",
}


def _forms(v: str) -> dict[str, str]:
    """How a completion may write the value `v`."""
    f = float(v)
    out = {
        "plain": v,
        "boxed": f"\\boxed{{{v}}}",
        "boxed in $": f"$\\boxed{{{v}}}$",
        "####": f"#### {v}",
        "bare ####": f"####{v}",
        "2 decimals": f"{f:.2f}",
        "boxed decimal": f"\\boxed{{{f:.1f}}}",
    }
    if abs(f) >= 1000:
        out |= {"thousands": f"{int(f):,}", "boxed thousands": f"\\boxed{{{int(f):,}}}"}
    if v == "0.5":
        out |= {"frac": "\\frac{1}{2}", "boxed frac": "\\boxed{\\frac{1}{2}}", "slash": "1/2"}
    if not v.startswith("-"):
        out |= {
            "escaped dollar": f"\\${v}",
            "boxed dollar": f"\\boxed{{\\${v}}}",
            "unit": f"{v} apples",
            "boxed unit": f"\\boxed{{{v} \\text{{ apples}}}}",
        }
    return out


COMPLETIONS = [
    (gold, correct, form, template, text.format(a=written))
    for gold in GOLD
    for correct in (True, False)
    for form, written in _forms(gold if correct else WRONG[gold]).items()
    for template, text in TEMPLATES.items()
]

DELIBERATE = {
    "bare ####": "AReaL finds no number glued to the marker",
    "####": "AReaL reads a number after the marked answer as the answer",
    "escaped dollar": "math-verify finds no number after a LaTeX-escaped dollar",
}
"""where lorabus's math_answer and AReaL's gsm8k_reward_fn may differ, and why (lorabus must
be the one that is right there)"""


def test_gsm8k_reward_agrees_with_areal_s_except_where_areal_is_wrong():
    from services.common.data import final_answer
    from services.common.rewards import math_answer

    assert len(COMPLETIONS) > 900
    differ = []
    for gold, correct, form, template, text in COMPLETIONS:
        theirs = REF.gsm8k_reward_fn(None, text, None, None, GOLD[gold])
        # lorabus's loader keeps the number after '####' as the answer (services.common.data)
        ours = math_answer("", text, final_answer(GOLD[gold]))
        if ours != theirs:
            differ.append((form, template, text, theirs, ours))
            assert form in DELIBERATE, f"{text!r}: AReaL {theirs}, lorabus {ours}"
            # where they differ lorabus is right; "taken back" has no single right answer
            assert template == "taken back" or ours == float(correct), f"{text!r}: lorabus {ours}"
    # the differences are few, and each kind of them shows
    assert {d[0] for d in differ} == set(DELIBERATE), differ
    assert len(differ) < 0.1 * len(COMPLETIONS), len(differ)
