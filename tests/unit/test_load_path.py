"""The fast adapter load path on CPU: the same slots as the verified-bytes path, every stage
timed, the check run on the very bytes loaded, host buffers reused only when free."""

from __future__ import annotations

import copy
import time

import pytest
import torch
from safetensors.torch import load as st_load

from proto.messages import AdapterReady, LoraSpec, ObjectPayload
from services.common import adapter_io
from services.common.store import LocalStore
from services.rollout.engines.embedded import EmbeddedEngine
from services.rollout.load_path import HostBuffers, Stager, VerifyError, parse_safetensors, tensor_views
from tests.fixtures.tiny import random_lora, tiny_qwen2

RANK = 4
SPEC = LoraSpec(rank=RANK, alpha=8.0, target_modules=["all-linear"], base_model="tiny")


def event(store: LocalStore, version: int, data: bytes, sha: str | None = None) -> AdapterReady:
    ref = store.put_bytes(f"run/adapters/v{version}/adapter_model.safetensors", data)
    return AdapterReady(
        run="run",
        trainer_epoch="e0",
        lora_name="tiny",
        version=version,
        trainer_step=version,
        created_at=time.time(),
        lora=SPEC,
        payloads=[ObjectPayload(uri=ref.uri, bytes=ref.bytes, sha256=sha or ref.sha256)],
    )


@pytest.fixture
def base():
    return tiny_qwen2()


def engine_for(base) -> EmbeddedEngine:
    return EmbeddedEngine(copy.deepcopy(base), eos_ids=[96], pad_id=0, slots=3)


def test_parsed_views_equal_safetensors_own_reader(base):
    tensors = random_lora(base, seed=1, rank=RANK, std=0.1)
    tensors = {k: v.to(torch.bfloat16 if "lora_A" in k else torch.float32) for k, v in tensors.items()}
    data = adapter_io.to_bytes(tensors)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    start, layout = parse_safetensors(buf)
    views = tensor_views(buf[start:], layout)
    want = st_load(data)
    assert views.keys() == want.keys()
    for k, v in want.items():
        assert views[k].dtype == v.dtype and torch.equal(views[k], v), k
        assert views[k].untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()  # a view, not a copy


def test_truncated_or_lying_headers_are_refused():
    with pytest.raises(VerifyError, match="cannot hold a header"):
        parse_safetensors(torch.zeros(4, dtype=torch.uint8))
    lying = torch.tensor(list((10**6).to_bytes(8, "little")) + [0] * 16, dtype=torch.uint8)
    with pytest.raises(VerifyError, match="does not fit"):
        parse_safetensors(lying)


async def test_fast_path_fills_the_slots_the_verified_path_fills(base, tmp_path):
    store = LocalStore(tmp_path)
    versions = {v: adapter_io.to_bytes(random_lora(base, seed=v, rank=RANK, std=0.1)) for v in range(3)}
    fast, slow = engine_for(base), engine_for(base)
    stager = Stager(fast, lambda uri: store)
    try:
        for v, data in versions.items():
            ev = event(store, v, data)
            staged = stager.load(ev)
            await slow.load_version(v, data, SPEC)
            staged.verified.result(timeout=10)
            t = staged.times
            assert t.verify is not None and min(t.fetch, t.parse, t.h2d, t.copy, t.merge, t.verify) >= 0
            assert t.servable_s == pytest.approx(t.fetch + t.parse + t.h2d + t.copy + t.merge)
        assert fast.slots is not None and slow.slots is not None
        assert fast.slots.head == slow.slots.head == 2
        for path, layer in fast.slots.layers.items():
            other = slow.slots.layers[path]
            assert torch.equal(layer.a, other.a) and torch.equal(layer.b, other.b), path
            assert torch.equal(layer.weight, other.weight), path
    finally:
        stager.close()


async def test_bytes_that_are_not_the_announced_ones_fail_their_check(base, tmp_path):
    store = LocalStore(tmp_path)
    data = adapter_io.to_bytes(random_lora(base, seed=5, rank=RANK, std=0.1))
    stager = Stager(engine_for(base), lambda uri: store)
    try:
        staged = stager.load(event(store, 0, data, sha="0" * 64))
        # servable (the check runs beside the load) ...
        assert stager.engine.slots is not None and stager.engine.slots.versions() == [0]
        # ... but the check fails, naming what it expected
        with pytest.raises(VerifyError, match="sha256 mismatch: expected 0000"):
            staged.verified.result(timeout=10)
    finally:
        stager.close()


def test_host_buffers_are_reused_only_once_given_back():
    pool = HostBuffers(pinned=False)
    a = pool.take(100)
    b = pool.take(100)
    assert a.data_ptr() != b.data_ptr()
    pool.give_back(a)
    c = pool.take(80)  # the smallest free buffer that fits, viewed to the size asked
    assert c.data_ptr() == a.data_ptr() and c.numel() == 80
    assert pool.take(100).data_ptr() not in (a.data_ptr(), b.data_ptr())
