"""The low-rank correction of mixed-version rows, y + ((x @ A^T) * C) @ Bt, four ways.

One call corrects a *group* of sibling linear layers that read the same input (q/k/v, or
gate/up), whose outputs sit side by side in one `y [rows, N]`:
- `a [G * S * r, in]`: member g's slots (S of rank r) stacked, members one after another;
- `bt [S * r, N]`: column n holds the slots' pre-scaled B^T of the member that owns column n;
- `segs`: member g owns columns segs[g]:segs[g+1];
- `cols [batch, S * r]`: the sign mask (+1 on a row's slot, -1 on the head's, 0 elsewhere),
  one row per batch row; x and y have `rows_per_mask` rows (positions) per batch row.

`correct_reference_` is plain torch (CPU, tests, and where Triton is missing): one shrink
matmul for the whole group, one mask multiply, one expand per member.

"stacked" (the GPU default, `DEFAULT_CHOICE`): the slot pool keeps A's rows under W in one
buffer, so the layer's own cuBLAS matmul returns x @ A^T beside x @ W^T, and `expand_stacked`
masks it and writes y + the expand to a new contiguous tensor in one small kernel whose loads
all start at once: one extra launch per group on the critical path, no side stream, no second
pass over x.

`correct_kernel_` is two Triton kernels for the whole group whatever G is: a split-K shrink
that writes masked partial sums, then an expand that sums them and adds t @ Bt into y. They
skip blocks of 16 rows that are all on the head and load only the A rows of slots that a block
uses, so their cost follows the rows to correct rather than the batch (prefill). The shrink
reads x only, so a captured graph runs it on a side stream beside the layer's own matmul.

`linear_fused` takes the layer's matmul in too: one Triton GEMM computes
y = x @ W^T + bias + ((x @ A_g^T) * C) @ Bt, each program accumulating its tile of x @ W^T and
its rows' x @ A_g^T in the same loop and adding the expand in its epilogue; every program
recomputes its rows' x @ A^T, which is why it loses to cuBLAS + the stacked expand.

`choose` picks a group's path: a mode forces one, "auto" takes the measured choice for the
shape (`TUNED`, filled by benchmarks/lora_tuning.py) or `DEFAULT_CHOICE`. None of the paths
reads the mask on the host, so all can be captured in a CUDA graph. Eager forwards on a GPU use
the reference, since a Triton launch costs ~20 us of Python.

Invariant: all paths compute the same y (to the rounding of the model's dtype);
tests/unit/test_lora_kernels.py checks the kernels against the reference under Triton's
interpreter on CPU.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Literal, NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without Triton: the reference path only
    triton = None

log = logging.getLogger(__name__)

BLOCK_M = 16
"""rows per program: the skip unit (tl.dot needs at least 16)"""
BLOCK_N = 128
BLOCK_K = 64
K_CHUNK = 1024
"""input features per shrink program: the split-K width (down_proj's 8960 -> 9 programs)"""
STACKED_BN = 32
"""output columns per `expand_stacked` program (more programs, each with less to load) and its
warps: the fastest of seven tiles on the H200 (benchmarks/lora_tuning.py `sweep_stacked`; the
spread between them was 3 %)"""
STACKED_WARPS = 4

Correction = Literal["torch", "triton", "stacked", "fused"]
"""how captured graphs correct a group's mixed rows: the reference, the two kernels beside
cuBLAS, the shrink stacked into the layer's matmul plus one expand (`expand_stacked`), or
`linear_fused`"""

Mode = Literal["auto", "torch", "triton", "stacked", "fused"]
"""what a slot pool is told: one correction for every group, or "auto": per group shape, what
`choose` says (the measured choice in `TUNED`, else `DEFAULT_CHOICE`)"""


class FusedConfig(NamedTuple):
    """Tiles of `linear_fused`: rows, output columns and input features per program step."""

    bm: int
    bn: int
    bk: int
    warps: int = 4
    stages: int = 3


Choice = Literal["torch", "triton", "stacked"] | FusedConfig
"""a group's correction: a path, or the fused GEMM with these tiles"""

Key = tuple[int, int, int, int, int]
"""a group shape: (rows, N, in, members, S * r)"""

TUNED: dict[Key, Choice] = {}
"""the choice measured fastest for a shape (benchmarks/lora_tuning.py fills it). Empty unless
something measured."""

DEFAULT_CHOICE: Choice = "stacked"
"""where nothing was measured. On the H200 (Qwen2.5-1.5B shape, r=16, 4 slots, 64 rows; benchmarks/
results/embedded_engine_h200.json) it was the fastest per group for q/k/v, o and gate/up and
0.2 us from the fastest for down_proj, and in the whole decode it beat the per-shape tuned mix
(0.93x the graph base against 0.91x: the torch path the tuning picked for down_proj runs its
shrink on a side stream, which measured cheaper alone than inside the model)."""


def triton_runs(device: torch.device, switch: str, broken: Sequence[str] = ()) -> bool:
    """Whether one of the decode step's Triton kernels runs for `device`: Triton on a CUDA
    device, or its interpreter (TRITON_INTERPRET=1: tests on CPU); the environment variable
    `switch` set to 0 turns that kernel off, and a kernel that failed to build in this process
    (`broken` holds why) is not tried again."""
    if triton is None or broken or os.environ.get(switch) == "0":
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def give_up(broken: list[str], exc: Exception, kernel: str, instead: str) -> None:
    """A decode kernel that failed (a Triton that cannot build it): record why in `broken`, so
    `triton_runs` says no to it in this process from now on, and say so once, naming what runs
    `instead`."""
    broken.append(f"{type(exc).__name__}: {exc}")
    if len(broken) == 1:
        log.warning("%s unavailable, %s from now on: %s", kernel, instead, broken[0][:500])


def kernel_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `correct_kernel_` runs here: Triton on a CUDA device in half precision, or
    Triton's interpreter (TRITON_INTERPRET=1, tests on CPU)."""
    if triton is None:
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    return device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def choose(mode: Mode, key: Key) -> Choice:
    """The correction a group of shape `key` runs under `mode`."""
    if mode == "auto":
        return TUNED.get(key, DEFAULT_CHOICE)
    if mode == "fused":
        tuned = TUNED.get(key)
        return tuned if isinstance(tuned, FusedConfig) else default_config(key[0], key[1], key[4])
    return mode


def default_config(rows: int, n: int, sr: int) -> FusedConfig:
    """Tiles for a shape nobody measured."""
    # decode batches (rows <= 64) fit one row block, so each weight tile is read once; narrow
    # layers get narrower column tiles so that more programs share the memory traffic
    bm = min(64, max(16, _pow2(rows)))
    bn = 64 if n >= 4096 else 32
    bk = 128 if _pow2(sr) <= 64 else 64
    # the rows' x @ A^T accumulator [bm, S * r] lives in registers beside the output tile's
    warps = 8 if bm * _pow2(sr) >= 64 * 256 else 4
    return with_stages(FusedConfig(bm, bn, bk, warps), sr)


def with_stages(config: FusedConfig, sr: int, budget: int = 112 * 1024) -> FusedConfig:
    """`config` with as many pipeline stages (2-4) as its tiles of x, W and A fit in `budget`
    bytes of shared memory (112 KB: two programs share a multiprocessor of an H100/H200)."""
    stage = 2 * config.bk * (config.bm + config.bn + max(16, _pow2(sr)))
    return config._replace(stages=max(2, min(4, budget // stage)))


def correct_reference_(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    bt: torch.Tensor,
    segs: Sequence[int],
    cols: torch.Tensor,
    rows_per_mask: int,
) -> None:
    """y [rows, N] += the group's correction, in place (plain torch)."""
    expand_reference_(y, shrink_reference(x, a, cols, rows_per_mask), bt, segs)


def shrink_reference(x: torch.Tensor, a: torch.Tensor, cols: torch.Tensor, rows_per_mask: int) -> torch.Tensor:
    """The masked shrink t = (x @ A^T) * C, [rows, G * S * r] (it reads x only, so it can run
    beside the layer's own matmul)."""
    return masked(x @ a.T, cols, rows_per_mask)


def masked(t: torch.Tensor, cols: torch.Tensor, rows_per_mask: int) -> torch.Tensor:
    """t [rows, G * S * r] (any strides: the stacked matmul's columns too) times each row's
    signs, member by member: a new [rows, G * S * r] tensor."""
    per_member = t.unflatten(0, (cols.shape[0], rows_per_mask)).unflatten(-1, (-1, cols.shape[1]))
    return (per_member * cols[:, None, None, :]).flatten(0, 1).flatten(1)


def expand_reference_(y: torch.Tensor, t: torch.Tensor, bt: torch.Tensor, segs: Sequence[int]) -> None:
    """y += t @ Bt, member by member."""
    sr = bt.shape[0]
    for g in range(len(segs) - 1):
        lo, hi = segs[g], segs[g + 1]
        y[:, lo:hi].addmm_(t[:, g * sr : (g + 1) * sr], bt[:, lo:hi])


def correct_kernel_(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    bt: torch.Tensor,
    segs: torch.Tensor,
    cols: torch.Tensor,
    rows_per_mask: int,
) -> None:
    """Same as `correct_reference_`, as two Triton kernels; `segs` is an int32 tensor on the
    device (read by the kernel, so the call stays capturable)."""
    expand_kernel_(y, shrink_kernel(x, a, cols, rows_per_mask, segs.shape[0] - 1), bt, segs, cols, rows_per_mask)


def shrink_kernel(
    x: torch.Tensor, a: torch.Tensor, cols: torch.Tensor, rows_per_mask: int, groups: int
) -> torch.Tensor:
    """The masked shrink as split-K partial sums [splits, rows, G * SR_PAD] (fp32)."""
    assert triton is not None
    rows, k = x.shape
    sr = cols.shape[1]
    if x.stride(1) != 1:
        x = x.contiguous()
    sr_pad = max(16, triton.next_power_of_2(sr))
    splits = triton.cdiv(k, K_CHUNK)
    partial = torch.empty(splits, rows, groups * sr_pad, dtype=torch.float32, device=x.device)
    _shrink[(triton.cdiv(rows, BLOCK_M), groups, splits)](
        x, a, cols, partial, rows, k, rows_per_mask, x.stride(0), a.stride(0),
        SR=sr, SR_PAD=sr_pad, BM=BLOCK_M, BK=BLOCK_K, K_CHUNK=K_CHUNK,
    )  # fmt: skip
    return partial


def expand_kernel_(
    y: torch.Tensor, partial: torch.Tensor, bt: torch.Tensor, segs: torch.Tensor, cols: torch.Tensor, rows_per_mask: int
) -> None:
    """y += (sum of the partials) @ Bt, every member in one kernel."""
    assert triton is not None
    splits, rows, width = partial.shape
    n, groups, sr = y.shape[1], segs.shape[0] - 1, cols.shape[1]
    _expand[(triton.cdiv(rows, BLOCK_M), triton.cdiv(n, BLOCK_N))](
        y, partial, cols, bt, segs, rows, n, rows_per_mask, y.stride(0), bt.stride(0), splits,
        G=groups, SR=sr, SR_PAD=width // groups, BM=BLOCK_M, BN=BLOCK_N,
    )  # fmt: skip


class Pending(NamedTuple):
    """A group's output `y` [..., N] without its correction, (t * C) @ Bt, and what the
    correction needs: the unmasked shrink the stacked matmul left beside y (`t` [rows, G * S *
    r], any row stride), the signs `cols` [batch, S * r], `bt` [S * r, N], the slots' `rank` and
    the members' column bounds `segs` (host ints, (0, N) for a lone member). The kernel that
    reads y next adds it (`norm_kernel.add_normalize` for o_proj, `expand_stacked` with a
    residual for down_proj, `swiglu_kernel.silu_times` for gate/up): one launch fewer and one
    pass over y fewer than correcting y first."""

    y: torch.Tensor
    t: torch.Tensor
    cols: torch.Tensor
    bt: torch.Tensor
    rows_per_mask: int
    rank: int
    segs: tuple[int, ...]

    def resolved(self, residual: torch.Tensor | None = None) -> torch.Tensor:
        """y corrected (plus `residual`, y's shape, where given) as a new contiguous tensor: the
        stacked expand where it runs, else torch."""
        n = self.y.shape[-1]
        y2 = self.y.reshape(-1, n)
        flat = None if residual is None else residual.reshape(-1, n)
        if kernel_available(y2.device, y2.dtype) and (flat is None or flat.stride(1) == 1):
            out = expand_stacked(y2, self.t, self.bt, self.segs, self.cols, self.rows_per_mask, flat)
        else:
            out = y2.contiguous()
            expand_reference_(out, masked(self.t, self.cols, self.rows_per_mask), self.bt, self.segs)
            out = out if flat is None else flat + out
        return out.view(self.y.shape)


def expand_stacked(
    y: torch.Tensor,
    t: torch.Tensor,
    bt: torch.Tensor,
    segs: Sequence[int],
    cols: torch.Tensor,
    rows_per_mask: int,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """y + (t * C) @ Bt as a new contiguous [rows, N] tensor, every member in one kernel, for the
    unmasked shrink t [rows, G * S * r] that the stacked matmul left beside y (both may be
    column views of one tensor; neither is written). `segs` are host ints (at most three
    members): they are compiled in, so the kernel's loads do not wait on a load of the segment
    table. With `residual` [rows, N] (contiguous) the output is `residual + (y + correction)`,
    each sum rounded to y's dtype as torch's two adds round: a decoder layer's last residual add
    and down_proj's correction in one launch.

    Out of place because a contiguous output keeps the residual add that follows o_proj and
    down_proj on torch's vectorised kernel: y as a column view of the stacked matmul (row stride
    N + G * S * r) sent it to the strided one, 192 against 86 us a decode step at batch 64 on an
    H100 (Qwen2.5-1.5B, benchmarks/decode_breakdown.py, measured 2026-12-07)."""
    assert triton is not None
    rows, n = y.shape
    groups, sr = len(segs) - 1, cols.shape[1]
    if groups > 3:
        raise ValueError(f"segs: {len(segs) - 1} members, expand_stacked takes at most 3 (q/k/v); split the group")
    if residual is not None and (residual.shape != (rows, n) or residual.stride(1) != 1):
        got = f"shape {tuple(residual.shape)}, stride {residual.stride()}"
        raise ValueError(f"residual: {got}; pass y's shape [{rows}, {n}] with contiguous rows")
    dtype = y.dtype if residual is None else torch.promote_types(y.dtype, residual.dtype)
    out = torch.empty(rows, n, dtype=dtype, device=y.device)
    bounds = list(segs[1:]) + [n] * (3 - groups)
    bm = min(64, max(16, _pow2(rows)))
    tiles = max(triton.cdiv(segs[g + 1] - segs[g], STACKED_BN) for g in range(groups))
    res = out if residual is None else residual
    _expand_stacked[(triton.cdiv(rows, bm), tiles, groups)](
        y, t, cols, bt, res, out, rows, rows_per_mask, y.stride(0), t.stride(0), bt.stride(0), res.stride(0),
        out.stride(0), B1=bounds[0], B2=bounds[1], B3=bounds[2], SR=sr, SR_PAD=max(16, triton.next_power_of_2(sr)),
        BM=bm, BN=STACKED_BN, HAS_RES=residual is not None, num_warps=STACKED_WARPS,
    )  # fmt: skip
    return out


def linear_fused(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    a: torch.Tensor,
    bt: torch.Tensor,
    segs: torch.Tensor,
    cols: torch.Tensor,
    rows_per_mask: int,
    config: FusedConfig,
) -> torch.Tensor:
    """x [rows, in] @ w^T + bias plus the group's correction, [rows, N], one Triton kernel;
    `segs` is an int32 tensor on the device."""
    assert triton is not None
    rows, k = x.shape
    n, groups, sr = w.shape[0], segs.shape[0] - 1, cols.shape[1]
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    # members' column tiles one after another; each member may end in a partial tile
    tiles = triton.cdiv(n, config.bn) + groups - 1
    _fused[(triton.cdiv(rows, config.bm), tiles)](
        x, w, w if bias is None else bias, a, cols, bt, segs, y, rows, k, rows_per_mask,
        x.stride(0), w.stride(0), a.stride(0), bt.stride(0), y.stride(0),
        G=groups, SR=sr, SR_PAD=max(16, triton.next_power_of_2(sr)), HAS_BIAS=bias is not None,
        EVEN_K=k % config.bk == 0, BM=config.bm, BN=config.bn, BK=config.bk,
        num_warps=config.warps, num_stages=config.stages,
    )  # fmt: skip
    return y


if triton is not None:

    @triton.jit
    def _mask_block(c_ptr, rows, row_in, rows_per_mask, SR: tl.constexpr, SR_PAD: tl.constexpr):
        """The block's signs [BM, SR_PAD] and which rows / slot columns are in use."""
        cols = tl.arange(0, SR_PAD)
        c = tl.load(
            c_ptr + (rows // rows_per_mask)[:, None] * SR + cols[None, :],
            mask=row_in[:, None] & (cols < SR)[None, :],
            other=0.0,
        ).to(tl.float32)
        on = (c != 0).to(tl.int32)
        return c, tl.max(on, axis=1) > 0, tl.max(on, axis=0) > 0

    @triton.jit
    def _shrink(
        x_ptr, a_ptr, c_ptr, p_ptr, M, K, rows_per_mask, stride_x, stride_a,
        SR: tl.constexpr, SR_PAD: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, K_CHUNK: tl.constexpr,
    ):  # fmt: skip
        pid_m, g, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rows = pid_m * BM + tl.arange(0, BM)
        row_in = rows < M
        c, row_on, col_on = _mask_block(c_ptr, rows, row_in, rows_per_mask, SR, SR_PAD)
        if tl.max(row_on.to(tl.int32), axis=0) > 0:
            cols = tl.arange(0, SR_PAD)
            acc = tl.zeros((BM, SR_PAD), dtype=tl.float32)
            for kk in range(0, K_CHUNK, BK):
                ks = split * K_CHUNK + kk + tl.arange(0, BK)
                k_in = ks < K
                xt = tl.load(
                    x_ptr + rows[:, None] * stride_x + ks[None, :], mask=row_on[:, None] & k_in[None, :], other=0.0
                )
                # rows of slots no row of the block uses are never read
                at = tl.load(
                    a_ptr + (g * SR + cols)[None, :] * stride_a + ks[:, None],
                    mask=col_on[None, :] & k_in[:, None],
                    other=0.0,
                )
                acc += tl.dot(xt, at)
            width = tl.num_programs(1) * SR_PAD
            tl.store(
                p_ptr + (split * M + rows)[:, None] * width + (g * SR_PAD + cols)[None, :],
                acc * c,
                mask=row_in[:, None],
            )

    @triton.jit
    def _expand(
        y_ptr, p_ptr, c_ptr, bt_ptr, seg_ptr, M, N, rows_per_mask, stride_y, stride_bt, splits,
        G: tl.constexpr, SR: tl.constexpr, SR_PAD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    ):  # fmt: skip
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        rows = pid_m * BM + tl.arange(0, BM)
        row_in = rows < M
        c, row_on, col_on = _mask_block(c_ptr, rows, row_in, rows_per_mask, SR, SR_PAD)
        if tl.max(row_on.to(tl.int32), axis=0) > 0:
            cols = tl.arange(0, SR_PAD)
            ns = pid_n * BN + tl.arange(0, BN)
            n_in = ns < N
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for g in tl.static_range(G):
                lo = tl.load(seg_ptr + g)
                hi = tl.load(seg_ptr + g + 1)
                if (pid_n * BN < hi) & (pid_n * BN + BN > lo):  # this tile has columns of member g
                    t = tl.zeros((BM, SR_PAD), dtype=tl.float32)
                    for s in range(splits):
                        t += tl.load(
                            p_ptr + (s * M + rows)[:, None] * (G * SR_PAD) + (g * SR_PAD + cols)[None, :],
                            mask=row_on[:, None],
                            other=0.0,
                        )
                    mine = n_in & (ns >= lo) & (ns < hi)
                    b = tl.load(
                        bt_ptr + cols[:, None] * stride_bt + ns[None, :],
                        mask=col_on[:, None] & mine[None, :],
                        other=0.0,
                    )
                    acc += tl.dot(t.to(b.dtype), b)
            where = y_ptr + rows[:, None] * stride_y + ns[None, :]
            inside = row_on[:, None] & n_in[None, :]
            y = tl.load(where, mask=inside, other=0.0)
            tl.store(where, (y.to(tl.float32) + acc).to(y.dtype), mask=inside)

    @triton.jit
    def _expand_stacked(
        y_ptr, t_ptr, c_ptr, bt_ptr, r_ptr, out_ptr, M, rows_per_mask, stride_y, stride_t, stride_bt, stride_r,
        stride_out, B1: tl.constexpr, B2: tl.constexpr, B3: tl.constexpr, SR: tl.constexpr, SR_PAD: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, HAS_RES: tl.constexpr,
    ):  # fmt: skip
        """One program: a tile of member g's columns for BM rows. Its four loads (signs, t, Bt,
        y) depend on nothing loaded, so they are in flight together: at decode sizes the kernel
        costs about one memory round trip (skipping head-only row blocks first, as `_expand`
        does, costs two more)."""
        pid_m, pid_n, g = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        lo = (g >= 1).to(tl.int32) * B1 + (g >= 2).to(tl.int32) * (B2 - B1)
        hi = B1 + (g >= 1).to(tl.int32) * (B2 - B1) + (g >= 2).to(tl.int32) * (B3 - B2)
        rows = pid_m * BM + tl.arange(0, BM)
        row_in = rows < M
        cols = tl.arange(0, SR_PAD)
        col_in = cols < SR
        ns = lo + pid_n * BN + tl.arange(0, BN)
        n_in = ns < hi
        in_t = row_in[:, None] & col_in[None, :]
        c = tl.load(c_ptr + (rows // rows_per_mask)[:, None] * SR + cols[None, :], mask=in_t, other=0.0).to(tl.float32)
        t = tl.load(t_ptr + rows[:, None] * stride_t + (g * SR + cols)[None, :], mask=in_t, other=0.0)
        b = tl.load(bt_ptr + cols[:, None] * stride_bt + ns[None, :], mask=col_in[:, None] & n_in[None, :], other=0.0)
        inside = row_in[:, None] & n_in[None, :]
        y = tl.load(y_ptr + rows[:, None] * stride_y + ns[None, :], mask=inside, other=0.0)
        acc = tl.dot((t.to(tl.float32) * c).to(b.dtype), b)
        # every element of the new output is written, rows on the head too: their signs are all
        # zero, so they get y + 0, which is y exactly
        out = (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty)
        if HAS_RES:
            r = tl.load(r_ptr + rows[:, None] * stride_r + ns[None, :], mask=inside, other=0.0)
            out = r.to(tl.float32) + out.to(tl.float32)
        tl.store(out_ptr + rows[:, None] * stride_out + ns[None, :], out.to(out_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _fused(
        x_ptr, w_ptr, bias_ptr, a_ptr, c_ptr, bt_ptr, seg_ptr, y_ptr, M, K, rows_per_mask,
        stride_x, stride_w, stride_a, stride_bt, stride_y,
        G: tl.constexpr, SR: tl.constexpr, SR_PAD: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    ):  # fmt: skip
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        # which member's columns this program writes: tiles never straddle two members, so the
        # tile needs one member's A; programs past the last tile find none and write nothing
        g = pid_n * 0
        start = pid_n * 0
        end = pid_n * 0
        first = pid_n * 0
        for i in tl.static_range(G):
            lo = tl.load(seg_ptr + i)
            hi = tl.load(seg_ptr + i + 1)
            count = (hi - lo + BN - 1) // BN
            mine = ((pid_n >= first) & (pid_n < first + count)).to(tl.int32)
            g += i * mine
            start += mine * (lo + (pid_n - first) * BN)
            end += mine * hi
            first += count
        rows = pid_m * BM + tl.arange(0, BM)
        row_in = rows < M
        ns = start + tl.arange(0, BN)
        n_in = ns < end
        c, row_on, col_on = _mask_block(c_ptr, rows, row_in, rows_per_mask, SR, SR_PAD)
        cols = tl.arange(0, SR_PAD)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        t = tl.zeros((BM, SR_PAD), dtype=tl.float32)
        for k0 in range(0, K, BK):
            ks = k0 + tl.arange(0, BK)
            k_in = ks < K
            if EVEN_K:
                xt = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=row_in[:, None], other=0.0)
                wt = tl.load(w_ptr + ns[None, :] * stride_w + ks[:, None], mask=n_in[None, :], other=0.0)
            else:
                xt = tl.load(
                    x_ptr + rows[:, None] * stride_x + ks[None, :], mask=row_in[:, None] & k_in[None, :], other=0.0
                )
                wt = tl.load(
                    w_ptr + ns[None, :] * stride_w + ks[:, None], mask=n_in[None, :] & k_in[:, None], other=0.0
                )
            # rows of slots no row of the block uses are never read
            at = tl.load(
                a_ptr + (g * SR + cols)[None, :] * stride_a + ks[:, None],
                mask=col_on[None, :] & k_in[:, None],
                other=0.0,
            )
            acc += tl.dot(xt, wt)
            t += tl.dot(xt, at)
        b = tl.load(
            bt_ptr + cols[:, None] * stride_bt + ns[None, :],
            mask=col_on[:, None] & n_in[None, :],
            other=0.0,
        )
        acc += tl.dot((t * c).to(b.dtype), b)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + ns, mask=n_in, other=0.0).to(tl.float32)[None, :]
        tl.store(
            y_ptr + rows[:, None] * stride_y + ns[None, :],
            acc.to(y_ptr.dtype.element_ty),
            mask=row_in[:, None] & n_in[None, :],
        )
