"""The canary's comparison (`services.rollout.canary.gap`) and the trainer's reference."""

from __future__ import annotations

import math

import pytest
import torch

from proto.messages import Canary, CanarySequence
from services.rollout.canary import TOLERANCE, gap, requests
from services.rollout.engines.base import GenResult
from services.trainer import canary as trainer_canary

CANARY = Canary(
    dtype="float32",
    sequences=[
        CanarySequence(prompt_token_ids=[1, 2], token_ids=[5, 6, 7], logprobs=[-0.1, -0.2, -0.3]),
        CanarySequence(prompt_token_ids=[3], token_ids=[8, 9], logprobs=[-1.0, -0.5]),
    ],
)


def result(ids, lps) -> GenResult:
    return GenResult(token_ids=ids, logprobs=lps, finish_reason="length")


def test_the_same_answer_passes():
    g = gap(CANARY, [result([5, 6, 7], [-0.1, -0.2, -0.3005]), result([8, 9], [-1.0, -0.5])])
    assert g.passed and g.value == pytest.approx(5e-4) and (g.sequence, g.token) == (0, 2)


def test_a_near_tie_that_picks_another_token_passes_and_the_rest_is_not_compared():
    # token 1 differs at a near-tie (logprob within tolerance); tokens after it condition on
    # another prefix, so their values (far off here) are not compared
    g = gap(CANARY, [result([5, 4, 0], [-0.1, -0.2001, -9.0]), result([8, 9], [-1.0, -0.5])])
    assert g.passed, g


def test_a_shifted_distribution_fails_with_where():
    g = gap(CANARY, [result([5, 6, 7], [-0.1, -0.2, -0.3]), result([8, 9], [-1.4, -0.5])])
    assert not g.passed and (g.sequence, g.token) == (1, 0) and g.value == pytest.approx(0.4)
    assert "canary gap 0.4 > tolerance 0.002 at sequence 1 token 0" in g.describe(2)


def test_a_replica_that_stops_early_fails():
    g = gap(CANARY, [result([5], [-0.1]), result([8, 9], [-1.0, -0.5])])
    assert not g.passed and math.isinf(g.value) and (g.sequence, g.token) == (0, 1)


def test_a_replica_that_agrees_up_to_an_end_token_passes():
    # a server stops at its end token; the trainer's reference, knowing none, went on past it
    stopped = GenResult(token_ids=[5, 6], logprobs=[-0.1, -0.2], finish_reason="stop")
    g = gap(CANARY, [stopped, result([8, 9], [-1.0, -0.5])])
    assert g.passed
    # but stopping at a token the trainer did not pick is a divergence measured at that token
    other = GenResult(token_ids=[5, 1], logprobs=[-0.1, -3.0], finish_reason="stop")
    assert not gap(CANARY, [other, result([8, 9], [-1.0, -0.5])]).passed


def test_one_result_per_sequence():
    with pytest.raises(ValueError, match="results: 1 for 2 canary sequences"):
        gap(CANARY, [result([5], [-0.1])])


def test_requests_decode_greedily_as_far_as_the_trainer():
    reqs = requests(CANARY.sequences)
    assert [(r.temperature, r.max_new_tokens, r.n) for r in reqs] == [(0.0, 3, 1), (0.0, 2, 1)]


def test_tolerances_grow_with_coarser_dtypes():
    assert TOLERANCE["float32"] < TOLERANCE["float16"] < TOLERANCE["bfloat16"]


