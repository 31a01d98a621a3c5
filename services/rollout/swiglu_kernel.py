"""The gated MLP's `act_fn(gate) * up` as one Triton kernel, for SiLU (Qwen2, Llama, Qwen3).

transformers writes the MLP as `down_proj(act_fn(gate_proj(x)) * up_proj(x))`. In the rollout's
graphed decode step the gate and up projections come out of one matmul (`lora_slots.SlotGroup`),
so `gate` and `up` are column slices of one [rows, 2 * intermediate] tensor, and torch runs the
SiLU and the product as two kernels on strided views, neither of them vectorised: 28 + 28
launches and 0.09 + ~0.1 ms of a 3.47 ms Qwen2.5-1.5B step at batch 64 on an H100, 0.24 + ~0.13
ms of 5.18 at batch 256 (decode_breakdown_rope_h100.json). Here one program reads a block of
one row's gate and up once and writes the product once.

Semantics (torch's, in its order of roundings): `s = round(g / (1 + exp(-g)))` in float32 from
the gate, rounded to the gate's dtype; `out = round(float32(s) * float32(up))` in the dtype torch
gives the product. bfloat16 is rounded by its bits (`norm_kernel._round`: the interpreter's own
cast truncates). Compiled, the kernel calls libdevice's `expf`, as torch's CUDA SiLU does, and
divides correctly rounded: Triton's own `exp` (`ex2.approx` of `-g * log2(e)`, its error growing
with |g|) and `/` (`div.full`, two ulps) put float32 products on an H100 more than four ulps from
torch's. Interpreted, numpy's `exp` and division stand for them; the two `exp`s can differ in the
last float32 bit, which a half-precision rounding almost always hides.

`use(model)` routes the forward of each of `model`'s gated MLPs (a `gate_proj`, `up_proj`,
`down_proj` and a SiLU `act_fn`) through `gated_forward`, only where a probe shows the result is
the module's own; `silu_times` returns None for a call the kernel does not take (a tensor that
needs its gradient, a CPU tensor outside Triton's interpreter, another layout or dtype), and the
MLP then computes its own way. LORABUS_FUSED_SWIGLU=0 turns the kernel off (read at each call);
a kernel that fails to build is given up once, with a log line. The launch reads no device value
on the host, so a CUDA graph captures it as it is.

Invariant: the MLP's output is its own up to the last bits of `exp`; its modules, their paths and
their weights are not changed.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from services.rollout import lora_slots
from services.rollout.lora_kernels import Pending, give_up, triton, triton_runs
from services.rollout.norm_kernel import DTYPES, row_stride

if triton is not None:
    import triton.language as tl
    from triton.language.extra import libdevice

    from services.rollout.norm_kernel import _round


BLOCK = 1024
"""columns per program: 9 programs a row for Qwen2.5-1.5B's 8,960, 4 warps of 8 bfloat16 each"""

CORRECTED_BN = 32
"""columns per program of the corrected kernel, as `lora_kernels.STACKED_BN` (whose tile it
shares: it is that expand with the product as its epilogue)"""

_BROKEN: list[str] = []
"""why the kernel failed in this process (then it is not tried again)"""


def available(device: torch.device) -> bool:
    """Triton on a CUDA device, or its interpreter (TRITON_INTERPRET=1: tests on CPU);
    LORABUS_FUSED_SWIGLU=0 turns it off."""
    return triton_runs(device, "LORABUS_FUSED_SWIGLU", _BROKEN)


