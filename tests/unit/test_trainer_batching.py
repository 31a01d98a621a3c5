"""The trainer's one rule for a trainable trajectory (`batching.problem`): what it refuses is
what `to_samples` refuses, so the queue checks without converting and the step converts once."""

from __future__ import annotations

import pytest

from proto.messages import Completion, Trajectory
from services.config.schema import PPOConfig
from services.trainer import batching


def trajectory(prompt: list[int], *completions: list[int]) -> Trajectory:
    return Trajectory(
        run="r",
        trajectory_id="t1",
        grant_id="g",
        replica="r1",
        prompt_id="p",
        prompt_token_ids=prompt,
        completions=[
            Completion(token_ids=c, logprobs=[-0.5] * len(c), versions=[0] * len(c), reward=float(i))
            for i, c in enumerate(completions)
        ],
        started_at=1.0,
        finished_at=2.0,
    )


def test_what_the_check_refuses_the_conversion_refuses_in_the_same_words():
    empty_prompt = trajectory([], [5, 6], [7])
    assert batching.problem(empty_prompt) == "prompt_token_ids is empty"
    with pytest.raises(ValueError, match="trajectory t1: prompt_token_ids is empty"):
        batching.to_samples([empty_prompt], PPOConfig())
    good = trajectory([1, 2], [5, 6], [])
    assert batching.problem(good, vocab_size=7) is None
    assert [s.input_ids for s in batching.to_samples([good], PPOConfig())] == [[1, 2, 5, 6]]


def test_token_ids_beyond_the_vocabulary_are_named_by_field():
    assert batching.problem(trajectory([1, 9], [5]), vocab_size=8) == (
        "prompt_token_ids: token id 9 >= the model's vocab size 8"
    )
    assert batching.problem(trajectory([1], [5], [3, 8]), vocab_size=8) == (
        "completions[1].token_ids: token id 8 >= the model's vocab size 8"
    )
    assert batching.problem(trajectory([1], [5], [3, 8])) is None  # no vocabulary given: not checked


def test_without_reward_normalisation_a_completion_s_shaped_reward_is_its_advantage():
    group = trajectory([1, 2], [5], [6], [7])  # rewards 0, 1, 2
    centred = batching.to_samples([group], PPOConfig())
    raw = batching.to_samples([group], PPOConfig(reward_norm=False, reward_scaling=2.0, reward_bias=-1.0))
    assert [s.advantage for s in raw] == [-2.0, 0.0, 2.0]  # (reward + bias) x scaling, as AReaL shapes
    assert [round(s.advantage, 4) for s in centred] == [-1.0, 0.0, 1.0]  # std 1 (unbiased), + eps
