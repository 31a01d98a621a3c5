"""The fused sampler (`sample_kernel`) against the torch sampler, on CPU under Triton's interpreter.

Triton decides when it is imported whether it interprets, so the checks run in one child process
started with TRITON_INTERPRET=1 (tests/fixtures/interpreted.py). On a GPU the same
source compiles; benchmarks/sampler.py compares the two there."""

import pytest
import torch

from tests.fixtures.interpreted import Outcome, checks_in, run_checks

INTERPRETED = checks_in(__file__, {"sampler": ("interpreted",)})


@pytest.fixture(scope="module")
def outcomes() -> dict[str, Outcome]:
    pytest.importorskip("triton")
    return run_checks(INTERPRETED)


def test_the_fused_sampler_draws_the_torch_samplers_tokens_and_logprobs(outcomes):
    assert "sampler checked" in outcomes["sampler"].output()


def reference(logits, temperature, seeds, step):
    """The torch path of `sampling.sample` (no truncation), whatever the environment."""
    from services.rollout.sampling import gumbel_noise, vocab_hashes

    scaled = logits.float() / torch.where(temperature <= 0, 1.0, temperature)[:, None]
    logp = scaled.log_softmax(-1)
    drawn = (scaled + gumbel_noise(seeds, step, vocab_hashes(logits.shape[-1], logits.device))).argmax(-1)
    tokens = torch.where(temperature <= 0, scaled.argmax(-1), drawn)
    return tokens, logp.gather(-1, tokens[:, None])[:, 0]


def interpreted() -> None:
    from services.rollout import sample_kernel, sampling

    assert sampling.fused_sampler_available(torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    # vocab sizes below, at and across the block; the interpreter has no bfloat16 (numpy)
    for vocab, dtype in [(37, torch.float32), (sample_kernel.BLOCK, torch.float16), (5000, torch.float32)]:
        rows = 6
        logits = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
        logits[5, 7] = logits[5, 9] = logits[5].max() + 1  # a greedy tie: the lower id wins
        temperature = torch.tensor([1.0, 0.7, 1.3, 0.0, -1.0, 0.0])
        seeds = torch.tensor([0, 1, 2**32 - 1, 5, 6, 7])
        for step in (0, 3, torch.tensor([1, 2, 3, 4, 5, 6])):
            want_t, want_lp = reference(logits, temperature, seeds, step)
            got_t, got_lp = sampling.sample(
                logits, temperature, torch.ones(rows), torch.zeros(rows, dtype=torch.long), seeds, step,
                sampling.vocab_hashes(vocab, logits.device), needs_truncation=False,
            )  # fmt: skip
            assert got_t.dtype == torch.int64 and got_lp.dtype == torch.float32
            assert got_t.tolist() == want_t.tolist(), (vocab, step, got_t, want_t)
            assert torch.allclose(got_lp, want_lp, atol=1e-5, rtol=1e-5), (vocab, got_lp, want_lp)
        assert got_t[5].item() == 7
    # a row split into chunks (3 of BLOCK, the last one short) gives the one-chunk answer; a
    # greedy tie across chunks goes to the lower id
    block = sample_kernel.BLOCK
    logits = torch.randn(4, 2 * block + 100, generator=g) * 3
    logits[3, 5] = logits[3, block + 9] = logits[3].max() + 1
    temperature, keys = torch.tensor([1.0, 0.5, 2.0, 0.0]), sampling.row_keys(torch.arange(4), 2)
    whole_t, whole_lp = sample_kernel.sample_fused(logits, temperature, keys)
    split_t, split_lp = sample_kernel.sample_fused(logits, temperature, keys, chunk=block)
    want_t, want_lp = reference(logits, temperature, torch.arange(4), 2)
    assert split_t.tolist() == whole_t.tolist() == want_t.tolist() and split_t[3].item() == 5
    assert torch.allclose(split_lp, whole_lp, atol=1e-5, rtol=1e-5)
    assert torch.allclose(split_lp, want_lp, atol=1e-5, rtol=1e-5)
    # a row's tokens do not depend on the other rows in its batch
    logits = torch.randn(4, 300, generator=g)
    t, s = torch.ones(4), torch.arange(4)
    alone = sample_kernel.sample_fused(logits[2:3], t[2:3], sampling.row_keys(s[2:3], 1))[0]
    assert alone.item() == sample_kernel.sample_fused(logits, t, sampling.row_keys(s, 1))[0][2].item()
    print("sampler checked")


def test_a_fused_sampler_that_fails_is_left_for_torch_once_and_said(monkeypatch, caplog):
    pytest.importorskip("triton")
    from services.rollout import sample_kernel, sampling

    calls = []

    def broken(*args):
        calls.append(1)
        raise RuntimeError("PassManager::run failed")

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # what makes it eligible on this CPU
    monkeypatch.setattr(sample_kernel, "sample_fused", broken)
    monkeypatch.setattr(sampling, "_FUSED_BROKEN", [])
    logits, temperature, seeds = torch.randn(3, 50), torch.tensor([1.0, 0.0, 0.5]), torch.arange(3)
    args = (torch.ones(3), torch.zeros(3, dtype=torch.long), seeds, 2, sampling.vocab_hashes(50, logits.device), False)
    for _ in range(2):
        tokens, logprobs = sampling.sample(logits, temperature, *args)
        want_t, want_lp = reference(logits, temperature, seeds, 2)
        assert tokens.tolist() == want_t.tolist() and torch.allclose(logprobs, want_lp)
    assert calls == [1] and "PassManager::run failed" in caplog.text
    monkeypatch.setenv("LORABUS_FUSED_SAMPLER", "0")
    monkeypatch.setattr(sampling, "_FUSED_BROKEN", [])
    assert not sampling.fused_sampler_available(torch.device("cuda"))
