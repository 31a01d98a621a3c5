"""Rotary position embedding of a layer's queries and keys as one Triton kernel.

transformers applies RoPE as `q * cos + rotate_half(q) * sin`, and the same for k: per layer two
`neg`, two `cat`, four broadcast multiplies and two adds, ten kernels that each read and write
the whole query or key. In a graphed decode step of the Qwen2.5-1.5B shape at batch 64 on an
H100 those were about 0.65 of the step's 4.0 ms (decode_breakdown_h100.json: the non-vectorised
bf16 multiplies, `neg`, `CatArrayBatchedCopy`, half of the adds). Here one program rotates one
(token, head) row of q or k: it reads the two halves, cos and sin once, computes in float32 and
rounds once to the tensor's dtype, so the result equals transformers' float32 formula and
differs from its half-precision chain of roundings by at most a unit in the last place.

`use(model)` replaces `apply_rotary_pos_emb` in the modeling module of each attention layer of
`model` (transformers looks the name up at call time), only where a probe shows the module's
function is the standard rotation this kernel computes; `rotate` falls back to the module's own
function for anything else (a tensor that needs its gradient, a CPU tensor outside Triton's
interpreter, a layout it does not take).

Invariant: outside the rollout's inference the module's own function runs, unchanged.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from transformers import PreTrainedModel

from services.rollout.lora_kernels import triton, triton_runs

if triton is not None:
    import triton.language as tl

Rope = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def available(device: torch.device) -> bool:
    """Triton on a CUDA device, or its interpreter (TRITON_INTERPRET=1: tests on CPU);
    LORABUS_FUSED_ROPE=0 turns it off."""
    return triton_runs(device, "LORABUS_FUSED_ROPE")


def _takes(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int) -> bool:
    """Whether the kernel computes this call: [b, heads, s, d] q and k, [b or 1, s, d] cos and
    sin broadcast over heads, every last dim contiguous, nothing that needs a gradient."""
    if unsqueeze_dim != 1 or q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or cos.shape != sin.shape:
        return False
    b, _, s, d = q.shape
    if k.shape[0] != b or k.shape[2:] != (s, d) or cos.shape[1:] != (s, d) or cos.shape[0] not in (1, b) or d % 2:
        return False
    if any(t.stride(-1) != 1 for t in (q, k, cos, sin)) or k.dtype != q.dtype:
        return False
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, cos, sin))
    return not grad and available(q.device)


def rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(q * cos + rotate_half(q) * sin, the same for k)` in one launch; shapes as `_takes`
    accepts. The outputs keep q's and k's memory layout."""
    assert triton is not None
    b, hq, s, d = q.shape
    hk = k.shape[1]
    oq, ok = torch.empty_like(q), torch.empty_like(k)
    cb = 0 if cos.shape[0] == 1 else cos.stride(0)
    sb = 0 if sin.shape[0] == 1 else sin.stride(0)
    _rope[(b * s * (hq + hk),)](
        q, k, cos, sin, oq, ok, hq, hk, s,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        oq.stride(0), oq.stride(1), oq.stride(2), ok.stride(0), ok.stride(1), ok.stride(2),
        cb, cos.stride(1), sb, sin.stride(1),
        HALF=d // 2, BLOCK=triton.next_power_of_2(d // 2),
    )  # fmt: skip
    return oq, ok


def fused(own: Rope) -> Rope:
    """`own` (a modeling module's `apply_rotary_pos_emb`) with the kernel where it applies."""

    def apply_rotary_pos_emb(q, k, cos, sin, *args: Any, unsqueeze_dim: int = 1, **kwargs: Any):
        if args or kwargs or not _takes(q, k, cos, sin, unsqueeze_dim):
            return own(q, k, cos, sin, *args, unsqueeze_dim=unsqueeze_dim, **kwargs)
        return rotate(q, k, cos, sin)

    apply_rotary_pos_emb.lorabus_own = own  # type: ignore[attr-defined]
    return apply_rotary_pos_emb


@torch.no_grad()
def _same(own: Rope, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `own` computes the standard rotation (the kernel's) on a probe, to dtype rounding."""
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, h, 3, 8, generator=g).to(device, dtype) for h in (4, 2))
    angle = torch.randn(2, 3, 4, generator=g).repeat(1, 1, 2)
    cos, sin = angle.cos().to(device, dtype), angle.sin().to(device, dtype)
    want_q, want_k = own(q, k, cos, sin)
    got_q, got_k = rotate(q, k, cos, sin)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    return all(
        a.shape == b.shape and bool(torch.allclose(a.float(), b.float(), atol=tol, rtol=tol))
        for a, b in ((want_q, got_q), (want_k, got_k))
    )


def use(model: PreTrainedModel) -> int:
    """Route `apply_rotary_pos_emb` of `model`'s modeling modules through the kernel where the
    kernel runs on the model's device and computes the same; returns how many modules."""
    param = next(model.parameters())
    if not available(param.device):
        return 0
    modules = {sys.modules[type(m).__module__] for m in model.modules()}
    swapped = 0
    for module in modules:
        own = getattr(module, "apply_rotary_pos_emb", None)
        if own is None or hasattr(own, "lorabus_own"):
            continue
        if _same(own, param.device, param.dtype):
            module.apply_rotary_pos_emb = fused(own)  # type: ignore[attr-defined]
            swapped += 1
    return swapped


if triton is not None:

    @triton.jit
    def _rope(
        q_ptr, k_ptr, cos_ptr, sin_ptr, oq_ptr, ok_ptr, HQ, HK, S,
        sqb, sqh, sqs, skb, skh, sks, soqb, soqh, soqs, sokb, sokh, soks, scb, scs, ssb, sss,
        HALF: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        """One program per (batch, position, head) row of q (heads 0..HQ-1) or k (the next HK)."""
        pid = tl.program_id(0).to(tl.int64)
        h = pid % (HQ + HK)
        t = pid // (HQ + HK)
        s = t % S
        b = t // S
        if h < HQ:
            x = q_ptr + b * sqb + h * sqh + s * sqs
            o = oq_ptr + b * soqb + h * soqh + s * soqs
        else:
            x = k_ptr + b * skb + (h - HQ) * skh + s * sks
            o = ok_ptr + b * sokb + (h - HQ) * sokh + s * soks
        offs = tl.arange(0, BLOCK)
        m = offs < HALF
        c = cos_ptr + b * scb + s * scs
        n = sin_ptr + b * ssb + s * sss
        x1 = tl.load(x + offs, mask=m).to(tl.float32)
        x2 = tl.load(x + HALF + offs, mask=m).to(tl.float32)
        c1 = tl.load(c + offs, mask=m).to(tl.float32)
        c2 = tl.load(c + HALF + offs, mask=m).to(tl.float32)
        s1 = tl.load(n + offs, mask=m).to(tl.float32)
        s2 = tl.load(n + HALF + offs, mask=m).to(tl.float32)
        # rotate_half(x) = cat(-x2, x1)
        tl.store(o + offs, (x1 * c1 - x2 * s1).to(o.dtype.element_ty), mask=m)
        tl.store(o + HALF + offs, (x2 * c2 + x1 * s2).to(o.dtype.element_ty), mask=m)
