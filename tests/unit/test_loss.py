import math
from dataclasses import replace

import pytest
import torch

from services.trainer.loss import LossStats, decoupled_ppo_loss, group_advantages, sapo_gate


def test_group_advantages_hand_computed():
    # rewards 1, 0, 0, 1: mean 0.5, unbiased std sqrt(1/3) = 0.57735
    (adv,) = group_advantages([torch.tensor([1.0, 0.0, 0.0, 1.0])])
    expected = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    assert adv.tolist() == pytest.approx([expected, -expected, -expected, expected], rel=1e-6)


def test_all_equal_rewards_give_zero_advantage():
    advs = group_advantages([torch.tensor([0.7, 0.7, 0.7]), torch.tensor([1.0, 0.0])])
    assert advs[0].tolist() == [0.0, 0.0, 0.0]
    assert advs[1][0] > 0 > advs[1][1]


def test_reward_shaping_and_no_std():
    (adv,) = group_advantages([torch.tensor([1.0, 3.0])], adv_norm_std=False, reward_scaling=2.0, reward_bias=1.0)
    # shaped: (1+1)*2 = 4, (3+1)*2 = 8; centred: -2, +2
    assert adv.tolist() == pytest.approx([-2.0, 2.0])


def test_batch_level_normalisation_spans_groups():
    advs = group_advantages(
        [torch.tensor([1.0, 1.0]), torch.tensor([0.0, 0.0])],
        group_adv_norm=False,
        adv_norm_std=False,
    )
    # within-group normalisation would give all zeros; batch-level keeps the difference
    assert [a.tolist() for a in advs] == [[0.5, 0.5], [-0.5, -0.5]]


def test_single_completion_group_is_zero_not_nan():
    (adv,) = group_advantages([torch.tensor([3.0])])
    assert adv.tolist() == [0.0]


def _on_policy_inputs():
    logits = torch.tensor([[0.3, -0.2, 0.5], [0.1, 0.4, -0.7]], requires_grad=True)
    adv = torch.tensor([[1.5, 1.5, 1.5], [-0.5, -0.5, -0.5]])
    weights = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]) / 5.0  # 5 completion tokens
    return logits, adv, weights


def test_on_policy_reduces_to_vanilla_policy_gradient():
    logp, adv, w = _on_policy_inputs()
    loss, stats = decoupled_ppo_loss(logp, logp.detach(), logp.detach(), adv, w)
    # ratio = 1 and weight = 1: loss = -sum(adv * w) = -(1.5*2 - 0.5*3)/5 = -0.3
    assert loss.item() == pytest.approx(-0.3)
    loss.backward()
    # vanilla PG: grad of -sum(adv * w * logp) is -adv * w on every completion token
    assert torch.allclose(logp.grad, -adv * w)
    s = stats.summary()
    assert s["tokens"] == 5 and s["clip_fraction"] == 0 and s["masked_fraction"] == 0
    assert s["imp_weight_mean"] == pytest.approx(1.0)


def test_clipping_engages_and_stops_gradient():
    prox = torch.zeros(1, 2)
    # token 0: ratio e^0.5 = 1.65 > 1.2 with positive advantage -> clipped, no gradient;
    # token 1: ratio e^0.1 = 1.105 inside the range -> unclipped
    logp = torch.tensor([[0.5, 0.1]], requires_grad=True)
    adv = torch.ones(1, 2)
    w = torch.full((1, 2), 0.5)
    loss, stats = decoupled_ppo_loss(logp, prox, prox, adv, w, eps_clip=0.2)
    assert loss.item() == pytest.approx(-(1.2 * 0.5 + math.exp(0.1) * 0.5))
    loss.backward()
    assert logp.grad[0, 0] == 0
    assert logp.grad[0, 1] == pytest.approx(-0.5 * math.exp(0.1))
    assert stats.summary()["clip_fraction"] == 0.5


def test_clip_higher_widens_the_upper_bound():
    prox = torch.zeros(1, 1)
    logp = torch.tensor([[0.25]])  # ratio 1.284
    loss, stats = decoupled_ppo_loss(
        logp, prox, prox, torch.ones(1, 1), torch.ones(1, 1), eps_clip=0.2, eps_clip_higher=0.28
    )
    assert loss.item() == pytest.approx(-1.28)
    assert stats.clipped == 1