def test_the_trainer_reference_is_the_greedy_continuation_with_its_logprobs():
    torch.manual_seed(0)
    table = torch.randn(11, 11)

    class Bigram(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(table)

        def forward(self, input_ids):
            return type("Out", (), {"logits": self.w[input_ids]})()

    prompt_ids = trainer_canary.prompts(11, seed=3, n=2, length=3)
    assert prompt_ids == trainer_canary.prompts(11, seed=3, n=2, length=3)
    assert all(1 <= t < 11 for p in prompt_ids for t in p)
    c = trainer_canary.reference(Bigram(), prompt_ids, "float32", n_tokens=4)
    for prompt, seq in zip(prompt_ids, c.sequences):
        last = prompt[-1]
        for token, lp in zip(seq.token_ids, seq.logprobs):
            row = table[last].log_softmax(-1)
            assert token == int(row.argmax()) and lp == pytest.approx(float(row.max()))
            last = token
    with pytest.raises(ValueError, match="vocab_size: 1"):
        trainer_canary.prompts(1, seed=0)


def no_cache_reference(model, prompt_ids: list[list[int]], n_tokens: int) -> list[tuple[list[int], list[float]]]:
    """The plain greedy decode the trainer's reference must equal: one prompt at a time, the
    whole sequence forwarded for every token."""
    out = []
    with torch.no_grad():
        for prompt in prompt_ids:
            ids, tokens, lps = list(prompt), [], []
            for _ in range(n_tokens):
                row = model(input_ids=torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)
                token = int(row.argmax())
                tokens.append(token)
                lps.append(min(float(row[token]), 0.0))
                ids.append(token)
            out.append((tokens, lps))
    return out


class InputIdsOnly(torch.nn.Module):
    """A model called as Megatron's `_HFCall` is: `input_ids` alone, no KV cache."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.lengths: list[int] = []

    def forward(self, input_ids):
        self.lengths.append(input_ids.shape[1])
        return self.model(input_ids=input_ids)


def test_the_cached_reference_equals_a_plain_greedy_decode():
    from peft import LoraConfig, get_peft_model

    from tests.fixtures.tiny import tiny_qwen2

    torch.manual_seed(1)
    base = tiny_qwen2()
    peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=8.0, target_modules="all-linear", init_lora_weights=False))
    peft.eval()
    # two prompt lengths: two batches, put back in the caller's order
    prompt_ids = trainer_canary.prompts(97, seed=5, n=4, length=6) + trainer_canary.prompts(97, seed=6, n=2, length=3)
    want = no_cache_reference(peft, prompt_ids, n_tokens=5)
    seen: list[int] = []
    hook = peft.register_forward_pre_hook(lambda mod, args, kwargs: seen.append(kwargs["input_ids"].shape[1]),
                                          with_kwargs=True)  # fmt: skip
    try:
        got = trainer_canary.reference(peft, prompt_ids, "float32", n_tokens=5)
    finally:
        hook.remove()
    assert seen == [6, 1, 1, 1, 1, 3, 1, 1, 1, 1], "tokens after the first come from the KV cache"
    wrapped = InputIdsOnly(peft)
    plain = trainer_canary.reference(wrapped, prompt_ids, "float32", n_tokens=5)
    assert wrapped.lengths == [6, 7, 8, 9, 10, 3, 4, 5, 6, 7], "a model without a cache gets the whole sequence"
    for canary in (got, plain):
        assert [s.prompt_token_ids for s in canary.sequences] == prompt_ids
        for seq, (tokens, lps) in zip(canary.sequences, want):
            assert seq.token_ids == tokens and seq.logprobs == pytest.approx(lps, abs=1e-5)
            assert all(isinstance(t, int) for t in seq.token_ids)


def test_evaluating_turns_dropout_off_and_gives_each_module_its_own_mode_back():
    nn = torch.nn
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Sequential(nn.Dropout(0.5)))
    model.train()
    model[2].eval()  # a submodule the caller left in eval mode stays there
    x = torch.ones(2, 4)
    with trainer_canary.evaluating(model):
        assert not any(m.training for m in model.modules())
        assert torch.equal(model(x), model(x))  # dropout off: the same answer twice
    assert [m.training for m in model.modules()] == [True, True, True, False, False]
    with pytest.raises(RuntimeError), trainer_canary.evaluating(model):
        raise RuntimeError("a canary that fails")
    assert [m.training for m in model.modules()] == [True, True, True, False, False]
