"""The vLLM engine against a real vLLM server (CPU build) on the tiny model.

One session server (tests/fixtures/vllm.py); each test uses its own versions. The restart test
runs last: it restarts the shared server.
"""

from __future__ import annotations

import httpx
import pytest
import torch

from services.common import models
from services.rollout.engines.base import GenRequest
from services.rollout.engines.http import AdapterError, Http, ServerError, VersionNotLoaded
from services.rollout.engines.vllm import VllmEngine
from tests.fixtures.vllm import TINY_MODEL, make_adapter, vllm_server  # noqa: F401

PROMPTS = ["12+34=", "7-5=", "40+40="]


@pytest.fixture(scope="module")
def tok():
    return models.load_tokenizer(TINY_MODEL)


@pytest.fixture
async def engine(vllm_server):
    eng = VllmEngine.from_config(vllm_server.cfg, [vllm_server.url])
    yield eng
    await eng.close()


def prompt_ids(tok, text: str) -> list[int]:
    return models.encode_prompt(tok, text)


def peft_logprobs(adapter_dir, prompt: list[int], completion: list[int], temperature: float):
    """log_softmax(logits / T) of each completion token under transformers+peft (T<=0: 1), and
    the argmax token at each position."""
    from peft import PeftModel

    base = models.load_base_model(TINY_MODEL)
    model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
    t = temperature if temperature > 0 else 1.0
    lp = torch.log_softmax(logits.double() / t, dim=-1)
    return lp.gather(1, torch.tensor(completion)[:, None])[:, 0].tolist(), lp.argmax(-1).tolist()


@pytest.mark.vllm
@pytest.mark.slow
async def test_load_generate_unload(engine, vllm_server, tok):
    v0_weights, spec = make_adapter(rank=8, zero_b=True)
    # v0 is preloaded by `--lora-modules`: loading it again is "already loaded" from our path
    await engine.load_version(0, v0_weights, spec)
    weights, spec = make_adapter(rank=8, seed=11, scale=3.0)
    await engine.load_version(1, weights, spec)
    assert await engine.loaded_versions() == [0, 1]
    assert await engine.health()
    listed = {m["id"]: m["root"] for m in httpx.get(f"{vllm_server.url}/v1/models").json()["data"]}
    assert listed["tiny_lora-v1"] == engine.dirs.server(1)

    reqs = [GenRequest(prompt_token_ids=prompt_ids(tok, p), n=1, max_new_tokens=6, temperature=0.0) for p in PROMPTS]
    out0 = await engine.generate(reqs, 0)
    out1 = await engine.generate(reqs, 1)
    assert [len(r) for r in out1] == [1, 1, 1]
    assert all(r[0].token_ids and len(r[0].token_ids) == len(r[0].logprobs) for r in out1)
    assert [r[0].token_ids for r in out0] != [r[0].token_ids for r in out1], "the adapter changes nothing"
    for r in out0 + out1:
        assert r[0].finish_reason in ("stop", "length")
        assert r[0].finish_reason == "length" or r[0].token_ids[-1] == 2  # eos kept, like embedded

    sampled = await engine.generate(
        [GenRequest(prompt_token_ids=reqs[0].prompt_token_ids, n=4, max_new_tokens=4, seed=5)], 1
    )
    again = await engine.generate(
        [GenRequest(prompt_token_ids=reqs[0].prompt_token_ids, n=4, max_new_tokens=4, seed=5)], 1
    )
    assert [c.token_ids for c in sampled[0]] == [c.token_ids for c in again[0]], "same seed, same samples"
    assert len({tuple(c.token_ids) for c in sampled[0]}) > 1, "n samples are not all the same"

    await engine.unload_version(1)
    assert not engine.dirs.local(1).exists(), "directory kept after the server unloaded it"
    assert await engine.loaded_versions() == [0]
    with pytest.raises(VersionNotLoaded):
        await engine.generate(reqs[:1], 1)
    await engine.unload_version(1)  # already gone: vLLM's 404 "cannot be found" is success


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
async def test_logprobs_equal_transformers_peft(engine, tok, temperature):
    weights, spec = make_adapter(rank=8, seed=21, scale=3.0)
    await engine.load_version(2, weights, spec)
    try:
        prompts = [prompt_ids(tok, p) for p in PROMPTS]
        n = 1 if temperature == 0 else 3
        out = await engine.generate(
            [GenRequest(prompt_token_ids=p, n=n, max_new_tokens=6, temperature=temperature, seed=3) for p in prompts], 2
        )
        worst = 0.0
        for p, results in zip(prompts, out):
            for r in results:
                ref, argmax = peft_logprobs(engine.dirs.local(2), p, r.token_ids, temperature)
                assert len(ref) == len(r.logprobs)
                worst = max(worst, max(abs(a - b) for a, b in zip(r.logprobs, ref)))
                if temperature == 0:  # greedy tokens are the reference's argmax
                    assert r.token_ids == argmax
        assert worst < 1e-4, f"|vLLM - peft| logprob up to {worst:.2e} at T={temperature}"
    finally:
        await engine.unload_version(2)