def test_negative_advantage_clips_below():
    prox = torch.zeros(1, 1)
    logp = torch.tensor([[-0.5]])  # ratio 0.607 < 0.8; with adv < 0 the clipped term wins
    loss, stats = decoupled_ppo_loss(logp, prox, prox, -torch.ones(1, 1), torch.ones(1, 1))
    assert loss.item() == pytest.approx(0.8)
    assert stats.clipped == 1


def test_stale_tokens_above_cap_are_masked():
    logp = torch.zeros(1, 3, requires_grad=True)
    prox = torch.zeros(1, 3)
    # behaviour logprobs: weight = exp(prox - behave) = 1, e^1 = 2.72, e^2 = 7.39 (> cap 5)
    behave = torch.tensor([[0.0, -1.0, -2.0]])
    adv = torch.ones(1, 3)
    w = torch.full((1, 3), 1 / 3)
    staleness = torch.tensor([[0.0, 1.0, 3.0]])
    loss, stats = decoupled_ppo_loss(logp, prox, behave, adv, w, imp_weight_cap=5.0, staleness=staleness)
    assert loss.item() == pytest.approx(-(1 + math.e) / 3)
    loss.backward()
    assert logp.grad[0, 2] == 0
    s = stats.summary()
    assert s["masked_fraction"] == pytest.approx(1 / 3)
    assert s["imp_weight_mean"] == pytest.approx((1 + math.e) / 2)
    assert s["imp_weight_max"] == pytest.approx(math.e)
    assert s["mean_staleness"] == pytest.approx(4 / 3)


def test_clamp_mode_caps_instead_of_masking():
    logp = torch.zeros(1, 1)
    behave = torch.tensor([[-2.0]])
    loss, stats = decoupled_ppo_loss(
        logp, logp, behave, torch.ones(1, 1), torch.ones(1, 1), imp_weight_cap=5.0, imp_weight_mode="clamp"
    )
    assert loss.item() == pytest.approx(-5.0)
    assert stats.masked == 0


def test_non_decoupled_uses_behaviour_as_ratio_base():
    logp = torch.zeros(1, 1)
    behave = torch.tensor([[-0.1]])  # ratio e^0.1 against behave; prox ignored
    loss, _ = decoupled_ppo_loss(
        logp, torch.full((1, 1), 9.0), behave, torch.ones(1, 1), torch.ones(1, 1), use_decoupled_loss=False
    )
    assert loss.item() == pytest.approx(-math.exp(0.1))


def test_padding_never_contributes():
    logp = torch.tensor([[0.0, 50.0]], requires_grad=True)
    loss, stats = decoupled_ppo_loss(
        logp, torch.zeros(1, 2), torch.tensor([[0.0, -80.0]]), torch.ones(1, 2), torch.tensor([[1.0, 0.0]])
    )
    assert loss.item() == pytest.approx(-1.0)
    loss.backward()
    assert logp.grad[0, 1] == 0
    assert stats.tokens == 1 and stats.masked == 0


def test_stats_add_up_across_micro_batches():
    a = LossStats(tokens=2, clipped=1, imp_weight_sum=2, imp_weight_max=1.5)
    b = LossStats(tokens=2, masked=1, imp_weight_sum=1, imp_weight_max=3.0)
    total = a + b
    assert total.tokens == 4 and total.imp_weight_max == 3.0
    assert LossStats.from_tensor(total.as_tensor()) == total
    assert total.summary()["imp_weight_mean"] == pytest.approx(1.0)


def test_bad_mode_is_rejected_with_field_name():
    with pytest.raises(ValueError, match="behav_imp_weight_mode"):
        decoupled_ppo_loss(
            torch.zeros(1), torch.zeros(1), torch.zeros(1), torch.zeros(1), torch.ones(1), imp_weight_mode="cap"
        )


