import math

import pytest
import torch

from services.trainer.loss import LossStats, decoupled_ppo_loss, group_advantages


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
