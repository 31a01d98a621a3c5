"""The KV-cache write kernel (`kv_write`) against torch's writes, and the engine's decodes with it
on and off, on CPU under Triton's interpreter (in one child process for the module:
tests/fixtures/interpreted.py says why). On a GPU the same source compiles;
benchmarks/decode_breakdown.py --variants fused_rope fused_kv times it there."""

import os

import pytest
import torch
from transformers import StaticCache

from tests.fixtures.interpreted import Outcome, checks_in, run_checks

pytestmark = pytest.mark.unit


INTERPRETED = checks_in(
    __file__,
    {
        "writes": ("interpreted_writes",),
        "static cache": ("interpreted_static_cache",),
        "static engine": ("interpreted_static_engine",),
        "slab engine": ("interpreted_slab_engine",),
    },
)


@pytest.fixture(scope="module")
def outcomes() -> dict[str, Outcome]:
    pytest.importorskip("triton")
    return run_checks(INTERPRETED, drop_env=("LORABUS_FUSED_KV_WRITE", "LORABUS_FUSED_ROPE", "LORABUS_FUSED_SAMPLER"))


def test_the_kernel_writes_what_torch_writes(outcomes):
    assert "writes checked" in outcomes["writes"].output()


def test_the_static_cache_holds_what_transformers_own_holds(outcomes):
    assert "static cache checked" in outcomes["static cache"].output()


def test_the_batch_engine_decodes_the_same_with_the_kernel_on_and_off(outcomes):
    assert "static engine checked" in outcomes["static engine"].output()


def test_the_slab_engine_decodes_the_same_with_the_kernel_on_and_off(outcomes):
    assert "slab engine checked" in outcomes["slab engine"].output()


def test_without_triton_on_the_device_the_caches_write_in_torch(monkeypatch):
    from services.rollout import kv_write
    from services.rollout.sampling import DecodeGraphs
    from tests.fixtures.tiny import tiny_qwen2

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not kv_write.available(torch.device("cpu"))
    state = DecodeGraphs(tiny_qwen2(seed=0), capture=False).acquire(2, 16)
    assert type(state.cache) is StaticCache  # transformers' own, unchanged
    keys, values = torch.zeros(2, 1, 4, 8), torch.zeros(2, 1, 4, 8)
    assert not kv_write.fused(keys, values, torch.ones(2, 1, 1, 8), torch.ones(2, 1, 1, 8), torch.tensor([0, 1]))
    assert not keys.any()  # the caller writes its own way


def test_a_kernel_that_fails_is_left_for_torch_once_and_said(monkeypatch, caplog):
    pytest.importorskip("triton")
    from services.rollout import kv_write
    from tests.fixtures.tiny import tiny_qwen2

    calls = []

    def broken(*args):
        calls.append(1)
        raise RuntimeError("PassManager::run failed")

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # what makes it eligible on this CPU
    monkeypatch.delenv("LORABUS_FUSED_KV_WRITE", raising=False)
    monkeypatch.setattr(kv_write, "_launch", broken)
    monkeypatch.setattr(kv_write, "_BROKEN", [])
    config = tiny_qwen2(seed=0).config
    fused, own = kv_write.FusedStaticCache(config=config, max_cache_len=8), StaticCache(config=config, max_cache_len=8)
    g = torch.Generator().manual_seed(1)
    for tokens in (3, 1, 1):  # a prefill (the cache's own: it allocates), then two decode steps
        key, value = torch.randn(2, 2, tokens, 8, generator=g), torch.randn(2, 2, tokens, 8, generator=g)
        got, want = fused.update(key, value, 0), own.update(key, value, 0)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert int(fused.layers[0].cumulative_length) == 5
    assert calls == [1] and caplog.text.count("PassManager::run failed") == 1
    monkeypatch.setattr(kv_write, "_BROKEN", [])
    monkeypatch.setenv("LORABUS_FUSED_KV_WRITE", "0")
    assert not kv_write.available(torch.device("cuda"))


# --- run in the interpreted child process ---