def takes(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Whether the kernel computes this product: `gate` and `up` of one shape, dtype and device,
    float32, bfloat16 or float16, each row's last dim contiguous and the rows evenly strided
    (the column slices of one matmul's output are), nothing that needs a gradient."""
    if gate.shape != up.shape or gate.dim() < 1 or gate.numel() == 0 or gate.dtype != up.dtype:
        return False
    if gate.dtype not in DTYPES or gate.device != up.device or gate.stride(-1) != 1 or up.stride(-1) != 1:
        return False
    if row_stride(gate) is None or row_stride(up) is None:
        return False
    grad = torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad)
    return not grad and available(gate.device)


def silu_times(gate: torch.Tensor, up: torch.Tensor, pending: Pending | None = None) -> torch.Tensor | None:
    """`silu(gate) * up` (see the module docstring) in one launch, or None where the kernel does
    not take the call or cannot be built, and then the caller computes its own way. With
    `pending` (gate and up are then its two members' columns of `pending.y`) each gets its LoRA
    correction first, in the same launch."""
    if not takes(gate, up):
        return None
    if pending is not None and (pending.segs != (0, gate.shape[-1], 2 * gate.shape[-1]) or pending.t.stride(-1) != 1):
        return None
    try:
        return _launch(gate, up) if pending is None else _launch_corrected(gate, up, pending)
    except Exception as exc:  # a Triton that cannot build it: torch's path, said once
        give_up(_BROKEN, exc, "fused SwiGLU kernel", "computing the MLP in torch")
        return None


def _launch(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    assert triton is not None
    width = gate.shape[-1]
    rows = gate.numel() // width
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    # libdevice is not in Triton's interpreter: there numpy's exp computes (the tests on CPU)
    compiled = gate.device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
    _swiglu[(rows, triton.cdiv(width, BLOCK))](
        gate, up, out, row_stride(gate), row_stride(up), width, block=BLOCK, compiled=compiled, num_warps=4
    )
    return out


def _launch_corrected(gate: torch.Tensor, up: torch.Tensor, pending: Pending) -> torch.Tensor:
    assert triton is not None
    width = gate.shape[-1]
    rows = gate.numel() // width
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    compiled = gate.device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
    sr = pending.cols.shape[1]
    bm = min(64, max(16, triton.next_power_of_2(rows)))
    _swiglu_corrected[(triton.cdiv(rows, bm), triton.cdiv(width, CORRECTED_BN))](
        gate, up, pending.t, pending.cols, pending.bt, out, rows, width, pending.rows_per_mask, row_stride(gate),
        row_stride(up), pending.t.stride(-2), pending.bt.stride(0), sr=sr, sr_pad=max(16, triton.next_power_of_2(sr)),
        bm=bm, bn=CORRECTED_BN, compiled=compiled, num_warps=4,
    )  # fmt: skip
    return out


def gated_forward(mlp: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """`mlp`'s forward with the kernel where it applies; the projections are called as the
    module calls them (the gate's first: siblings of one matmul keep its output for the up's).
    Where gate and up are one LoRA slot group, the group's correction of mixed-version rows is
    left to the kernel (`lora_slots.deferred`)."""

    # looked up at each call, as the module's own forward does: the rollout's LoRA slots may
    # replace the projections after this
    m: Any = mlp

    def forward(x: torch.Tensor) -> torch.Tensor:
        with lora_slots.deferred(m.gate_proj) as late:
            gate, up = m.gate_proj(x), m.up_proj(x)
            pending = late.take(gate, up)
        h = silu_times(gate, up, pending)
        if h is None and pending is not None:
            both = pending.resolved()
            gate, up = both[..., : gate.shape[-1]], both[..., gate.shape[-1] :]
        return m.down_proj(m.act_fn(gate) * up if h is None else h)

    forward.lorabus_swiglu = True  # type: ignore[attr-defined]
    return forward


SILU = ("SiLU", "SiLUActivation")
"""torch's and transformers' SiLU modules (ACT2FN's "silu" and "swish")"""


def _candidate(module: nn.Module) -> bool:
    projections = all(isinstance(getattr(module, n, None), nn.Module) for n in ("gate_proj", "up_proj", "down_proj"))
    return projections and type(getattr(module, "act_fn", None)).__name__ in SILU


@torch.no_grad()
def _same(mlp: nn.Module, fused: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    """Whether the fused forward gives the module's own output on a probe (to half-precision
    rounding; an MLP that is not `down(silu(gate) * up)` differs by far more)."""
    weight = next(mlp.parameters())
    width = getattr(mlp.gate_proj, "in_features", None) or weight.shape[-1]
    g = torch.Generator().manual_seed(0)
    probe = torch.randn(3, width, generator=g).to(weight.device, weight.dtype)
    want, got = mlp(probe), fused(probe)
    tol = 1e-4 if weight.dtype == torch.float32 else 3e-2
    return want.shape == got.shape and bool(torch.allclose(got.float(), want.float(), rtol=tol, atol=tol))


def use(model: nn.Module) -> int:
    """Route the forward of each gated SiLU MLP of `model` through the kernel where it runs on the
    model's device and computes the same; returns how many MLPs. Idempotent."""
    param = next(model.parameters())
    if not available(param.device):
        return 0
    swapped = 0
    for module in model.modules():
        if not _candidate(module) or hasattr(module.__dict__.get("forward"), "lorabus_swiglu"):
            continue
        fused = gated_forward(module)
        if _same(module, fused):
            module.forward = fused
            swapped += 1
    return swapped


if triton is not None:

    @triton.jit
    def _swiglu(g_ptr, u_ptr, o_ptr, g_row, u_row, width, block: tl.constexpr, compiled: tl.constexpr):
        """One program per (row, block of columns): `o = round(round(silu(g)) * u)`."""
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * block + tl.arange(0, block)
        m = offs < width
        g = tl.load(g_ptr + row * g_row + offs, mask=m, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * u_row + offs, mask=m, other=0.0).to(tl.float32)
        if compiled:
            silu = tl.div_rn(g, 1.0 + libdevice.exp(-g))
        else:
            silu = g / (1.0 + tl.exp(-g))
        s = _round(silu, g_ptr.dtype.element_ty).to(tl.float32)
        tl.store(o_ptr + row * width + offs, _round(s * u, o_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _swiglu_corrected(
        g_ptr, u_ptr, t_ptr, c_ptr, bt_ptr, o_ptr, n_rows, width, rows_per_mask, g_row, u_row, stride_t, stride_bt,
        sr: tl.constexpr, sr_pad: tl.constexpr, bm: tl.constexpr, bn: tl.constexpr, compiled: tl.constexpr,
    ):  # fmt: skip
        """One program per (bm rows, bn columns): gate and up each plus its member's masked
        expand, `lora_kernels._expand_stacked`'s tile, rounded to the dtype as that kernel
        writes them, then `_swiglu`'s product. Every load depends on nothing loaded."""
        rows = tl.program_id(0) * bm + tl.arange(0, bm)
        row_in = rows < n_rows
        ks = tl.arange(0, sr_pad)
        k_in = ks < sr
        ns = tl.program_id(1) * bn + tl.arange(0, bn)
        n_in = ns < width
        in_t = row_in[:, None] & k_in[None, :]
        c = tl.load(c_ptr + (rows // rows_per_mask)[:, None] * sr + ks[None, :], mask=in_t, other=0.0).to(tl.float32)
        t_row = t_ptr + rows[:, None] * stride_t + ks[None, :]
        tg = tl.load(t_row, mask=in_t, other=0.0)
        tu = tl.load(t_row + sr, mask=in_t, other=0.0)
        b_in = k_in[:, None] & n_in[None, :]
        bg = tl.load(bt_ptr + ks[:, None] * stride_bt + ns[None, :], mask=b_in, other=0.0)
        bu = tl.load(bt_ptr + ks[:, None] * stride_bt + (width + ns)[None, :], mask=b_in, other=0.0)
        inside = row_in[:, None] & n_in[None, :]
        yg = tl.load(g_ptr + rows[:, None] * g_row + ns[None, :], mask=inside, other=0.0)
        yu = tl.load(u_ptr + rows[:, None] * u_row + ns[None, :], mask=inside, other=0.0)
        g = _round(yg.to(tl.float32) + tl.dot((tg.to(tl.float32) * c).to(bg.dtype), bg), g_ptr.dtype.element_ty)
        u = _round(yu.to(tl.float32) + tl.dot((tu.to(tl.float32) * c).to(bu.dtype), bu), u_ptr.dtype.element_ty)
        g = g.to(tl.float32)
        if compiled:
            silu = tl.div_rn(g, 1.0 + libdevice.exp(-g))
        else:
            silu = g / (1.0 + tl.exp(-g))
        s = _round(silu, g_ptr.dtype.element_ty).to(tl.float32)
        out = _round(s * u.to(tl.float32), o_ptr.dtype.element_ty)
        tl.store(o_ptr + rows[:, None] * width + ns[None, :], out, mask=inside)