@pytest.mark.vllm
@pytest.mark.slow
async def test_error_paths(engine, vllm_server, tmp_path):
    url, http = vllm_server.url, Http(timeout_s=30, attempts=1)
    try:
        with pytest.raises(ServerError) as e:  # missing field: FastAPI's validation, 400
            await http.post(f"{url}/v1/load_lora_adapter", {"lora_name": "x-v1"})
        assert e.value.status == 400 and "Field required" in e.value.message
        with pytest.raises(ServerError) as e:
            await http.post(f"{url}/v1/load_lora_adapter", {"lora_name": "x-v1", "lora_path": ""})
        assert e.value.status == 400 and "Both 'lora_name' and 'lora_path' must be provided." in e.value.message
        with pytest.raises(ServerError) as e:
            await http.post(f"{url}/v1/load_lora_adapter", {"lora_name": "x-v1", "lora_path": str(tmp_path / "none")})
        assert e.value.status == 404 and "No adapter found" in e.value.message
        with pytest.raises(ServerError) as e:
            await http.post(f"{url}/v1/unload_lora_adapter", {"lora_name": "never-loaded"})
        assert e.value.status == 404 and "cannot be found" in e.value.message
        with pytest.raises(ServerError) as e:
            await http.post(f"{url}/v1/completions", {"model": "tiny_lora-v404", "prompt": [1, 4], "max_tokens": 1})
        assert e.value.status == 404 and "does not exist" in e.value.message

        # rank above --max-lora-rank: vLLM's 500 engine failure, carried in our error
        big, big_spec = make_adapter(rank=32, seed=1)
        with pytest.raises(AdapterError, match="greater than max_lora_rank 16"):
            await engine.load_version(3, big, big_spec)
        assert 3 not in await engine.loaded_versions()

        # our name, loaded by someone else from another path: not treated as our version
        other, spec = make_adapter(rank=8, seed=2)
        from services.common import adapter_io

        adapter_io.write_peft_dir(tmp_path / "other", other, spec)
        await http.post(
            f"{url}/v1/load_lora_adapter", {"lora_name": "tiny_lora-v4", "lora_path": str(tmp_path / "other")}
        )
        with pytest.raises(AdapterError, match="already serves 'tiny_lora-v4' from"):
            await engine.load_version(4, make_adapter(rank=8, seed=3)[0], spec)
        await http.post(f"{url}/v1/unload_lora_adapter", {"lora_name": "tiny_lora-v4"})

        # a version's directory is never rewritten with other weights
        w5, s5 = make_adapter(rank=8, seed=5)
        await engine.load_version(5, w5, s5)
        await engine.load_version(5, w5, s5)  # the same weights again: idempotent
        with pytest.raises(AdapterError, match="never reused for other weights"):
            await engine.load_version(5, make_adapter(rank=8, seed=6)[0], s5)
        await engine.unload_version(5)
    finally:
        await http.close()


async def test_unreachable_server_is_unhealthy_and_errors_name_it(tmp_path):
    from services.rollout.engines.http import AdapterDirs

    eng = VllmEngine(
        ["http://127.0.0.1:9"], AdapterDirs("tiny_lora", tmp_path), http=Http(timeout_s=2, attempts=2, backoff_s=0.01)
    )
    try:
        assert not await eng.health()
        weights, spec = make_adapter(rank=8, seed=1)
        with pytest.raises(AdapterError, match=r"on http://127.0.0.1:9 failed: .*no answer: ConnectError"):
            await eng.load_version(1, weights, spec)
        assert await eng.loaded_versions() == []
    finally:
        await eng.close()


@pytest.mark.vllm
@pytest.mark.slow
def test_real_vllm_serves_the_tiny_model_like_transformers(vllm_server, tok):
    """vLLM (CPU build, its own transformers) loads the model directory as is, adds the same bos
    to a text prompt, stops on eos and decodes greedily to transformers' answers. (It ran in
    tests/unit/test_models.py as an offline `vllm.LLM` of its own, ~50 s to start; the
    session's server is the same directory in the same build.)"""
    from services.common.data import arith_split

    prompts = arith_split("valid")[:16]
    body = {"model": vllm_server.cfg.vllm.model, "prompt": [p.text for p in prompts], "max_tokens": 6,
            "temperature": 0.0, "return_token_ids": True}  # fmt: skip
    answer = httpx.post(f"{vllm_server.url}/v1/completions", json=body, timeout=120.0)
    assert answer.status_code == 200, answer.text
    choices = sorted(answer.json()["choices"], key=lambda c: c["index"])
    assert len(choices) == len(prompts)
    model = models.load_base_model(TINY_MODEL, dtype="float32", device="cpu").eval()
    with torch.no_grad():
        for p, choice in zip(prompts, choices, strict=True):
            ids = models.encode_prompt(tok, p.text)
            assert choice["prompt_token_ids"] == ids
            out = model.generate(
                input_ids=torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=6,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=tok.eos_token_id,
            )
            assert choice["text"] == models.decode_completion(tok, out[0, len(ids) :].tolist())
            assert choice["finish_reason"] == "stop"


@pytest.mark.vllm
@pytest.mark.slow
async def test_restarted_server_is_noticed_and_reloaded(engine, vllm_server, tok):
    w6, s6 = make_adapter(rank=8, seed=6, scale=3.0)
    w7, s7 = make_adapter(rank=8, seed=7, scale=3.0)
    await engine.load_version(6, w6, s6)
    await engine.load_version(7, w7, s7)
    req = [GenRequest(prompt_token_ids=prompt_ids(tok, "12+34="), max_new_tokens=6, temperature=0.0)]
    before = await engine.generate(req, 7)
    assert await engine.missing_versions() == {}

    vllm_server.restart()
    assert await engine.health()
    # v0 comes back by itself (--lora-modules); v6 and v7 are forgotten
    assert await engine.reload_missing(admissible={7}) == [7]
    assert await engine.loaded_versions() == [7]
    assert not engine.dirs.local(6).exists()
    after = await engine.generate(req, 7)
    assert after[0][0].token_ids == before[0][0].token_ids
    assert after[0][0].logprobs == pytest.approx(before[0][0].logprobs, abs=1e-5)
    with pytest.raises(VersionNotLoaded):
        await engine.generate(req, 6)
    await engine.unload_version(7)
