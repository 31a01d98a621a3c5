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

Not fused with the residual add before it. Qwen2 and Llama layers do `hidden = residual +
attn_out; residual = hidden; hidden = post_attention_layernorm(hidden)` inside the decoder
layer's forward, and the layer's last add (`residual + mlp_out`) reaches the next layer's input
norm through the model's layer loop; the norm module only ever sees the sum. Fusing the first
means replacing transformers' decoder-layer forward (its signature moved between 5.17 on the
GPU image and 5.24 here), the second also the model's loop, and neither can be checked the way
the norms and the rope are (run beside the original on a probe, kept only if equal) without
running attention and its cache write twice. At stake: the 56 bfloat16 adds of a step, 0.087 ms
of the 3.47 (half of them inside a layer). That is work for a decoder layer of the rollout's own.

`normalize` returns None where it does not take the call (a tensor that needs its gradient, a
CPU tensor outside Triton's interpreter, a layout or dtype it does not read, a row wider than
`MAX_WIDTH`); the caller then computes in torch. LORABUS_FUSED_NORM_KERNEL=0 turns it off; a
kernel that fails to build is given up once, with a log line, and torch normalises from then on.
The launch reads no device value on the host and allocates through torch, so a CUDA graph
captures it as it is.

Invariant: where it runs, the output has transformers' shape and dtype and its formula's value
up to the summation order of the squares; the input and the weight are not written.
"""

from __future__ import annotations

import torch

from services.rollout.lora_kernels import give_up, triton, triton_runs

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
