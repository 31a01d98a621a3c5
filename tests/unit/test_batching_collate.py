"""`batching.collate`: the same tensors as filling each row in turn, in a fixed number of tensor
operations whatever the micro-batch's size (the step thread collates every micro-batch twice a
step while holding the GIL; a fleet's joint step collates every run's rows)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from services.trainer import batching
from services.trainer.batching import MicroBatch, Sample, collate


def _row_by_row(samples: list[Sample], pad_id: int = 0) -> MicroBatch:
    """The per-row fill `collate` replaced (its reference)."""
    length = max(len(s.input_ids) for s in samples)
    first_target = min(s.prompt_len for s in samples)
    b, width = len(samples), length - first_target
    input_ids = torch.full((b, length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((b, length), dtype=torch.long)
    weights, behave, advantages = torch.zeros((b, width)), torch.zeros((b, width)), torch.zeros((b, width))
    versions = torch.zeros((b, width), dtype=torch.long)
    for i, s in enumerate(samples):
        n = len(s.input_ids)
        input_ids[i, :n] = torch.tensor(s.input_ids)
        attention_mask[i, :n] = 1
        lo, hi = s.prompt_len - first_target, n - first_target
        weights[i, lo:hi] = s.token_weight
        behave[i, lo:hi] = torch.tensor(s.behave_logprobs)
        versions[i, lo:hi] = torch.tensor(s.versions)
        advantages[i, lo:hi] = s.advantage
    groups = torch.tensor([s.group for s in samples], dtype=torch.long)
    return MicroBatch(input_ids=input_ids, attention_mask=attention_mask, targets=input_ids[:, first_target:],
                      loss_weights=weights, behave_logprobs=behave, versions=versions, advantages=advantages,
                      groups=groups)  # fmt: skip


def _samples(n: int, seed: int = 0) -> list[Sample]:
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        prompt, new = rnd.randint(1, 9), rnd.randint(1, 7)
        out.append(
            Sample(
                input_ids=[rnd.randrange(1, 50_000) for _ in range(prompt + new)],
                prompt_len=prompt,
                behave_logprobs=[-rnd.random() * 5 for _ in range(new)],
                versions=[rnd.randint(0, 2**40) for _ in range(new)],
                advantage=rnd.gauss(0.0, 1.0),
                token_weight=0.0 if i % 5 == 4 else 1.0 / rnd.randint(1, 300),  # a filler's weight is 0
                group=i // 3,
            )
        )
    return out


@pytest.mark.parametrize(("n", "pad_id"), [(1, 0), (2, 0), (7, 3), (64, 0), (129, 151_643)])
def test_collate_equals_the_row_by_row_fill(n: int, pad_id: int) -> None:
    samples = _samples(n, seed=n)
    got, want = collate(samples, pad_id), _row_by_row(samples, pad_id)
    for name in ("input_ids", "attention_mask", "targets", "loss_weights", "behave_logprobs", "versions",
                 "advantages", "groups"):  # fmt: skip
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), name
    assert got.logits_to_keep == want.logits_to_keep


def test_collate_makes_as_many_tensors_for_64_rows_as_for_4(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its cost must not grow by a handful of tensor ops per row."""
    made = {"n": 0}
    real = torch.tensor

    def counting(*args, **kwargs):
        made["n"] += 1
        return real(*args, **kwargs)

    def count(samples: list[Sample]) -> int:
        made["n"] = 0
        collate(samples)
        return made["n"]

    monkeypatch.setattr(batching.torch, "tensor", counting)
    assert count(_samples(64)) == count(_samples(4))


def test_collate_refuses_a_sample_whose_per_token_lists_do_not_match_its_completion() -> None:
    [s] = _samples(1)
    with pytest.raises(ValueError, match="behaviour logprobs"):
        collate([replace(s, behave_logprobs=s.behave_logprobs[:-1])])
