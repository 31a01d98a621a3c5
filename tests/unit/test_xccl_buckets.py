"""The bucket plan: every tensor whole in one bucket, aligned, round-trips bit for bit."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from proto.messages import TensorSpec
from services.common import adapter_io, xccl

DT = list(xccl.DTYPES)


def specs_strategy():
    one = st.tuples(st.lists(st.integers(0, 40), min_size=1, max_size=3), st.sampled_from(DT))
    return st.lists(one, min_size=1, max_size=12).map(
        lambda xs: [TensorSpec(name=f"t{i:02d}", shape=s, dtype=d) for i, (s, d) in enumerate(xs)]
    )


@settings(max_examples=150, deadline=None)
@given(manifest=specs_strategy(), bucket_bytes=st.integers(1, 4096))
def test_plan_places_every_tensor_once_aligned_and_without_overlap(manifest, bucket_bytes):
    plan = xccl.plan_buckets(manifest, bucket_bytes)
    placed = [e.name for b in plan for e in b.entries]
    assert placed == [s.name for s in manifest]  # manifest order, each once
    for b in plan:
        end = 0
        for e in b.entries:
            assert e.offset % xccl.ALIGN == 0 and e.offset >= end
            end = e.offset + e.nbytes
        assert b.nbytes == end
        # only a lone oversized tensor may exceed the bucket size
        assert b.nbytes <= bucket_bytes or len(b.entries) == 1


def planned(manifest, bucket_bytes: int, seed: int):
    """Random tensors of the manifest's shapes and dtypes, and their bucket plan."""
    g = torch.Generator().manual_seed(seed)
    tensors = {s.name: torch.randn(s.shape, generator=g).to(xccl.DTYPES[s.dtype]) for s in manifest}
    return tensors, xccl.plan_buckets(xccl.manifest_of(tensors), bucket_bytes)


@settings(max_examples=60, deadline=None)
@given(manifest=specs_strategy(), bucket_bytes=st.integers(16, 2048))
def test_pack_then_unpack_is_bit_exact(manifest, bucket_bytes):
    tensors, plan = planned(manifest, bucket_bytes, seed=0)
    bufs = xccl.alloc_buckets(plan)
    xccl.pack(plan, tensors, bufs)
    out = xccl.unpack(plan, bufs)
    assert list(out) == sorted(tensors)
    for name, t in tensors.items():
        assert out[name].dtype == t.dtype and out[name].shape == t.shape
        assert torch.equal(out[name], t)


def qwen15b_r16_manifest(dtype="bfloat16"):
    """Qwen2.5-1.5B all-linear r=16: 28 layers, hidden 1536, kv 256, mlp 8960."""
    shapes = {
        "q_proj": (1536, 1536),
        "k_proj": (1536, 256),
        "v_proj": (1536, 256),
        "o_proj": (1536, 1536),
        "gate_proj": (1536, 8960),
        "up_proj": (1536, 8960),
        "down_proj": (8960, 1536),
    }
    out = []
    for layer in range(28):
        for mod, (i, o) in shapes.items():
            part = "mlp" if mod in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            base = f"base_model.model.model.layers.{layer}.{part}.{mod}"
            out.append(TensorSpec(name=f"{base}.lora_A.weight", shape=[16, i], dtype=dtype))
            out.append(TensorSpec(name=f"{base}.lora_B.weight", shape=[o, 16], dtype=dtype))
    return sorted(out, key=lambda s: s.name)


def test_a_37mb_adapter_is_a_handful_of_buckets():
    manifest = qwen15b_r16_manifest()
    total = sum(xccl.tensor_nbytes(s) for s in manifest)
    assert 36e6 < total < 38e6  # 18.5 M params in bf16
    plan = xccl.plan_buckets(manifest, xccl.bucket_bytes_of(16))
    assert len(plan) == 3 and sum(len(b.entries) for b in plan) == len(manifest) == 392


