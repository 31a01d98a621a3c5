"""RMSNorm as one Triton kernel: the input read once in its own dtype, the result written once.

`fused_norm.RMSNorm` computes transformers' formula in four kernels: a cast to float32
(`direct_copy`), torch's `rms_norm`, the cast back (`bfloat16_copy`) and the weight multiply.
In a graphed decode step of the Qwen2.5-1.5B shape at batch 64 on an H100 those are 57 norms
(two a layer and the final one), 228 launches (decode_breakdown_rope_h100.json, fused_rope: the
two casts 0.23 ms, `vectorized_layer_norm_kernel` 0.15 ms, and 57 of the 85 broadcast bfloat16
multiplies, 0.25 ms together, of a 3.47 ms step). Here one program normalises one row: it loads
the row and the weight, squares and sums in float32 registers, and stores the result once.

Semantics (transformers' Qwen2RMSNorm / LlamaRMSNorm, in that order of roundings):
    x32 = float32(x); mean = sum(x32 * x32) / width; y = x32 * (1 / sqrt(mean + eps))
    out = round_out(float32(weight) * float32(round_x(y)))
`round_x` rounds to the input's dtype (nothing for float32), `round_out` to the dtype torch
gives `weight * y` (the promotion of the weight's and the input's). Both round to nearest even,
bfloat16 by its bits: Triton's interpreter truncates in its own bfloat16 cast (see kv_write), and
the bits give the GPU's rounding on both. `1 / sqrt` is rounded correctly at each step, as torch's
CPU `rsqrt` computes it. What differs from transformers is how a row's squares are summed (a
tree here, on a GPU with fused multiply-adds; torch's own order there): it moves `mean` by a few
float32 ulps, the float32 output by as many, and, rarely, `round_x(y)` by one ulp of the input's
dtype, which the weight's product then carries (tests/unit/test_norm_kernel.py: bit for bit
where the sums are exact, and on random rows the module's formula with `mean` moved by at most
3 ulps; the kernel compiles to 16-byte loads and stores for sm_90 with Triton 3.9). Every thread
of a row must hold the same sum, so the kernel is built without fused multiply-adds (`_launch`).

`add_normalize` is the same norm with the residual add before it (`decoder_layer` calls it for
`residual + attn_out` and post_attention_layernorm, which transformers' layer does as two
launches), and, for a row on an older adapter version, o_proj's low-rank correction added to
`attn_out` first: `lora_kernels.Pending`, one launch instead of three. Each sum is rounded to the
dtype torch's adds round to, so the sum it writes is torch's bit for bit (the correction's
products summed in its own order) and the norm of it is `normalize`'s.

`normalize` returns None where it does not take the call (a tensor that needs its gradient, a
CPU tensor outside Triton's interpreter, a layout or dtype it does not read, a row wider than
`MAX_WIDTH`); the caller then computes in torch. LORABUS_FUSED_NORM_KERNEL=0 turns it off; a
kernel that fails to build is given up once, with a log line, and torch normalises from then on.
The launch reads no device value on the host and allocates through torch, so a CUDA graph
captures it as it is.

Invariant: where it runs, the output has transformers' shape and dtype and its formula's value
up to the summation order of the squares (and of a correction's products); the inputs and the
weight are not written.
"""

from __future__ import annotations

import torch

from services.rollout.lora_kernels import Pending, give_up, triton, triton_runs

if triton is not None:
    import triton.language as tl


DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""what the kernel reads and writes"""

MAX_WIDTH = 16384
"""the widest row one program holds in registers (16 warps, 32 floats a thread): every hidden
size and head size of today's models; a wider row goes to torch"""

BUILD = {"enable_fp_fusion": False}
"""how the kernel is compiled: without fused multiply-adds. A row's sum is a butterfly across
threads, and a thread that fused its own square into it (`fma(x, x, partner's rounded square)`)
would hold a sum its partner does not: one row's elements normalised by different means (seen on
an H100: outputs 9 float32 ulps of the mean away, where 4 explain any order of the sum)"""

RANK_CHUNK = 8
"""a correction's rank columns read at a time by `add_normalize`: [8, 2048] float32 of Bt in a
program's registers at the widest Qwen2.5 rows we measured (1.5B), whatever the rank"""

_BROKEN: list[str] = []
"""why the kernel failed in this process (then it is not tried again)"""


