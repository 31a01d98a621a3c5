import asyncio
import copy
import threading

import pytest
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

from proto.messages import LoraSpec
from services.common import adapter_io
from services.common.lora_targets import HF_LINEAR
from services.rollout.engines import embedded
from services.rollout.engines.base import GenRequest
from services.rollout.engines.embedded import EmbeddedEngine
from services.rollout.sampling import DecodeGraphs
from tests.fixtures.tiny import tiny_qwen2

TARGETS = list(HF_LINEAR)
RANK, ALPHA, EOS = 4, 8.0, 96
SPEC = LoraSpec(rank=RANK, alpha=ALPHA, target_modules=TARGETS, base_model="tiny")


def tiny_model():
    return tiny_qwen2()


def peft_adapter(base, seed: int):
    """A trained-looking adapter (B != 0) made with peft; returns (peft model, bytes)."""
    torch.manual_seed(seed)
    cfg = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, init_lora_weights=False)
    peft_model = get_peft_model(copy.deepcopy(base), cfg).eval()
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.mul_(0.5)
    state = {adapter_io.standardize_key(k): v for k, v in get_peft_model_state_dict(peft_model).items()}
    return peft_model, adapter_io.to_bytes(state)


@pytest.fixture(scope="module")
def parts():
    base = tiny_model()
    return base, [peft_adapter(base, seed=10 + v) for v in range(2)]


def make_engine(base) -> EmbeddedEngine:
    return EmbeddedEngine(copy.deepcopy(base), eos_ids=[EOS], pad_id=0, slots=3)


def assert_same(got, want):
    """Same tokens and finish reasons; logprobs equal up to the float rounding of another
    batch shape or of merged-vs-corrected weights."""
    for group_a, group_b in zip(got, want, strict=True):
        for a, b in zip(group_a, group_b, strict=True):
            assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


REQS = [
    GenRequest(prompt_token_ids=[5, 6, 7, 8, 9], n=2, max_new_tokens=12, temperature=0.7, seed=1),
    GenRequest(prompt_token_ids=[11, 12], n=1, max_new_tokens=9, temperature=1.3, top_p=0.9, seed=2),
    GenRequest(prompt_token_ids=[40], n=1, max_new_tokens=12, temperature=1.0, top_k=7, seed=3),
]


async def test_deterministic_with_a_seed(parts):
    base, adapters = parts
    engine = make_engine(base)
    await engine.load_version(0, adapters[0][1], SPEC)
    first = await engine.generate(REQS, 0)
    again = await engine.generate(REQS, 0)
    assert first == again
    assert [len(r) for r in first] == [2, 1, 1]
    assert first[0][0].token_ids != first[0][1].token_ids  # the n completions differ
    reseeded = await engine.generate([GenRequest(**{**_fields(REQS[0]), "seed": 99})], 0)
    assert reseeded[0][0].token_ids != first[0][0].token_ids


def _fields(req: GenRequest) -> dict:
    return {f: getattr(req, f) for f in req.__struct_fields__}


async def test_logprobs_equal_a_separate_forward(parts):
    base, adapters = parts
    engine = make_engine(base)
    await engine.load_version(0, adapters[0][1], SPEC)
    await engine.load_version(1, adapters[1][1], SPEC)
    # version 0 is not the head: its rows run through the low-rank correction
    for version in (0, 1):
        results = await engine.generate(REQS, version)
        reference = adapters[version][0]
        for req, group in zip(REQS, results):
            for res in group:
                assert res.token_ids and len(res.logprobs) == len(res.token_ids)
                ids = torch.tensor([req.prompt_token_ids + res.token_ids])
                with torch.no_grad():
                    logits = reference(input_ids=ids).logits[0].float()
                p = len(req.prompt_token_ids)
                logp = (logits[p - 1 : -1] / req.temperature).log_softmax(-1)
                want = logp.gather(-1, torch.tensor(res.token_ids)[:, None])[:, 0]
                torch.testing.assert_close(torch.tensor(res.logprobs), want, atol=1e-4, rtol=0)
                if res.finish_reason == "stop":
                    assert res.token_ids[-1] == EOS
                else:
                    assert len(res.token_ids) == req.max_new_tokens