def test_gspo_clips_a_completion_by_the_geometric_mean_of_its_ratios():
    # row 0: token ratios e^0.6 and e^-0.2, geometric mean e^0.2 = 1.2214 (> 1 + 0.2: clipped,
    # though one token alone would not be); row 1: one token at ratio e^0.1 = 1.105 (inside)
    prox = torch.zeros(2, 2)
    theta = torch.tensor([[0.6, -0.2], [0.1, 0.0]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    w = torch.tensor([[1.0, 1.0], [1.0, 0.0]]) / 3.0
    loss, stats = decoupled_ppo_loss(theta, prox, prox, adv, w, importance_sampling_level="sequence")
    assert loss.item() == pytest.approx(-(2 * 1.2 + math.exp(0.1)) / 3)
    assert stats.clipped == 2 and stats.ratio_sum == pytest.approx(math.exp(0.1) + 2 * math.exp(0.2))
    loss.backward()
    assert theta.grad[0].tolist() == [0.0, 0.0]  # the clipped completion passes no gradient
    # the unclipped one: d/dtheta of -(1/3) * exp(mean) over its one token
    assert theta.grad[1, 0].item() == pytest.approx(-math.exp(0.1) / 3)


def test_engines_take_the_ratio_level_and_sapo_from_the_config():
    # every engine's micro-batch loss (fsdp2 and megatron both call micro_batch_loss)
    import msgspec

    from services.config.schema import PPOConfig
    from services.trainer.batching import Sample, collate
    from services.trainer.engines.base import micro_batch_loss

    g = torch.Generator().manual_seed(0)
    samples = [
        Sample(input_ids=[1, 2, 3, 4, 5, 6], prompt_len=2, behave_logprobs=[-1.0] * 4, versions=[0] * 4, advantage=1.0),
        Sample(input_ids=[1, 2, 3, 4], prompt_len=2, behave_logprobs=[-1.0] * 2, versions=[0] * 2, advantage=-1.0),
    ]
    mb = collate([replace(s, token_weight=1 / 6) for s in samples])
    lp = mb.behave_logprobs + torch.randn(mb.behave_logprobs.shape, generator=g) * 0.3
    prox = mb.behave_logprobs.clone()
    for level in ("token", "sequence"):
        ppo = msgspec.structs.replace(PPOConfig(), importance_sampling_level=level)
        got, _ = micro_batch_loss(lp, prox, mb, 0, ppo, "cpu")
        want, _ = decoupled_ppo_loss(
            lp, prox, mb.behave_logprobs, mb.advantages, mb.loss_weights, importance_sampling_level=level
        )
        assert got.item() == pytest.approx(want.item())
    token = micro_batch_loss(lp, prox, mb, 0, PPOConfig(), "cpu")[0]
    assert token.item() != pytest.approx(got.item())
    # and SAPO's gate, with its temperatures
    sapo = msgspec.structs.replace(PPOConfig(), use_decoupled_loss=False, use_sapo_loss=True, sapo_tau_pos=0.5)
    got, stats = micro_batch_loss(lp, prox, mb, 0, sapo, "cpu")
    want, _ = decoupled_ppo_loss(
        lp, prox, mb.behave_logprobs, mb.advantages, mb.loss_weights, use_decoupled_loss=False, sapo_taus=(0.5, 1.05)
    )
    assert got.item() == pytest.approx(want.item()) and stats.clipped == 0
    plain = msgspec.structs.replace(sapo, use_sapo_loss=False)
    assert micro_batch_loss(lp, prox, mb, 0, plain, "cpu")[0].item() != pytest.approx(got.item())


def test_sapo_gate_is_the_policy_gradient_at_ratio_one_and_flattens_away_from_it():
    ratio = torch.tensor([1.0, 1.0, 6.0, 0.2], requires_grad=True)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    gate = sapo_gate(ratio, adv, 1.0, 2.0)
    assert gate[:2].tolist() == pytest.approx([4.0 * 0.5, 2.0 * 0.5])
    (g,) = torch.autograd.grad(gate.sum(), ratio)
    # slope 1 at ratio 1 for either temperature; far from it the gate hardly moves
    assert g[:2].tolist() == pytest.approx([1.0, 1.0]) and g[2] < 0.05 and g[3] < 0.6


def test_bad_ratio_level_is_rejected_with_field_name():
    with pytest.raises(ValueError, match="importance_sampling_level"):
        decoupled_ppo_loss(
            torch.zeros(1),
            torch.zeros(1),
            torch.zeros(1),
            torch.zeros(1),
            torch.ones(1),
            importance_sampling_level="seq",  # type: ignore[arg-type]
        )