def test_digest_names_the_layout():
    m = qwen15b_r16_manifest()
    d = xccl.manifest_digest(m, 1 << 20)
    assert d == xccl.manifest_digest(list(m), 1 << 20)
    assert d != xccl.manifest_digest(m, 2 << 20)
    m2 = list(m)
    m2[0] = TensorSpec(name=m[0].name, shape=[8, m[0].shape[1]], dtype=m[0].dtype)
    assert d != xccl.manifest_digest(m2, 1 << 20)


@pytest.mark.parametrize(
    "manifest, match",
    [
        ([], "empty"),
        ([TensorSpec(name="a", shape=[2], dtype="float32")] * 2, "appears twice"),
    ],
)
def test_bad_manifests_are_named(manifest, match):
    with pytest.raises(xccl.ManifestError, match=match):
        xccl.plan_buckets(manifest, 64)


def test_bad_bucket_size_and_dtype_are_named():
    with pytest.raises(xccl.ManifestError, match="xccl_bucket_mb"):
        xccl.plan_buckets([TensorSpec(name="a", shape=[2], dtype="float32")], 0)
    with pytest.raises(xccl.ManifestError, match="dtype"):
        xccl.manifest_of({"a": torch.zeros(2, dtype=torch.int64)})


def test_pack_refuses_a_tensor_that_is_not_the_planned_one():
    plan = xccl.plan_buckets([TensorSpec(name="a", shape=[2, 3], dtype="float32")], 64)
    with pytest.raises(xccl.ManifestError, match="'a'"):
        xccl.pack(plan, {"a": torch.zeros(3, 2)}, xccl.alloc_buckets(plan))


@settings(max_examples=60, deadline=None)
@given(manifest=specs_strategy(), bucket_bytes=st.integers(16, 2048))
def test_packing_into_cached_views_is_the_reference_pack(manifest, bucket_bytes):
    tensors, plan = planned(manifest, bucket_bytes, seed=1)
    reference, fast = xccl.alloc_buckets(plan), xccl.alloc_buckets(plan)
    for b in reference + fast:  # the gaps too: alloc leaves them undefined
        b.zero_()
    xccl.pack(plan, tensors, reference)
    xccl.pack_views(xccl.unpack(plan, fast), tensors)
    assert all(torch.equal(a, b) for a, b in zip(reference, fast, strict=True))


@settings(max_examples=60, deadline=None)
@given(manifest=specs_strategy(), bucket_bytes=st.integers(16, 2048), slack=st.integers(0, 64))
def test_the_durable_copy_serialised_from_the_send_set_is_to_bytes(manifest, bucket_bytes, slack):
    """`serialize_into` (the durable copy's path: warm buffer, one copy per run of adjacent
    tensors) against `to_bytes` (the reference), from loose tensors and from bucket views,
    gaps between them included."""
    g = torch.Generator().manual_seed(2)
    tensors = {s.name: torch.randn(s.shape, generator=g).to(xccl.DTYPES[s.dtype]) for s in manifest}
    reference = adapter_io.to_bytes(tensors)
    plan = xccl.plan_buckets(xccl.manifest_of(tensors), bucket_bytes)
    bufs = xccl.alloc_buckets(plan)
    xccl.pack(plan, tensors, bufs)
    out = torch.full((len(reference) + slack,), 7, dtype=torch.uint8)
    for source in (tensors, xccl.unpack(plan, bufs)):
        got = adapter_io.serialize_into(source, out)
        assert got.numel() == len(reference) and bytes(got.numpy()) == reference
    assert adapter_io.serialized_size(tensors) == len(reference)


def test_serialize_into_takes_non_contiguous_tensors_and_refuses_a_short_buffer():
    t = {"a": torch.arange(12, dtype=torch.float32).reshape(3, 4).t(), "b": torch.ones(3, dtype=torch.bfloat16)}
    reference = adapter_io.to_bytes(t)
    out = torch.empty(len(reference), dtype=torch.uint8)
    assert bytes(adapter_io.serialize_into(t, out).numpy()) == reference
    with pytest.raises(ValueError, match="a CPU uint8 buffer of"):
        adapter_io.serialize_into(t, out[:-1])
