"""Routing as data (the sign mask) and the static-cache decode path that CUDA graphs capture.

The static path runs here eagerly (`DecodeGraphs(capture=False)`): the very forward that a
graph would record, with the same buffers, cache rewinds and per-variant bookkeeping; only the
capture/replay itself needs a GPU (benchmarks/embedded_engine.py covers it there)."""

import copy
import itertools

import pytest
import torch

from services.common.lora_targets import HF_LINEAR
from services.rollout.lora_slots import LoraSlots
from services.rollout.sampling import DecodeGraphs, Row, decode, static_unsupported
from tests.fixtures.tiny import merged_reference, random_lora, tiny_qwen2

TARGETS = HF_LINEAR
RANK, SCALE, VOCAB = 4, 2.0, 97


def tiny_model(**over):
    return tiny_qwen2(vocab_size=VOCAB, **over)


def random_adapter(model, seed: int) -> dict[str, torch.Tensor]:
    return random_lora(model, seed, RANK, 0.2, TARGETS)


def merged(base, adapter: dict[str, torch.Tensor]):
    return merged_reference(base, adapter, SCALE)


def rows_of(prompts, new_tokens=9, stop=()):
    return [
        Row(prompt=p, max_new_tokens=new_tokens + i % 3, temperature=1.0, seed=7 * i, stop_ids=stop)
        for i, p in enumerate(prompts)
    ]


PROMPTS = [[5, 6, 7], [9] * 6, [1, 2], [40, 41, 42, 43, 44], [3]]  # left padding of 0..5


def assert_same_outputs(got, want):
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


@pytest.fixture
def pool():
    base = tiny_model()
    pristine = copy.deepcopy(base)
    adapters = {v: random_adapter(base, seed=200 + v) for v in range(4)}
    slots = LoraSlots.install(base, adapters[0], slots=4)
    for v in range(3):
        slots.load(v, adapters[v], SCALE)
    slots.set_head(2)
    return base, pristine, adapters, slots


def test_sign_mask_marks_own_slot_plus_and_head_slot_minus(pool):
    _, _, _, slots = pool
    assert slots.columns([2, 2, 2]) is None  # all on the head: no correction at all
    cols = slots.columns([0, 2, 1])
    blocks = cols.view(3, slots.table.slots, RANK)
    assert (blocks == blocks[:, :, :1]).all()  # one sign per (row, slot) block
    signs = blocks[:, :, 0]
    s0, s1, s2 = (slots.table.slot_of(v) for v in (0, 1, 2))
    want = torch.zeros(3, slots.table.slots)
    want[0, s0], want[0, s2] = 1, -1
    want[2, s1], want[2, s2] = 1, -1
    assert torch.equal(signs, want)


def test_mask_buffer_is_stable_per_batch_size_and_follows_head_changes(pool):
    _, _, adapters, slots = pool
    first = slots.columns([0, 2, 1])
    ptr = first.data_ptr()
    assert slots.columns([1, 1, 0]).data_ptr() == ptr  # rewritten in place (graph inputs)
    assert slots.columns([1, 1]).data_ptr() != ptr  # another batch size, another buffer
    slots.load(3, adapters[3], SCALE)
    slots.set_head(3)
    signs = slots.columns([1, 1, 0]).view(3, slots.table.slots, RANK)[:, :, 0]
    assert signs[0, slots.table.slot_of(3)] == -1 and signs[2, slots.table.slot_of(0)] == 1
    assert signs[:, slots.table.slot_of(2)].eq(0).all()  # the old head is a plain slot now


def test_unordered_mixed_rows_match_each_versions_merged_model(pool):
    """Rows need not be grouped by version (the mask has no spans)."""
    base, pristine, adapters, slots = pool
    ids = torch.randint(0, VOCAB, (6, 5), generator=torch.Generator().manual_seed(3))
    row_versions = [1, 2, 0, 1, 2, 0]
    with torch.no_grad(), slots.route(row_versions) as corrected:
        got = base(input_ids=ids).logits
    assert corrected
    for row, v in enumerate(row_versions):
        with torch.no_grad():
            want = merged(pristine, adapters[v])(input_ids=ids[row : row + 1]).logits[0]
        torch.testing.assert_close(got[row], want, atol=1e-5, rtol=1e-5)


def test_static_decode_equals_dynamic_decode_and_reuses_its_state():
    model = tiny_model()
    rows = rows_of(PROMPTS, stop=(11, 12))
    want = decode(model, rows)
    graphs = DecodeGraphs(model, capture=False)
    assert_same_outputs(decode(model, rows, graphs=graphs), want)
    state = graphs._idle[0]
    again = decode(model, rows, graphs=graphs)  # same (batch, length): the cache is rewound
    assert graphs._idle == [state]
    assert_same_outputs(again, want)
    fewer = rows_of(PROMPTS[:3], new_tokens=30)  # other batch size and cache length
    assert_same_outputs(decode(model, fewer, graphs=graphs), decode(model, fewer))
    assert len(graphs._idle) == 2