async def test_mixed_batch_equals_separate_batches(parts):
    base, adapters = parts
    engine = make_engine(base)
    await engine.load_version(0, adapters[0][1], SPEC)
    await engine.load_version(1, adapters[1][1], SPEC)
    mixed = await engine.generate_mixed(REQS, [1, 0, 1])
    for i, version in enumerate([1, 0, 1]):
        alone = (await engine.generate([REQS[i]], version))[0]
        assert_same([mixed[i]], [alone])


async def test_calls_made_at_once_decode_as_one_batch(parts):
    base, adapters = parts
    engine = make_engine(base)
    await engine.load_version(0, adapters[0][1], SPEC)
    await engine.load_version(1, adapters[1][1], SPEC)
    start = engine.steps
    want = await engine.generate_mixed(REQS, [1, 0, 1])
    one_batch = engine.steps - start
    # what the rollout service does with a batch on two versions (and a fleet's replica with
    # its runs' batches): one call each, all at once
    start = engine.steps
    on_1, on_0 = await asyncio.gather(engine.generate([REQS[0], REQS[2]], 1), engine.generate([REQS[1]], 0))
    assert engine.steps - start == one_batch
    assert_same([on_1[0], on_0[0], on_1[1]], want)
    assert not engine._active[0] and not engine._active[1]


async def test_a_graphed_batch_is_padded_to_its_size_class_and_answers_as_unpadded(parts):
    base, adapters = parts
    plain, padded = make_engine(base), make_engine(base)
    # the static path a GPU captures, run eagerly, with the GPU's size classes
    padded.graphs = DecodeGraphs(padded.model, capture=False, pad_batches=True)
    for engine in (plain, padded):
        await engine.load_version(0, adapters[0][1], SPEC)
        await engine.load_version(1, adapters[1][1], SPEC)
    five_rows = [*REQS, GenRequest(prompt_token_ids=[7, 8], n=1, max_new_tokens=5, seed=4)]
    assert_same(
        await padded.generate_mixed(five_rows, [1, 0, 1, 0]), await plain.generate_mixed(five_rows, [1, 0, 1, 0])
    )
    assert [state.key[0] for state in padded.graphs._idle] == [6]
    three_rows = five_rows[1:3] + five_rows[3:]
    assert_same(await padded.generate_mixed(three_rows, [0, 0, 1]), await plain.generate_mixed(three_rows, [0, 0, 1]))
    assert [state.key[0] for state in padded.graphs._idle] == [6, 3]
    want = {1: 1, 2: 2, 3: 3, 5: 6, 7: 8, 9: 12, 33: 48, 48: 48, 49: 64, 64: 64, 65: 96}  # 2^k or 3 * 2^k
    assert {n: padded.graphs.batch_size(n) for n in want} == want


async def test_a_call_made_while_a_batch_decodes_does_not_wait_for_it(parts, monkeypatch):
    base, adapters = parts
    engine = make_engine(base)
    await engine.load_version(0, adapters[0][1], SPEC)
    started, release = threading.Event(), threading.Event()
    decode = embedded.decode

    def held(model, rows, **kwargs):  # the long batch waits, once begun, until the short one is answered
        if rows[0].max_new_tokens == 50:
            started.set()
            assert release.wait(30)
        return decode(model, rows, **kwargs)

    monkeypatch.setattr(embedded, "decode", held)
    long = asyncio.create_task(engine.generate([GenRequest(prompt_token_ids=[3, 4], n=1, max_new_tokens=50)], 0))
    assert await asyncio.to_thread(started.wait, 30)
    short = await asyncio.wait_for(engine.generate([GenRequest(prompt_token_ids=[5], n=1, max_new_tokens=2)], 0), 30)
    assert len(short[0][0].token_ids) <= 2 and not long.done()
    release.set()
    assert len((await long)[0][0].token_ids) <= 50


async def test_version_loaded_mid_generation_keeps_in_flight_outputs(parts):
    base, adapters = parts
    long = [GenRequest(prompt_token_ids=[3, 4, 5], n=3, max_new_tokens=60, seed=7)]
    undisturbed_engine = make_engine(base)
    await undisturbed_engine.load_version(0, adapters[0][1], SPEC)
    want = await undisturbed_engine.generate(long, 0)

    engine = make_engine(base)
    await engine.load_version(0, adapters[0][1], SPEC)
    running = asyncio.create_task(engine.generate(long, 0))
    while engine.steps < 3:
        await asyncio.sleep(0.001)
    await engine.load_version(1, adapters[1][1], SPEC)
    loaded_at = engine.steps
    assert not running.done(), "v1 should have been loaded while v0 was generating"
    got = await running
    assert loaded_at < engine.steps
    # v0 went from merged to corrected mid-way: same tokens, logprobs up to float rounding
    assert_same(got, want)
    assert engine.slots.head == 1
    start = engine.steps
    task = asyncio.create_task(engine.generate(long, 0))
    while engine.steps < start + 3:
        await asyncio.sleep(0.001)
    with pytest.raises(RuntimeError, match="running generation"):
        await engine.unload_version(0)
    await task
    await engine.unload_version(0)
    assert await engine.loaded_versions() == [1]


