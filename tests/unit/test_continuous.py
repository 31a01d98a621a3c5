"""Continuous batching on CPU (the decode step eager; on a GPU the same step is graphed): each
row's tokens and logprobs are those it gets decoded alone, however the slab is shared and
whenever its group was admitted; groups larger than the free rows wait; errors reach callers."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch

from services.rollout.continuous import ContinuousDecoder, Group
from services.rollout.lora_slots import LoraSlots
from services.rollout.sampling import Row, RowOutput, decode
from tests.fixtures.tiny import merged_reference, random_lora, tiny_qwen2

pytestmark = pytest.mark.unit


def solo(model, row: Row) -> RowOutput:
    return decode(model, [row])[0]


def same(a: RowOutput, b: RowOutput) -> None:
    assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
    torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


class Running:
    """A decoder on its thread, and the answers its groups got."""

    def __init__(self, model, rows=4, length=48, step_context=None, free_version=lambda: 0, check_every=4, chunk=0):
        ctx = step_context or (lambda versions: contextlib.nullcontext(False))
        self.decoder = ContinuousDecoder(
            model, rows=rows, length=length, step_context=ctx, free_version=free_version, capture=False,
            check_every=check_every, prefill_chunk=chunk,
        )  # fmt: skip
        self.thread = threading.Thread(target=self.decoder.run, daemon=True)
        self.thread.start()

    def submit(self, rows, version=0) -> threading.Event:
        done = threading.Event()
        done.result = None  # type: ignore[attr-defined]

        def answer(result):
            done.result = result  # type: ignore[attr-defined]
            done.set()

        self.decoder.submit(Group(rows=rows, version=version, done=answer))
        return done

    def close(self):
        self.decoder.close()
        self.thread.join(10)
        assert not self.thread.is_alive()


def group_rows(prompt, n, new_tokens, seed, **kw) -> list[Row]:
    return [Row(prompt=prompt, max_new_tokens=new_tokens, temperature=1.0, seed=seed + j, **kw) for j in range(n)]


def test_every_row_is_its_solo_decode_with_more_groups_than_the_slab_holds():
    model = tiny_qwen2(seed=2, vocab_size=61)
    groups = [
        group_rows([5, 6, 7], 2, 12, seed=1),
        group_rows([9] * 6, 1, 5, seed=10, stop_ids=(3, 4)),  # may stop early: frees its row sooner
        group_rows([1, 2], 3, 9, seed=20),
        group_rows([40, 41, 42, 43, 44], 2, 15, seed=30, top_p=0.8),
        group_rows([3], 1, 1, seed=40),  # one token only: done at its prefill
        group_rows([7, 8], 4, 6, seed=50, top_k=5),  # a whole slab's worth: waits for every row
    ]
    run = Running(model, rows=4, length=32, check_every=3)
    try:
        waits = [run.submit(rows) for rows in groups]
        for w in waits:
            assert w.wait(60)
    finally:
        run.close()
    for rows, w in zip(groups, waits):
        assert isinstance(w.result, list) and len(w.result) == len(rows)
        for row, out in zip(rows, w.result):
            same(out, solo(model, row))
    assert run.decoder.steps_run > 0


def test_a_group_admitted_mid_generation_and_rows_on_different_versions():
    base = tiny_qwen2(seed=4, vocab_size=61)
    pristine = tiny_qwen2(seed=4, vocab_size=61)
    adapters = {v: random_lora(base, seed=v, rank=4, std=0.2) for v in (1, 2)}
    slots = LoraSlots.install(base, adapters[1], slots=3)
    for v, a in adapters.items():
        slots.load(v, a, 2.0)
    slots.set_head(2)
    run = Running(base, rows=3, length=40, step_context=slots.route, free_version=lambda: slots.head)
    try:
        first = run.submit(group_rows([5, 6, 7, 8], 2, 20, seed=3), version=1)
        while run.decoder.steps_run < 5 and not first.is_set():
            time.sleep(0.001)
        assert not first.is_set()  # the second group joins a running decode
        second = run.submit(group_rows([11, 12], 1, 8, seed=9), version=2)
        assert first.wait(60) and second.wait(60)
    finally:
        run.close()
    cases = ((1, first, group_rows([5, 6, 7, 8], 2, 20, seed=3)), (2, second, group_rows([11, 12], 1, 8, seed=9)))
    for version, w, rows in cases:
        want = merged_reference(pristine, adapters[version], 2.0)
        for row, out in zip(rows, w.result):
            same(out, solo(want, row))


@pytest.mark.parametrize("chunk", [1, 3, 5])
def test_a_prompt_prefilled_in_chunks_decodes_as_its_solo_run(chunk: int):
    model = tiny_qwen2(seed=6, vocab_size=61)
    groups = [
        group_rows(list(range(3, 14)), 2, 10, seed=1),  # 11 tokens: several chunks, a short last one
        group_rows([7, 8, 9], 1, 6, seed=5),  # shorter than a chunk of 5: one forward
        group_rows(list(range(20, 35)), 3, 8, seed=9, top_k=7),  # waits for rows, then chunks
    ]
    run = Running(model, rows=4, length=48, check_every=2, chunk=chunk)
    try:
        waits = [run.submit(rows) for rows in groups]
        for w in waits:
            assert w.wait(60)
    finally:
        run.close()
    for rows, w in zip(groups, waits):
        assert isinstance(w.result, list)
        for row, out in zip(rows, w.result):
            same(out, solo(model, row))
    assert run.decoder.prefill_forwards == sum(-(-len(rows[0].prompt) // chunk) for rows in groups)


def test_decoding_rows_go_on_between_the_chunks_of_a_long_prompt():
    model = tiny_qwen2(seed=7, vocab_size=61)
    calls: list[str] = []
    both_queued = threading.Event()

    def log(versions):
        both_queued.wait(30)  # so the first group cannot finish before the second arrives
        calls.append("prefill" if len(versions) == 1 else "decode")
        return contextlib.nullcontext(False)

    run = Running(model, rows=3, length=64, step_context=log, check_every=2, chunk=4)
    try:
        first = run.submit(group_rows([5, 6], 1, 30, seed=2))
        second = run.submit(group_rows(list(range(1, 17)), 2, 4, seed=4))  # 16 tokens: 4 chunks
        both_queued.set()
        assert first.wait(60) and second.wait(60)
    finally:
        run.close()
    chunks = [i for i, c in enumerate(calls) if c == "prefill"][1:]  # the second group's
    assert len(chunks) == 4
    # the first group decoded between every two chunks: never a whole prefill in a row
    assert all("decode" in calls[a:b] for a, b in zip(chunks, chunks[1:]))
    assert isinstance(first.result, list) and isinstance(second.result, list)
    same(first.result[0], solo(model, group_rows([5, 6], 1, 30, seed=2)[0]))
    for row, out in zip(group_rows(list(range(1, 17)), 2, 4, seed=4), second.result):
        same(out, solo(model, row))


def test_bad_groups_are_refused_at_submit_and_a_failing_step_answers_every_caller():
    model = tiny_qwen2(seed=1, vocab_size=61)
    decoder = ContinuousDecoder(
        model, rows=2, length=16, step_context=lambda v: contextlib.nullcontext(False), free_version=lambda: 0,
        capture=False,
    )  # fmt: skip
    with pytest.raises(ValueError, match="more than the slab's 2"):
        decoder.submit(Group(rows=group_rows([1], 3, 4, seed=0), version=0, done=print))
    with pytest.raises(ValueError, match="more than the slab's length 16"):
        decoder.submit(Group(rows=group_rows([1] * 10, 1, 7, seed=0), version=0, done=print))
    with pytest.raises(ValueError, match="differs from rows"):
        two_prompts = [Row(prompt=[1], max_new_tokens=2), Row(prompt=[2], max_new_tokens=2)]
        decoder.submit(Group(rows=two_prompts, version=0, done=print))

    def failing(versions):
        if len(versions) == 2:  # decode steps fail, prefills pass
            raise RuntimeError("device lost")
        return contextlib.nullcontext(False)

    run = Running(model, rows=2, length=16, step_context=failing)
    try:
        waits = [run.submit(group_rows([4, 5], 1, 6, seed=s)) for s in (1, 2, 3)]
        for w in waits:
            assert w.wait(30)
            assert isinstance(w.result, RuntimeError) and "device lost" in str(w.result)
    finally:
        run.close()
