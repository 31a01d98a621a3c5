import pytest

from services.common.rewards import (
    RewardError,
    arith_reward,
    extract_final_number,
    load_reward_fn,
    numeric_final_answer,
)


@pytest.mark.parametrize(
    "completion, answer, reward",
    [
        ("19", "19", 1.0),
        (" 19\n", "19", 1.0),
        ("019", "19", 1.0),  # the same integer
        ("18", "19", 0.0),
        ("19 and more", "19", 0.0),  # nothing may follow the answer before eos
        ("1919", "19", 0.0),
        ("", "19", 0.0),
        ("-3", "-3", 1.0),
        ("+3", "3", 0.0),
        ("x", "0", 0.0),
    ],
)
def test_arith_reward(completion, answer, reward):
    assert arith_reward("12+7=", completion, answer) == reward


@pytest.mark.parametrize(
    "completion, answer, reward",
    [
        ("So the total is 1,234.", "#### 1234", 1.0),
        ("2 + 3 = 5 then 5 * 2 = 10", "10", 1.0),
        ("first 10 ... #### 72 (checked: 71)", "He earns <<6*12=72>>72.\n#### 72", 1.0),
        ("The answer is 72.0", "72", 1.0),
        ("The answer is $-4.50", "-4.5", 1.0),
        ("I get 71", "72", 0.0),
        ("no idea", "72", 0.0),
        ("#### nothing", "72", 0.0),
    ],
)
def test_numeric_final_answer(completion, answer, reward):
    assert numeric_final_answer("q", completion, answer) == reward


def test_numeric_final_answer_rejects_answer_without_number():
    with pytest.raises(RewardError, match="answer: .* no number"):
        numeric_final_answer("q", "5", "unknown")


def test_extract_final_number():
    assert extract_final_number("a 1,000,000 b") == 1_000_000
    assert extract_final_number(".5 of it") == 0.5
    assert extract_final_number("none") is None


def test_load_shipped_rewards():
    assert load_reward_fn("services.common.rewards:arith_reward") is arith_reward
    fn = load_reward_fn("services.common.rewards:numeric_final_answer")
    assert fn("q", "#### 3", "3") == 1.0


@pytest.mark.parametrize(
    "spec, needle",
    [
        ("", "must be 'package.module:function'"),
        ("services.common.rewards", "must be 'package.module:function'"),
        (":arith_reward", "must be 'package.module:function'"),
        ("services.common.nope_rewards:f", "module 'services.common.nope_rewards' cannot be imported"),
        ("services.common.rewards:nope", "has no attribute 'nope'"),
        ("services.common.rewards:math", "is a module, not a function"),
    ],
)
def test_load_reward_fn_errors(spec, needle):
    with pytest.raises(RewardError, match=needle):
        load_reward_fn(spec)