async def test_bad_requests_and_versions_are_refused(parts):
    base, adapters = parts
    engine = make_engine(base)
    await engine.load_version(0, adapters[0][1], SPEC)
    with pytest.raises(KeyError, match="version 5 is not loaded"):
        await engine.generate(REQS, 5)
    with pytest.raises(ValueError, match="rank"):
        await engine.load_version(
            1, adapters[1][1], LoraSpec(rank=8, alpha=8.0, target_modules=TARGETS, base_model="tiny")
        )
    with pytest.raises(ValueError, match="top_p"):
        GenRequest(prompt_token_ids=[1], top_p=0.0)
    vocab = base.config.vocab_size
    with pytest.raises(ValueError, match=rf"requests\[1\].prompt_token_ids: token id {vocab} is outside"):
        await engine.generate([REQS[0], GenRequest(prompt_token_ids=[3, vocab])], 0)
    # a bad call made beside good ones fails alone
    good, bad = await asyncio.gather(
        engine.generate(REQS, 0), engine.generate([GenRequest(prompt_token_ids=[-1])], 0), return_exceptions=True
    )
    assert isinstance(bad, ValueError) and [len(r) for r in good] == [2, 1, 1]


# --- continuous batching (rollout.slab_rows) ---


async def test_a_slab_engine_answers_as_the_batch_engine_also_with_calls_that_overlap(parts):
    base, adapters = parts
    batch_engine = make_engine(base)
    slab_engine = EmbeddedEngine(copy.deepcopy(base), eos_ids=[EOS], pad_id=0, slots=3, slab_rows=3, slab_length=40)
    try:
        for engine in (batch_engine, slab_engine):
            await engine.load_version(0, adapters[0][1], SPEC)
            await engine.load_version(1, adapters[1][1], SPEC)
        want = await batch_engine.generate_mixed(REQS, [1, 0, 1])
        assert_same(await slab_engine.generate_mixed(REQS, [1, 0, 1]), want)
        # two callers at once: 4 rows for a slab of 3, so the later group joins as rows free up
        first, second = await asyncio.gather(
            slab_engine.generate_mixed(REQS[:1], [1]), slab_engine.generate_mixed(REQS[1:], [0, 1])
        )
        assert_same(first + second, want)
        with pytest.raises(ValueError, match="more than the slab's length 40"):
            await slab_engine.generate([GenRequest(prompt_token_ids=[1] * 30, n=1, max_new_tokens=20)], 0)
    finally:
        await slab_engine.close()
    assert slab_engine._decoder_thread is not None and not slab_engine._decoder_thread.is_alive()


@pytest.mark.parametrize("slab_rows", [0, 2], ids=["batch", "slab"])
async def test_a_caller_that_stops_waiting_keeps_its_version_in_use_until_its_rows_end(parts, slab_rows):
    base, adapters = parts
    engine = EmbeddedEngine(copy.deepcopy(base), eos_ids=[], pad_id=0, slots=3, slab_rows=slab_rows, slab_length=200)
    try:
        await engine.load_version(0, adapters[0][1], SPEC)
        await engine.load_version(1, adapters[1][1], SPEC)
        task = asyncio.create_task(engine.generate([GenRequest(prompt_token_ids=[3, 4], n=2, max_new_tokens=150)], 0))
        while engine.steps < 3:
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        with pytest.raises(RuntimeError, match="running generation"):
            await engine.unload_version(0)  # its rows still decode on v0's slot
        while engine._active[0]:
            await asyncio.sleep(0.01)
        await engine.unload_version(0)
        assert await engine.loaded_versions() == [1]
        out = await engine.generate([GenRequest(prompt_token_ids=[5], n=1, max_new_tokens=4)], 1)
        assert len(out[0][0].token_ids) == 4
    finally:
        await engine.close()
