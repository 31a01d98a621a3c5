"""A layer's new keys and values written into its preallocated KV cache as one Triton kernel.

transformers' `StaticLayer.update` (5.17 on the GPU image, 5.2x here) writes a decode step's key
and value in five kernels per layer: `arange`, `+ cumulative_length` (the write index), the
counter's `add_`, and one `index_copy_` each for K and V. In a graphed step of the
Qwen2.5-1.5B shape at batch 64 on an H100 those were 140 launches and about 0.26 ms
(decode_breakdown_rope_h100.json: index_copy 163 µs, arange 25, the two long adds ~73). The
slab of continuous batching (`slab_cache.SlabCache`) writes each row at its own position with
two advanced-index assignments. Here one program copies one (row, token, head) of K and of V
to its place, the position read from a device tensor: the layer's counter (every row at one
position) or the slab's `lengths` (each row at its own), so a captured graph replays it as it
is. The counter's `add_` stays a kernel of its own: reading and advancing it in one launch would
race between the programs. But it is one a step, not one a layer: once a forward has passed every
layer through the kernel, the layers share one counter (they all hold the same count then) and
only the last layer advances it, after its own write (28 int64 launches of a Qwen2.5-1.5B step
were 0.034 ms of 2.67 at batch 64 on an H100).

Not fused into `rope_kernel`: `apply_rotary_pos_emb(q, k, cos, sin)` sees neither V, nor the
layer's cache, nor the write position; `Cache.update` is the one call every decoder makes after
it, whatever its rotation (Qwen3's normed q/k, a rope the probe refused). What a fusion would
save is one launch per layer and a re-read of the rotated K (32 KB per layer at batch 64).

`FusedStaticCache` is transformers' `StaticCache` whose full-attention layers write through
the kernel; everything else (first call, sliding or offloaded layers, an older transformers)
goes to the cache's own `update`. On CPU the torch path runs (`write_reference` is its
formula); LORABUS_FUSED_KV_WRITE=0 turns the kernel off; a kernel that fails to build is given
up once, with a log line, and torch writes from then on.

Invariant: the cache holds exactly what torch's copy writes, at positions `start[r] + 0 .. s-1`
of rows `r`, and nothing else changes; a position outside the cache writes nothing (torch's
path would raise). The model's K and V already have the cache's dtype (a copy); a narrowing
cast rounds to nearest even as torch does, except under Triton's interpreter, whose bfloat16
truncates (tests/unit/test_kv_write.py checks copies, and casts to float16).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import StaticCache, cache_utils

from services.rollout.lora_kernels import give_up, triton, triton_runs

if triton is not None:
    import triton.language as tl

_LAYER_UPDATE = getattr(getattr(cache_utils, "StaticLayer", None), "update", None)
"""the write `FusedStaticCache` replaces; None before transformers 4.56 (no cache layers: the
cache writes its own way)"""


_BROKEN: list[str] = []
"""why the kernel failed in this process (then it is not tried again)"""


def available(device: torch.device) -> bool:
    """Triton on a CUDA device, or its interpreter (TRITON_INTERPRET=1: tests on CPU);
    LORABUS_FUSED_KV_WRITE=0 turns it off."""
    return triton_runs(device, "LORABUS_FUSED_KV_WRITE", _BROKEN)


def takes(
    keys: torch.Tensor, values: torch.Tensor, key: torch.Tensor, value: torch.Tensor, start: torch.Tensor
) -> bool:
    """Whether the kernel computes this write: caches [b, heads, L, d], key and value
    [b, heads, s, d] (any layout with the last dim contiguous), `start` integer with one
    position for every row or one per row, all on one device, nothing that needs a gradient."""
    if keys.dim() != 4 or key.dim() != 4 or keys.shape != values.shape or key.shape != value.shape:
        return False
    b, h, _, d = keys.shape
    if key.shape[0] != b or key.shape[1] != h or key.shape[3] != d:
        return False
    if start.dtype not in (torch.int32, torch.int64) or start.dim() > 1 or start.numel() not in (1, b):
        return False
    tensors = (keys, values, key, value)
    if any(t.stride(-1) != 1 or not t.is_floating_point() for t in tensors):
        return False
    if any(t.device != keys.device for t in (*tensors, start)):
        return False
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    return not grad and available(keys.device)


def write_reference(
    keys: torch.Tensor, values: torch.Tensor, key: torch.Tensor, value: torch.Tensor, start: torch.Tensor
) -> None:
    """The torch path: `keys[r, :, start[r] + i] = key[r, :, i]` for every row r and token i,
    the same for values (what `StaticLayer.update` and `SlabCache.update` write)."""
    b, _, s, _ = key.shape
    rows = torch.arange(b, device=keys.device)[:, None]
    at = start.reshape(-1).expand(b)[:, None] + torch.arange(s, device=keys.device)[None, :]
    # two advanced indices around a slice: the result is [b, s, heads, d]
    keys[rows, :, at] = key.transpose(1, 2).to(keys.dtype)
    values[rows, :, at] = value.transpose(1, 2).to(values.dtype)


def fused(
    keys: torch.Tensor, values: torch.Tensor, key: torch.Tensor, value: torch.Tensor, start: torch.Tensor
) -> bool:
    """Write as `write_reference` does, in one launch; False (nothing written) where the kernel
    does not take the call or cannot be built, and then the caller writes its own way."""
    if not takes(keys, values, key, value, start):
        return False
    try:
        _launch(keys, values, key, value, start)
    except Exception as exc:  # a Triton that cannot build it: torch's path, said once
        give_up(_BROKEN, exc, "fused KV-cache write", "writing in torch")
        return False
    return True


def _launch(
    keys: torch.Tensor, values: torch.Tensor, key: torch.Tensor, value: torch.Tensor, start: torch.Tensor
) -> None:
    assert triton is not None
    b, h, s, d = key.shape
    # one position for all rows is read by every program (stride 0)
    row_stride = start.stride(0) if start.dim() == 1 and start.numel() > 1 else 0
    _kv_write[(b * s * h,)](
        key, value, keys, values, start, h, s, keys.shape[2],
        key.stride(0), key.stride(1), key.stride(2), value.stride(0), value.stride(1), value.stride(2),
        keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
        row_stride, dim=d, block=triton.next_power_of_2(d),
    )  # fmt: skip


class FusedStaticCache(StaticCache):
    """transformers' `StaticCache`, its full-attention layers written through the kernel at the
    layer's counter. A forward that wrote every layer through the kernel ends by giving them one
    shared counter (the last layer's), which from then on only the last layer advances: each
    layer's `cumulative_length` still reads the count, one launch a step advances it."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        layers: list[Any] = getattr(self, "layers", None) or []
        layer = layers[layer_idx] if layer_idx < len(layers) else None
        if layer is not None and _takes(layer, getattr(self, "offloading", False)):
            if fused(layer.keys, layer.values, key_states, value_states, layer.cumulative_length):
                counter = layers[-1].cumulative_length
                last = layer is layers[-1]
                if last or layer.cumulative_length is not counter:
                    layer.cumulative_length.add_(key_states.shape[-2])
                if last and any(other.cumulative_length is not counter for other in layers):
                    self._share_counter(layers)
                return layer.keys, layer.values
            if layer_idx != len(layers) - 1 and layer.cumulative_length is layers[-1].cumulative_length:
                # torch writes and advances the counter it reads: this layer's own again
                layer.cumulative_length = layer.cumulative_length.clone()
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    @staticmethod
    def _share_counter(layers: list[Any]) -> None:
        """After a forward that advanced every layer's own counter by the same tokens (each wrote
        through the kernel), all point at the last layer's; a layer any other way keeps its own."""
        if all(_takes(layer, False) for layer in layers):
            for layer in layers[:-1]:
                layer.cumulative_length = layers[-1].cumulative_length


def _takes(layer: Any, offloading: bool) -> bool:
    """Whether a cache layer is one the kernel writes: transformers' own full-attention layer
    (not a sliding window's or a subclass's), allocated by its first update, not offloaded."""
    return (
        _LAYER_UPDATE is not None
        and type(layer).update is _LAYER_UPDATE
        and getattr(layer, "is_initialized", False)
        and isinstance(getattr(layer, "cumulative_length", None), torch.Tensor)
        and not offloading
    )


if triton is not None:

    @triton.jit
    def _kv_write(
        k_ptr, v_ptr, kc_ptr, vc_ptr, start_ptr, heads, tokens, length,
        skb, skh, sks, svb, svh, svs, sckb, sckh, sckl, scvb, scvh, scvl, sstart,
        dim: tl.constexpr, block: tl.constexpr,
    ):  # fmt: skip
        """One program per (row, token, head): K's and V's `dim` values to the cache at the
        row's position + token. (Lower-case constexprs: no lint exception for this file.)"""
        pid = tl.program_id(0).to(tl.int64)
        h = pid % heads
        t = pid // heads
        s = t % tokens
        b = t // tokens
        pos = tl.load(start_ptr + b * sstart).to(tl.int64) + s
        offs = tl.arange(0, block)
        # a position past the cache (or before it) must not land in another row's memory: it
        # writes no element (the bound is a scalar, as the interpreter takes no scalar & block)
        m = offs < tl.where((pos >= 0) & (pos < length), dim, 0)
        k = tl.load(k_ptr + b * skb + h * skh + s * sks + offs, mask=m)
        v = tl.load(v_ptr + b * svb + h * svh + s * svs + offs, mask=m)
        kc = kc_ptr + b * sckb + h * sckh + pos * sckl
        vc = vc_ptr + b * scvb + h * scvh + pos * scvl
        # a narrowing cast rounds to nearest even, Triton's default and torch's; a rounding
        # named here would fail to build for the usual same-dtype copy
        tl.store(kc + offs, k.to(kc_ptr.dtype.element_ty), mask=m)
        tl.store(vc + offs, v.to(vc_ptr.dtype.element_ty), mask=m)