def available(device: torch.device) -> bool:
    """Triton on a CUDA device, or its interpreter (TRITON_INTERPRET=1: tests on CPU);
    LORABUS_FUSED_NORM_KERNEL=0 turns it off."""
    return triton_runs(device, "LORABUS_FUSED_NORM_KERNEL", _BROKEN)


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel computes this norm: `x` contiguous with rows of the weight's length
    (any leading shape), both float32, bfloat16 or float16 on one device, nothing that needs a
    gradient."""
    if weight.dim() != 1 or x.dim() < 1 or x.shape[-1] != weight.shape[0] or x.numel() == 0:
        return False
    if x.dtype not in DTYPES or weight.dtype not in DTYPES or weight.shape[0] > MAX_WIDTH:
        return False
    if not x.is_contiguous() or not weight.is_contiguous() or x.device != weight.device:
        return False
    grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    return not grad and available(x.device)


def normalize(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """transformers' RMSNorm of `x` (see the module docstring) in one launch, or None where the
    kernel does not take the call or cannot be built, and then the caller computes its own way."""
    if not takes(x, weight):
        return None
    try:
        return _launch(x, weight, eps)
    except Exception as exc:  # a Triton that cannot build it: torch's path, said once
        give_up(_BROKEN, exc, "fused RMSNorm kernel", "normalising in torch")
        return None


def row_stride(t: torch.Tensor) -> int | None:
    """The stride between consecutive rows of `t` seen as [numel / width, width], or None where
    its leading dims do not collapse to one evenly strided row index (a column slice of one
    matmul's output does collapse). A dim of size 1 says nothing: torch gives it any stride."""
    stride = expect = None
    for size, step in zip(reversed(t.shape[:-1]), reversed(t.stride()[:-1])):
        if size == 1:
            continue
        if expect is None:
            stride = step
        elif step != expect:
            return None
        expect = step * size
    return t.shape[-1] if stride is None else stride


def add_normalize(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, pending: Pending | None = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`(s, norm(s))` for `s = residual + x`, with `pending`'s correction added to x first (x is
    then `pending.y`, a lone member's output), in one launch; None where the kernel does not take
    the call (as `normalize`; x may also be a column slice of a matmul's output), and then the
    caller computes its own way."""
    if not takes(residual, weight) or x.shape != residual.shape or x.dtype not in DTYPES:
        return None
    if x.device != residual.device or x.stride(-1) != 1 or row_stride(x) is None or x.requires_grad:
        return None
    if pending is not None and (pending.t.stride(-1) != 1 or pending.cols.dim() != 2 or len(pending.segs) != 2):
        return None
    if pending is not None and pending.cols.shape[1] % pending.rank:
        return None
    try:
        return _launch_add(x, residual, weight, eps, pending)
    except Exception as exc:  # a Triton that cannot build it: torch's path, said once
        give_up(_BROKEN, exc, "fused RMSNorm kernel", "normalising in torch")
        return None


def _launch_add(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, pending: Pending | None
) -> tuple[torch.Tensor, torch.Tensor]:
    assert triton is not None
    width = weight.shape[0]
    summed = torch.empty(residual.shape, dtype=torch.promote_types(residual.dtype, x.dtype), device=x.device)
    out = torch.empty(residual.shape, dtype=torch.promote_types(weight.dtype, summed.dtype), device=x.device)
    block = triton.next_power_of_2(width)
    warps = max(1, min(16, block // 256))
    t, cols, bt = (x, x, x) if pending is None else (pending.t, pending.cols, pending.bt)
    rank = 16 if pending is None else pending.rank
    _add_rms_norm[(residual.numel() // width,)](
        x, residual, weight, summed, out, t, cols, bt, float(eps), row_stride(x), t.stride(-2),
        1 if pending is None else pending.rows_per_mask, bt.stride(0), width=width, block=block,
        slots=0 if pending is None else cols.shape[1] // rank, rank=rank, chunk=RANK_CHUNK, num_warps=warps,
        **BUILD,
    )  # fmt: skip
    return summed, out


def _launch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    assert triton is not None
    width = weight.shape[0]
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    block = triton.next_power_of_2(width)
    # about eight elements a thread: one 16-byte load of bfloat16 each, and a short tree
    warps = max(1, min(16, block // 256))
    # the width a constant: a model has one or two (hidden size, head size), and a known width
    # lets the compiler vectorise the row's loads
    _rms_norm[(x.numel() // width,)](x, weight, out, float(eps), width=width, block=block, num_warps=warps, **BUILD)
    return out


if triton is not None:

    @triton.jit
    def _round(v, dtype: tl.constexpr):
        """float32 `v` as `dtype`, rounded to nearest even; bfloat16 by its bits, the rounding
        a GPU's conversion does and the interpreter's does not. (Lower-case constexprs: no lint
        exception for this file.)"""
        if dtype == tl.bfloat16:
            bits = v.to(tl.uint32, bitcast=True)
            # add just under half a bfloat16 ulp, and one more where the kept bit is odd: a tie
            # goes to the even neighbour; a carry into the exponent is the correct rounding up
            up = bits + 0x7FFF + ((bits >> 16) & 1)
            # a NaN stays a NaN (the carry could turn it into an infinity or a zero)
            up = tl.where(v != v, bits | 0x400000, up)
            return (up >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            return v.to(dtype)

    @triton.jit
    def _rms_norm(x_ptr, w_ptr, o_ptr, eps, width: tl.constexpr, block: tl.constexpr):
        """One program per row: `o = round_out(w * round_x(x / sqrt(mean(x^2) + eps)))`."""
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, block)
        m = offs < width
        x = tl.load(x_ptr + row * width + offs, mask=m, other=0.0).to(tl.float32)
        var = tl.div_rn(tl.sum(x * x, axis=0), width) + eps
        inv = tl.div_rn(1.0, tl.sqrt_rn(var))
        # transformers rounds the normalised row to the input's dtype before the weight multiplies
        y = _round(x * inv, x_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=m).to(tl.float32)
        tl.store(o_ptr + row * width + offs, _round(w * y, o_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _add_rms_norm(
        x_ptr, r_ptr, w_ptr, s_ptr, o_ptr, t_ptr, c_ptr, bt_ptr, eps, stride_x, stride_t, rows_per_mask, stride_bt,
        width: tl.constexpr, block: tl.constexpr, slots: tl.constexpr, rank: tl.constexpr, chunk: tl.constexpr,
    ):  # fmt: skip
        """One program per row: `x += (t * c) @ Bt` over the slots whose signs are not all zero
        (a row on the head has none: it reads no Bt), `s = round(r + round(x))` stored, then
        `_rms_norm` of s."""
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, block)
        m = offs < width
        x = tl.load(x_ptr + row * stride_x + offs, mask=m, other=0.0).to(tl.float32)
        if slots > 0:
            # a slot's sign is the same on its `rank` columns: one load says whether the row uses it
            signs = c_ptr + (row // rows_per_mask) * (slots * rank)
            acc = tl.zeros([block], dtype=tl.float32)
            for slot in tl.static_range(slots):
                sign = tl.load(signs + slot * rank).to(tl.float32)
                if sign != 0:
                    for k0 in tl.static_range(0, rank, chunk):
                        ks = k0 + tl.arange(0, chunk)
                        k_in = ks < rank
                        t = tl.load(t_ptr + row * stride_t + slot * rank + ks, mask=k_in, other=0.0).to(tl.float32)
                        # the signed shrink in Bt's dtype, as expand_stacked hands it to its dot
                        v = (t * sign).to(bt_ptr.dtype.element_ty).to(tl.float32)
                        b = tl.load(
                            bt_ptr + (slot * rank + ks)[:, None] * stride_bt + offs[None, :],
                            mask=k_in[:, None] & m[None, :],
                            other=0.0,
                        ).to(tl.float32)
                        acc += tl.sum(v[:, None] * b, axis=0)
            x = _round(x + acc, x_ptr.dtype.element_ty).to(tl.float32)
        r = tl.load(r_ptr + row * width + offs, mask=m, other=0.0).to(tl.float32)
        s = _round(r + x, s_ptr.dtype.element_ty)
        tl.store(s_ptr + row * width + offs, s, mask=m)
        s = s.to(tl.float32)
        var = tl.div_rn(tl.sum(s * s, axis=0), width) + eps
        inv = tl.div_rn(1.0, tl.sqrt_rn(var))
        y = _round(s * inv, s_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=m).to(tl.float32)
        tl.store(o_ptr + row * width + offs, _round(w * y, o_ptr.dtype.element_ty), mask=m)
