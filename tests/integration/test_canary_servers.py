"""Issue 28: the load canary through the server engines — the real vLLM CPU server and the
SGLang protocol server — with the trainer's reference from transformers + peft on the same
adapter directory. A healthy load passes at the float32 tolerance; a request that reaches the
base model under the adapter's name (here: the server answers the request with the untrained
v0, B = 0, as when a LoRA request is dropped or a name resolves to another copy) is caught, as
are the trainer's weights loaded with 4x their alpha or with one tensor corrupted in place.
"""

from __future__ import annotations

import msgspec
import pytest
import torch

from services.common import adapter_io, models
from services.rollout import canary
from services.rollout.canary import TOLERANCE
from services.trainer import canary as trainer_canary
from tests.fixtures.vllm import TINY_MODEL, make_adapter, vllm_server  # noqa: F401
from tests.integration.test_sglang_engine import start  # noqa: F401

VERSION = 7


def reference(adapter_dir):
    from peft import PeftModel

    model = PeftModel.from_pretrained(models.load_base_model(TINY_MODEL), str(adapter_dir)).eval()
    prompt_ids = trainer_canary.prompts(model.config.vocab_size, seed=11, n=3, length=6)
    return trainer_canary.reference(model, prompt_ids, "float32", n_tokens=6)


async def check_engine(engine, monkeypatch) -> None:
    """Load v0 (B = 0) and VERSION; VERSION passes its canary, and fails it once its requests
    reach v0 instead."""
    await engine.load_version(0, *make_adapter(rank=8, zero_b=True))
    await engine.load_version(VERSION, *make_adapter(rank=8, seed=31, scale=3.0))
    want = reference(engine.dirs.local(VERSION))
    healthy = await canary.score(engine, VERSION, want)
    assert healthy.passed and healthy.value <= TOLERANCE["float32"], healthy
    # the trainer's weights loaded wrongly under a version's name: with 4x its alpha, and with
    # one tensor corrupted in place (right shape, other values); each fails the trainer's canary
    data, spec = make_adapter(rank=8, seed=31, scale=3.0)
    tensors = adapter_io.from_bytes(data)
    key = sorted(k for k in tensors if ".lora_B." in k)[0]
    tensors[key] = torch.randn_like(tensors[key])
    for fault, (weights, lora) in {
        "alpha": (data, msgspec.structs.replace(spec, alpha=spec.alpha * 4)),
        "corrupt": (adapter_io.to_bytes(tensors), spec),
    }.items():
        await engine.load_version(VERSION + 1, weights, lora)
        try:
            measured = await canary.score(engine, VERSION + 1, want)
            assert not measured.passed and measured.value > 10 * TOLERANCE["float32"], (fault, measured)
        finally:
            await engine.unload_version(VERSION + 1)
    name = engine.dirs.name
    monkeypatch.setattr(engine.dirs, "name", lambda v: name(0) if v == VERSION else name(v))
    base = await canary.score(engine, VERSION, want)
    assert not base.passed and base.value > 10 * TOLERANCE["float32"], base


@pytest.mark.vllm
@pytest.mark.slow
async def test_vllm_canary_passes_a_real_load_and_catches_the_base_under_its_name(vllm_server, monkeypatch):
    from services.rollout.engines.vllm import VllmEngine

    engine = VllmEngine.from_config(vllm_server.cfg, [vllm_server.url])
    try:
        await check_engine(engine, monkeypatch)
    finally:
        monkeypatch.undo()
        await engine.unload_version(VERSION)
        await engine.close()


async def test_sglang_canary_passes_a_real_load_and_catches_the_base_under_its_name(start, monkeypatch):
    _, engine = await start(max_lora_rank=16)
    await check_engine(engine, monkeypatch)
