"""The SGLang engine against the SGLang 0.5.17 protocol server (tests/fixtures/sglang_server.py),
which generates with the real peft adapter read from the path it is given: the load/unload
endpoints, `--max-loaded-loras`, and the refcount hazards (unload while requests are in flight,
aborted and timed-out requests, n > 1 sampling)."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from services.common import models
from services.rollout.engines.base import GenRequest
from services.rollout.engines.http import AdapterDirs, AdapterError, Http, ServerError, VersionNotLoaded
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

    async def go(port: int = 0, slots: int | None = None, timeout_s: float = 60, **kw):
        server = SglangProtocolServer(ServerArgs(model_path=str(TINY_MODEL), **kw))
        url = await server.start(port=port)
        engine = SglangEngine(
            [url],
            AdapterDirs(LORA, tmp_path / "adapters"),
            http=Http(timeout_s=timeout_s, attempts=2, backoff_s=0.01),
            slots=slots,
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
    server, engine = await start(max_lora_rank=8)
    big, big_spec = make_adapter(rank=16, seed=1)
    with pytest.raises(AdapterError, match=f"rank 16 {INCOMPATIBLE}"):
        await engine.load_version(1, big, big_spec)

    w, spec = make_adapter(rank=8, seed=2)
    await engine.load_version(2, w, spec)
    await engine.load_version(2, w, spec)  # ours, same path: idempotent

    # the name registered by someone else from another path is not our version
    from services.common import adapter_io

    adapter_io.write_peft_dir(tmp_path / "other", w, spec)
    await engine.http.post(
        f"{engine.urls[0]}/load_lora_adapter", {"lora_name": f"{LORA}-v5", "lora_path": str(tmp_path / "other")}
    )
    with pytest.raises(AdapterError, match="because it is already loaded.*it serves"):
        await engine.load_version(5, w, spec)

    # modules outside --lora-target-modules; dynamic loading with dp_size 2 (an assert: HTTP 500)
    _, narrow = await start(max_lora_rank=16, lora_target_modules=["q_proj", "v_proj"])
    with pytest.raises(AdapterError, match=INCOMPATIBLE):
        await narrow.load_version(6, *make_adapter(rank=8, seed=6))
    _, dp = await start(dp_size=2)
    with pytest.raises(AdapterError, match="HTTP 500"):
        await dp.load_version(7, *make_adapter(rank=8, seed=7))


async def test_max_loaded_loras_below_the_keep_window_is_a_config_error(start):
    server, engine = await start(max_loaded_loras=2, max_loras_per_batch=2, slots=3)
    with pytest.raises(
        AdapterError,
        match=r"sglang.max_loaded_loras: .* --max-loaded-loras 2, below rollout.lora_keep_versions \+ 1 = 3",
    ):
        await engine.load_version(1, *make_adapter(rank=8, seed=1))
    assert server.loaded_adapters() == {} and await engine.loaded_versions() == []


async def test_a_load_past_max_loaded_loras_is_refused_not_left_to_sglangs_lru(start, tmp_path):
    """Two runs on one server (run_engines.server_sibling): SGLang would unload the least
    recently used adapter, here run A's v1, to make room for run B's second version."""
    from services.rollout.run_engines import server_sibling

    server, a = await start(max_loaded_loras=2, max_loras_per_batch=2, slots=2)
    b = server_sibling(a, "runb", LORA)
    await a.load_version(1, *make_adapter(rank=8, seed=1))
    await b.load_version(1, *make_adapter(rank=8, seed=2))
    with pytest.raises(AdapterError, match=r"already holds 2 adapters .*--max-loaded-loras 2"):
        await b.load_version(2, *make_adapter(rank=8, seed=3))
    assert server.lru_unloads == [] and await a.loaded_versions() == [1]
    # what the refusal prevents, by a client that does not check: A's v1 is gone, and A notices
    from services.common import adapter_io

    w, spec = make_adapter(rank=8, seed=4)
    adapter_io.write_peft_dir(tmp_path / "other", w, spec)
    await a.http.post(f"{a.urls[0]}/load_lora_adapter", {"lora_name": "other", "lora_path": str(tmp_path / "other")})
    assert server.lru_unloads == [f"{LORA}-v1"]
    assert await a.missing_versions() == {1: a.urls} and await a.loaded_versions() == []


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


def long_request(tok, seed: int = 1, n: int = 1) -> GenRequest:
    return GenRequest(prompt_token_ids=ids(tok, "12+34="), n=n, max_new_tokens=100, temperature=1.0, seed=seed)


async def until(check, within_s: float = 30.0) -> None:
    deadline = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


async def test_unload_waits_for_our_inflight_requests_and_closes_the_version(start, tok):
    server, engine = await start(eos_token_ids=(), token_delay_s=0.01)
    await engine.load_version(1, *make_adapter(rank=8, seed=1, scale=3.0))
    gen = asyncio.create_task(engine.generate([long_request(tok)], 1))
    await until(lambda: server.holders() == 1)
    unload = asyncio.create_task(engine.unload_version(1))
    await asyncio.sleep(0.05)
    # closed to new requests at once, without asking the server (which would re-register an
    # unloaded name from its path)
    with pytest.raises(VersionNotLoaded, match="being unloaded"):
        await engine.generate([GenRequest(prompt_token_ids=ids(tok, "1+1="))], 1)
    assert not unload.done() and server.unload_calls == []
    out = await gen
    await unload
    assert len(out[0][0].token_ids) == 100 and out[0][0].finish_reason == "length"
    # the unload reached the server only once nothing of ours held the adapter
    assert server.unload_calls == [(f"{LORA}-v1", 0)]
    assert server.implicit_loads == {} and server.loaded_adapters() == {}
    with pytest.raises(VersionNotLoaded):
        await engine.generate([long_request(tok)], 1)


async def test_a_cancelled_request_is_aborted_and_releases_its_hold(start, tok):
    server, engine = await start(eos_token_ids=(), token_delay_s=0.01)
    await engine.load_version(1, *make_adapter(rank=8, seed=1, scale=3.0))
    gen = asyncio.create_task(engine.generate([long_request(tok, n=2)], 1))
    await until(lambda: len(server.running) == 2)
    rids = sorted(server.running)
    gen.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gen
    await until(lambda: all(r in server.finished for r in rids))
    assert [server.finished[r] for r in rids] == ["abort", "abort"]
    assert server.holders() == 0
    t0 = time.monotonic()
    await engine.unload_version(1)
    assert time.monotonic() - t0 < 0.5 and server.unload_calls == [(f"{LORA}-v1", 0)]


async def test_a_timed_out_request_is_aborted_before_its_retry(start, tok):
    server, engine = await start(eos_token_ids=(), token_delay_s=0.02, timeout_s=0.3)
    await engine.load_version(1, *make_adapter(rank=8, seed=1, scale=3.0))
    with pytest.raises(ServerError, match="no answer"):
        await engine.generate([long_request(tok)], 1)
    await until(lambda: len(server.finished) == 2)  # the first try and its retry, each aborted
    assert list(server.finished.values()) == ["abort", "abort"]
    assert server.holders() == 0


async def test_an_abort_by_the_server_answers_what_was_generated(start, tok):
    server, engine = await start(eos_token_ids=(), token_delay_s=0.01)
    await engine.load_version(1, *make_adapter(rank=8, seed=1, scale=3.0))
    gen = asyncio.create_task(engine.generate([long_request(tok)], 1))
    await until(lambda: len(server.running) == 1)
    await asyncio.sleep(0.1)
    await engine.http.post(f"{engine.urls[0]}/abort_request", {"abort_all": True})
    (result,) = (await gen)[0]
    assert result.finish_reason == "abort"
    assert 0 < len(result.token_ids) < 100 and len(result.logprobs) == len(result.token_ids)
    ref = reference_logprobs(engine.dirs.local(1), ids(tok, "12+34="), result.token_ids, 1.0)
    assert result.logprobs == pytest.approx(ref, abs=1e-4)
    assert server.holders() == 0


async def test_n_completions_each_with_logprobs_and_every_hold_released(start, tok):
    server, engine = await start()
    await engine.load_version(1, *make_adapter(rank=8, seed=1, scale=3.0))
    prompt = ids(tok, "3+4=")
    out = await engine.generate(
        [GenRequest(prompt_token_ids=prompt, n=5, max_new_tokens=8, temperature=1.0, seed=3)] * 2, 1
    )
    assert [len(r) for r in out] == [5, 5]
    for r in out[0] + out[1]:
        assert r.token_ids and len(r.logprobs) == len(r.token_ids)
        assert r.logprobs == pytest.approx(reference_logprobs(engine.dirs.local(1), prompt, r.token_ids, 1.0), abs=1e-4)
    assert len({tuple(r.token_ids) for r in out[0]}) > 1, "the n completions are copies of one"
    assert [r.token_ids for r in out[0]] == [r.token_ids for r in out[1]]  # same seeds
    assert len(server.finished) == 10 and server.holders() == 0
    t0 = time.monotonic()
    await engine.unload_version(1)
    assert time.monotonic() - t0 < 0.5 and server.unload_calls == [(f"{LORA}-v1", 0)]


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


def test_device_smoke_parses_and_builds_its_model_here(tmp_path):
    """benchmarks/device/sglang_smoke.py as far as it goes without a GPU: its arguments, the
    Qwen2 model it writes (loadable, the tiny tokenizer beside it) and the server command line."""
    import json

    from benchmarks.device import sglang_smoke

    with pytest.raises(SystemExit):
        sglang_smoke.parse_args(["--out", str(tmp_path / "s.json"), "--n", "0"])
    out = tmp_path / "s.json"
    assert sglang_smoke.main(["--tiny", "--dry-run", "--out", str(out), "--work-dir", str(tmp_path)]) == 0
    res = json.loads(out.read_text())
    argv = res["argv"]
    assert argv[:2] == ["-m", "sglang.launch_server"] and res["dry_run"]
    for flag, value in [("--lora-backend", "triton"), ("--attention-backend", "triton"), ("--max-loaded-loras", "3")]:
        assert argv[argv.index(flag) + 1] == value
    model = tmp_path / "model"
    sglang_smoke.write_model(model, "qwen2", "qwen2.5-1.5b", True, "cpu")
    loaded = models.load_base_model(model)
    assert type(loaded).__name__ == "Qwen2ForCausalLM" and loaded.config.hidden_size == 64
    assert models.encode_prompt(models.load_tokenizer(model), "1+1=")
