"""The SGLang engine against the SGLang 0.5.23 protocol server (tests/fixtures/sglang_server.py),
which generates with the real peft adapter read from the path it is given."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from services.common import models
from services.rollout.engines.base import GenRequest
from services.rollout.engines.http import AdapterDirs, AdapterError, Http, VersionNotLoaded
from services.rollout.engines.sglang import SglangEngine
from tests.fixtures.sglang_server import INCOMPATIBLE, ServerArgs, SglangProtocolServer
from tests.fixtures.vllm import TINY_MODEL, make_adapter

LORA = "tiny_lora"


@pytest.fixture(scope="module")
def tok():
    return models.load_tokenizer(TINY_MODEL)


@pytest.fixture
async def start(tmp_path):
    """`start(**server_args) -> (server, engine)`; everything stopped afterwards."""
    made = []

    async def go(port: int = 0, **kw):
        server = SglangProtocolServer(ServerArgs(model_path=str(TINY_MODEL), **kw))
        url = await server.start(port=port)
        engine = SglangEngine(
            [url], AdapterDirs(LORA, tmp_path / "adapters"), http=Http(timeout_s=60, attempts=2, backoff_s=0.01)
        )
        made.append((server, engine))
        return server, engine

    yield go
    for server, engine in made:
        await engine.close()
        await server.stop()


def ids(tok, text: str) -> list[int]:
    return models.encode_prompt(tok, text)


def reference_logprobs(adapter_dir, prompt, completion, temperature):
    from peft import PeftModel

    model = PeftModel.from_pretrained(models.load_base_model(TINY_MODEL), str(adapter_dir)).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
    lp = torch.log_softmax(logits.double() / (temperature if temperature > 0 else 1.0), -1)
    return lp.gather(1, torch.tensor(completion)[:, None])[:, 0].tolist()


async def test_load_generate_unload_with_genuine_logprobs(start, tok):
    server, engine = await start(max_lora_rank=16)
    w, spec = make_adapter(rank=8, seed=4, scale=3.0)
    await engine.load_version(1, w, spec)
    assert await engine.loaded_versions() == [1]
    assert server.loaded_adapters() == {f"{LORA}-v1": engine.dirs.server(1)}
    assert await engine.health()
    prompt = ids(tok, "12+34=")
    for temperature in (0.0, 0.8):
        out = await engine.generate(
            [GenRequest(prompt_token_ids=prompt, n=3, max_new_tokens=5, temperature=temperature, seed=9)], 1
        )
        assert len(out) == 1 and len(out[0]) == 3
        for r in out[0]:
            ref = reference_logprobs(engine.dirs.local(1), prompt, r.token_ids, temperature)
            assert r.logprobs == pytest.approx(ref, abs=1e-4)
            assert r.finish_reason in ("stop", "length")
    again = await engine.generate(
        [GenRequest(prompt_token_ids=prompt, n=3, max_new_tokens=5, temperature=0.8, seed=9)], 1
    )
    assert [c.token_ids for c in again[0]] == [c.token_ids for c in out[0]]

    await engine.unload_version(1)
    assert server.loaded_adapters() == {} and not engine.dirs.local(1).exists()
    with pytest.raises(VersionNotLoaded):
        await engine.generate([GenRequest(prompt_token_ids=prompt)], 1)
    await engine.unload_version(1)  # not registered any more: already reached


async def test_load_failures_carry_sglangs_message(start, tmp_path):
    server, engine = await start(max_lora_rank=8, max_loaded_loras=2, max_loras_per_batch=2)
    big, big_spec = make_adapter(rank=16, seed=1)
    with pytest.raises(AdapterError, match=f"rank 16 {INCOMPATIBLE}"):
        await engine.load_version(1, big, big_spec)

    w, spec = make_adapter(rank=8, seed=2)
    await engine.load_version(2, w, spec)
    await engine.load_version(2, w, spec)  # ours, same path: idempotent
    await engine.load_version(3, *make_adapter(rank=8, seed=3))
    with pytest.raises(AdapterError, match="Maximum number of loaded LoRA adapters is 2"):
        await engine.load_version(4, *make_adapter(rank=8, seed=4))
    await engine.unload_version(3)

    # the name registered by someone else from another path is not our version
    from services.common import adapter_io

    adapter_io.write_peft_dir(tmp_path / "other", w, spec)
    await engine.http.post(
        f"{engine.urls[0]}/load_lora_adapter", {"lora_name": f"{LORA}-v5", "lora_path": str(tmp_path / "other")}
    )
    with pytest.raises(AdapterError, match="because it is already loaded.*it serves"):
        await engine.load_version(5, w, spec)

    # modules outside --lora-target-modules; dynamic loading with dp_size 2
    _, narrow = await start(max_lora_rank=16, lora_target_modules=["q_proj", "v_proj"])
    with pytest.raises(AdapterError, match=INCOMPATIBLE):
        await narrow.load_version(6, *make_adapter(rank=8, seed=6))
    _, dp = await start(dp_size=2)
    with pytest.raises(AdapterError, match="dp_size must be 1 for dynamic lora loading"):
        await dp.load_version(7, *make_adapter(rank=8, seed=7))


async def test_evicted_adapter_comes_back_silently(start, tok):
    server, engine = await start(max_loras_per_batch=1, max_loaded_loras=3)
    await engine.load_version(1, *make_adapter(rank=8, seed=1, scale=3.0))
    await engine.load_version(2, *make_adapter(rank=8, seed=2, scale=3.0))  # evicts v1 from the pool
    req = [GenRequest(prompt_token_ids=ids(tok, "7-5="), max_new_tokens=5, temperature=0.0)]
    assert f"{LORA}-v1" not in server.pool
    first = await engine.generate(req, 1)  # reloads v1 from its path, evicting v2
    assert server.reloads[f"{LORA}-v1"] == 1
    v2 = await engine.generate(req, 2)
    again = await engine.generate(req, 1)
    assert server.reloads[f"{LORA}-v1"] == 2
    assert again[0][0].token_ids == first[0][0].token_ids and again[0][0].logprobs == first[0][0].logprobs
    assert v2[0][0].logprobs != first[0][0].logprobs
    assert await engine.missing_versions() == {}  # evicted is not forgotten


async def test_unload_waits_for_inflight_requests(start, tok):
    server, engine = await start()
    await engine.load_version(1, *make_adapter(rank=8, seed=1, scale=3.0))
    long = GenRequest(
        prompt_token_ids=ids(tok, "12+34="), max_new_tokens=100, temperature=1.0, stop_token_ids=[], seed=1
    )
    done = {}

    async def gen():
        out = await engine.generate([long], 1)
        done["gen"] = time.monotonic()
        return out

    task = asyncio.create_task(gen())
    while not server.registry.get(f"{LORA}-v1") or not server.registry[f"{LORA}-v1"].holders:
        await asyncio.sleep(0.005)
    await engine.unload_version(1)
    done["unload"] = time.monotonic()
    out = await task
    assert out[0][0].token_ids, "the in-flight request was cut off"
    assert done["gen"] <= done["unload"]


async def test_restarted_server_is_noticed_and_reloaded(start, tok):
    server, engine = await start()
    await engine.load_version(1, *make_adapter(rank=8, seed=1, scale=3.0))
    await engine.load_version(2, *make_adapter(rank=8, seed=2, scale=3.0))
    req = [GenRequest(prompt_token_ids=ids(tok, "40+40="), max_new_tokens=5, temperature=0.0)]
    before = await engine.generate(req, 2)
    port = server.port
    await server.stop()
    assert not await engine.health()
    fresh = SglangProtocolServer(ServerArgs(model_path=str(TINY_MODEL)))
    await fresh.start(port=port)
    try:
        assert await engine.health()
        assert await engine.reload_missing(admissible={2}) == [2]
        assert await engine.loaded_versions() == [2]
        assert fresh.loaded_adapters() == {f"{LORA}-v2": engine.dirs.server(2)}
        assert not engine.dirs.local(1).exists()
        after = await engine.generate(req, 2)
        assert after[0][0].token_ids == before[0][0].token_ids
    finally:
        await fresh.stop()