def test_idle_static_caches_are_kept_within_their_byte_budget_and_the_last_always():
    """A fleet replica's rounds cycle through many batch classes: every idle cache that fits the
    budget is kept (each dropped one is a capture to make again), the most recent first, and the
    last released even where it alone is over."""
    model = tiny_model()
    graphs = DecodeGraphs(model, capture=False)
    for batch in (1, 2, 3, 4, 6, 8):  # six classes: more than the four once kept
        decode(model, rows_of((PROMPTS * 2)[:batch], new_tokens=3), graphs=graphs)
    sizes = [state.nbytes() for state in graphs._idle]
    assert [state.key[0] for state in graphs._idle] == [1, 2, 3, 4, 6, 8] and min(sizes) > 0
    made = graphs.caches_made
    for batch in (1, 8, 3):  # each class again: no new cache
        decode(model, rows_of((PROMPTS * 2)[:batch], new_tokens=3), graphs=graphs)
    assert graphs.caches_made == made
    assert [state.key[0] for state in graphs._idle] == [2, 4, 6, 1, 8, 3]

    graphs.max_idle_bytes = sizes[-1] + sizes[2]  # the batch of 8's and the batch of 3's
    decode(model, rows_of((PROMPTS * 2)[:6], new_tokens=3), graphs=graphs)
    assert [state.key[0] for state in graphs._idle] == [3, 6]  # the most recent that fit
    graphs.max_idle_bytes = 0
    decode(model, rows_of((PROMPTS * 2)[:8], new_tokens=3), graphs=graphs)
    assert [state.key[0] for state in graphs._idle] == [8]  # over alone, kept: the last


def test_static_decode_with_mixed_versions_and_a_head_change_mid_generation(pool):
    """The variant flips from "all on head" to "corrected" between two steps when a new
    version becomes head, and every row keeps its own version throughout."""
    base, pristine, adapters, slots = pool
    rows = rows_of(PROMPTS[:4], new_tokens=12)
    graphs = DecodeGraphs(base, capture=False)
    want = [decode(merged(pristine, adapters[2]), [r])[0] for r in rows]
    steps = itertools.count()
    variants = []

    def step():
        if next(steps) == 4:
            slots.load(3, adapters[3], SCALE)
            slots.set_head(3)
        ctx = slots.route([2] * len(rows))
        return _Recording(ctx, variants)

    assert_same_outputs(decode(base, rows, step_context=step, graphs=graphs), want)
    assert variants[:4] == [False] * 4 and set(variants[4:]) == {True}
    mix = [0, 1, 2, 3]
    want = [decode(merged(pristine, adapters[v]), [r])[0] for v, r in zip(mix, rows)]
    assert_same_outputs(decode(base, rows, step_context=lambda: slots.route(mix), graphs=graphs), want)


class _Recording:
    def __init__(self, ctx, log):
        self.ctx, self.log = ctx, log

    def __enter__(self):
        variant = self.ctx.__enter__()
        self.log.append(variant)
        return variant

    def __exit__(self, *exc):
        return self.ctx.__exit__(*exc)


def test_static_path_refuses_what_it_cannot_run():
    sliding = tiny_model(use_sliding_window=True, sliding_window=4, max_window_layers=1)
    assert "full attention only" in static_unsupported(sliding)
    with pytest.raises(ValueError, match="static decoding: layer types"):
        DecodeGraphs(sliding, capture=False)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="capture: CUDA graphs need a CUDA device"):
            DecodeGraphs(tiny_model(), capture=True)


def test_stacked_correction_matches_the_reference_without_triton():
    """The stacked layout (A's rows under W in one buffer, one matmul for both) with the torch
    expand gives the reference's logits: the CPU path of the GPU default."""
    logits = {}
    for correction in ("torch", "stacked"):
        base = tiny_model()
        adapters = {v: random_adapter(base, seed=300 + v) for v in range(3)}
        slots = LoraSlots.install(base, adapters[0], slots=3, correction=correction)
        for v in range(3):
            slots.load(v, adapters[v], SCALE)
        slots.set_head(2)
        ids = torch.randint(0, VOCAB, (6, 4), generator=torch.Generator().manual_seed(3))
        with torch.no_grad(), slots.route([0, 1, 2, 0, 2, 1]):
            logits[correction] = base(input_ids=ids).logits
    torch.testing.assert_close(logits["stacked"], logits["torch"], atol=1e-5, rtol=1e-5)
    with torch.no_grad(), slots.route([2] * 6):
        assert (base(input_ids=ids).logits - logits["stacked"]).abs().max() > 1e-2  # rows were corrected
