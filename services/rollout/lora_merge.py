"""W = W0 + B @ A for a batch of same-shaped layers: the head merge of the slot pool, two ways.

- "torch": `torch.baddbmm(W0, B, A, out=W)`. torch copies W0 into W first, then the GEMM reads
  W and writes it again: four passes over the weights for two of work, which is what bounds
  a merge on a GPU (2.6 GB of weights for Qwen2.5-1.5B all-linear).
- "triton": one kernel reads each tile of W0 once, adds its B @ A (rank r, so the product is
  nearly free) and writes W once: two passes.

Shapes: `w`, `w0` [layers, out, in] (row stride may exceed `in`: views of a bigger buffer),
`b` [layers, out, r] (any strides), `a` [layers, r, in] (rows contiguous). Both ways add the
product in float32 to W0 and round once, so neither drifts from W0; they may differ in the
last bit where the product's summation order does.

Invariant: `merge_(..., kernel=True)` equals the torch way to that rounding;
tests/unit/test_lora_kernels.py checks it under Triton's interpreter on CPU.
"""

from __future__ import annotations

import torch

from services.rollout.lora_kernels import triton

if triton is not None:
    import triton.language as tl

BN, BK = 64, 128
"""a program's tile of W: 64 rows x 128 columns (16 KB in bf16)"""


def merge_(w: torch.Tensor, w0: torch.Tensor, b: torch.Tensor, a: torch.Tensor, kernel: bool = False) -> None:
    """W = W0 + B @ A, in place in `w`; `kernel`: the Triton kernel (see
    `lora_kernels.kernel_available`), else torch."""
    if not kernel:
        torch.baddbmm(w0, b, a, out=w)
        return
    assert triton is not None
    layers, out, width = w.shape
    rank = a.shape[1]
    if w.stride(2) != 1 or w0.stride(2) != 1 or a.stride(2) != 1:
        raise ValueError("merge_: w, w0 and a need contiguous rows (stride 1 along in_features)")
    grid = (layers, triton.cdiv(out, BN), triton.cdiv(width, BK))
    _merge[grid](
        w, w0, b, a, out, width, rank,
        w.stride(0), w.stride(1), w0.stride(0), w0.stride(1),
        b.stride(0), b.stride(1), b.stride(2), a.stride(0), a.stride(1),
        R_PAD=max(16, triton.next_power_of_2(rank)), BN=BN, BK=BK,
    )  # fmt: skip


if triton is not None:

    @triton.jit
    def _merge(
        w_ptr, w0_ptr, b_ptr, a_ptr, OUT, IN, R,
        sw_l, sw_n, sw0_l, sw0_n, sb_l, sb_n, sb_r, sa_l, sa_r,
        R_PAD: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    ):  # fmt: skip
        """One program: a [BN, BK] tile of one layer's W from the same tile of W0 and the
        layer's whole B rows [BN, r] and A columns [r, BK]."""
        pid_n, pid_k = tl.program_id(1), tl.program_id(2)
        # 64-bit: a 7B model's gate/up buffer is past 2**31 elements by its 16th layer
        layer = tl.program_id(0).to(tl.int64)
        ns = pid_n * BN + tl.arange(0, BN)
        ks = pid_k * BK + tl.arange(0, BK)
        rs = tl.arange(0, R_PAD)
        n_in, k_in, r_in = ns < OUT, ks < IN, rs < R
        b_at = b_ptr + layer * sb_l + ns[:, None] * sb_n + rs[None, :] * sb_r
        b = tl.load(b_at, mask=n_in[:, None] & r_in[None, :], other=0.0)
        a_at = a_ptr + layer * sa_l + rs[:, None] * sa_r + ks[None, :]
        a = tl.load(a_at, mask=r_in[:, None] & k_in[None, :], other=0.0)
        tile = n_in[:, None] & k_in[None, :]
        w0 = tl.load(w0_ptr + layer * sw0_l + ns[:, None] * sw0_n + ks[None, :], mask=tile, other=0.0)
        acc = tl.dot(b, a, out_dtype=tl.float32) + w0.to(tl.float32)
        tl.store(w_ptr + layer * sw_l + ns[:, None] * sw_n + ks[None, :], acc.to(w0.dtype), mask=tile)