def as_the_layer_makes_it(b: int, s: int, heads: int, d: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """[b, heads, s, d] viewed on a [b, s, heads, d] projection, as the attention layer passes it."""
    return torch.randn(b, s, heads, d, generator=g).to(dtype).transpose(1, 2)


def interpreted_writes() -> None:
    from services.rollout import kv_write

    g = torch.Generator().manual_seed(3)
    # (rows, kv heads, cache length, head dim, tokens, start): start None is one position per row
    # drawn at random, an int one position for every row (0-d, as a StaticLayer's counter)
    cases = [
        (1, 1, 8, 8, 1, 0),
        (3, 2, 16, 10, 1, None),  # a head dim that is no power of two
        (4, 4, 12, 16, 3, None),  # a prefill chunk's several tokens
        (2, 2, 9, 8, 2, 7),  # up to the cache's last position
        (6, 1, 6, 32, 1, None),
        (64, 2, 20, 128, 1, None),  # the 1.5B shape's heads at batch 64
    ]
    for dtype in (torch.float32, torch.bfloat16):
        for b, h, length, d, s, at in cases:
            key, value = as_the_layer_makes_it(b, s, h, d, dtype, g), as_the_layer_makes_it(b, s, h, d, dtype, g)
            for index_dtype in (torch.int64, torch.int32):
                if at is None:
                    start = torch.randint(0, length - s + 1, (b,), generator=g).to(index_dtype)
                else:
                    start = torch.tensor(at, dtype=index_dtype)
                # what was there before: every cell that is not written must keep it
                keys = torch.randn(b, h, length, d, generator=g).to(dtype)
                values = torch.randn(b, h, length, d, generator=g).to(dtype)
                want_k, want_v = keys.clone(), values.clone()
                kv_write.write_reference(want_k, want_v, key, value, start)
                assert kv_write.fused(keys, values, key, value, start), (dtype, b, h, length, d, s)
                assert torch.equal(keys, want_k) and torch.equal(values, want_v), (dtype, b, h, length, d, s)
    # a cast into the cache's dtype rounds as torch does (float16: the interpreter's bfloat16
    # truncates where a GPU rounds to nearest even)
    key, value = (
        as_the_layer_makes_it(3, 1, 2, 16, torch.float32, g) * 7,
        as_the_layer_makes_it(3, 1, 2, 16, torch.float32, g),
    )
    keys, values = torch.zeros(3, 2, 5, 16, dtype=torch.float16), torch.zeros(3, 2, 5, 16, dtype=torch.float16)
    want_k, want_v = keys.clone(), values.clone()
    kv_write.write_reference(want_k, want_v, key, value, torch.tensor([4, 0, 2]))
    assert kv_write.fused(keys, values, key, value, torch.tensor([4, 0, 2]))
    assert torch.equal(keys, want_k) and torch.equal(values, want_v)
    # a position outside the cache writes nothing, the other rows still theirs
    key, value = (
        as_the_layer_makes_it(3, 1, 2, 8, torch.float32, g),
        as_the_layer_makes_it(3, 1, 2, 8, torch.float32, g),
    )
    keys, values = torch.zeros(3, 2, 4, 8), torch.zeros(3, 2, 4, 8)
    assert kv_write.fused(keys, values, key, value, torch.tensor([4, 1, -1]))
    assert not keys[0].any() and not keys[2].any() and not values[0].any() and not values[2].any()
    assert torch.equal(keys[1, :, 1], key[1, :, 0]) and torch.equal(values[1, :, 1], value[1, :, 0])
    # calls it does not take are left to the caller, untouched
    keys, values = torch.zeros(2, 2, 4, 8), torch.zeros(2, 2, 4, 8)
    key = torch.randn(2, 2, 1, 8)
    assert not kv_write.fused(keys, values, key, key, torch.tensor([0.0, 1.0]))  # float positions
    assert not kv_write.fused(keys, values, key, key, torch.tensor([0, 1, 2]))  # a position per row, 3 for 2
    assert not kv_write.fused(keys, values, torch.randn(2, 2, 1, 16)[..., ::2], key, torch.tensor(0))  # strided d
    assert not kv_write.fused(keys, values, key.requires_grad_(), key, torch.tensor(0))
    assert not keys.any() and not values.any()
    print("writes checked")


def interpreted_static_cache() -> None:
    from services.rollout import kv_write
    from tests.fixtures.tiny import tiny_qwen2

    launches = []
    launch = kv_write._launch
    kv_write._launch = lambda *args: (launches.append(1), launch(*args))
    g = torch.Generator().manual_seed(4)
    try:
        for dtype in (torch.float32, torch.bfloat16):
            config = tiny_qwen2(seed=0).config
            fused, own = (
                kv_write.FusedStaticCache(config=config, max_cache_len=12),
                StaticCache(config=config, max_cache_len=12),
            )
            for b, tokens in [(3, 5), (3, 1), (3, 1), (3, 2), (3, 1)]:
                for layer in range(config.num_hidden_layers):
                    key, value = (
                        as_the_layer_makes_it(b, tokens, 2, 8, dtype, g),
                        as_the_layer_makes_it(b, tokens, 2, 8, dtype, g),
                    )
                    got, want = fused.update(key, value, layer), own.update(key, value, layer)
                    assert all(torch.equal(x, y) for x, y in zip(got, want)), (dtype, layer, tokens)
            for mine, theirs in zip(fused.layers, own.layers):
                assert int(mine.cumulative_length) == int(theirs.cumulative_length) == 10
                assert mine.cumulative_length.device == theirs.cumulative_length.device
            # the first kernel-written forward left one counter for all layers, the last's
            counter = fused.layers[-1].cumulative_length
            assert all(layer.cumulative_length is counter for layer in fused.layers)
            # a step torch writes (the kernel refusing it) gives a layer its own counter back, and
            # the cache still holds what transformers' holds; the next kernel step shares again
            fused_write = kv_write.fused
            kv_write.fused = lambda *args: False
            try:
                steps = [(3, 1)]
                for b, tokens in steps:
                    for layer in range(config.num_hidden_layers):
                        key, value = (
                            as_the_layer_makes_it(b, tokens, 2, 8, dtype, g),
                            as_the_layer_makes_it(b, tokens, 2, 8, dtype, g),
                        )
                        got, want = fused.update(key, value, layer), own.update(key, value, layer)
                        assert all(torch.equal(x, y) for x, y in zip(got, want)), (dtype, layer, "torch")
            finally:
                kv_write.fused = fused_write
            assert fused.layers[0].cumulative_length is not counter
            for layer in range(config.num_hidden_layers):
                key, value = as_the_layer_makes_it(3, 1, 2, 8, dtype, g), as_the_layer_makes_it(3, 1, 2, 8, dtype, g)
                got, want = fused.update(key, value, layer), own.update(key, value, layer)
                assert all(torch.equal(x, y) for x, y in zip(got, want)), (dtype, layer, "again")
            assert all(layer.cumulative_length is counter for layer in fused.layers)
            assert [int(layer.cumulative_length) for layer in own.layers] == [12] * config.num_hidden_layers
            assert int(counter) == 12
    finally:  # the module's other checks run after this one, in the same child
        kv_write._launch = launch
    # the first call of each layer allocates (the cache's own), the four after it and the last
    # step are the kernel's
    assert len(launches) == 2 * 2 * 5
    print("static cache checked")


def same_on_and_off(slab_rows: int) -> None:
    from services.rollout import kv_write
    from tests.fixtures.kernel_engine import off_and_on
    from tests.fixtures.tiny import tiny_qwen2

    for dtype in (torch.float32, torch.bfloat16):
        # bfloat16 with every kernel a GPU runs, the rotary one's K going into this one; float32
        # with transformers' rotation (and its K's layout), which also halves the interpreter's time
        os.environ["LORABUS_FUSED_ROPE"] = "0" if dtype == torch.float32 else "1"
        off, on = off_and_on(kv_write, "LORABUS_FUSED_KV_WRITE", lambda: tiny_qwen2(seed=6), dtype, slab_rows)
        # bit for bit: the kernel writes the very values torch writes
        assert on == off, (dtype, slab_rows)


def interpreted_static_engine() -> None:
    same_on_and_off(slab_rows=0)
    print("static engine checked")


def interpreted_slab_engine() -> None:
    same_on_and_off(slab_rows=3)
    print("slab engine checked")
