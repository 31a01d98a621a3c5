"""The one-token decode step's attention in Triton: split over the cache, then combine the stretches.

`decode_attention` views a grouped-query step's query as [batch, kv_heads, g, dim] and hands it to
torch's SDPA with the static cache's additive mask. torch picks cuDNN's flash kernel for that,
which is built for long queries: at Qwen2.5-1.5B, batch 64, a 256-position cache, it took 13.4
us a layer where the cache's bytes take about 4 at an H100's bandwidth, and 40 us at batch 256
(decode_breakdown_rope_h100.json: 0.38 and 1.12 ms of the 3.47 and 5.18 ms steps).

Here (flash-decoding) one program takes one (row, KV head) and one stretch of the cache: it
loads the g queries that share the KV head once, streams its keys and values in blocks, and
keeps a running softmax (max, sum, weighted values) in float32. A stretch of several blocks
reads keys and values only from the block of its first position the mask opens to its last: a
scan of the mask (2 bytes a position) finds them. Positions closed (False, -inf, or the mask
dtype's lowest value, which transformers' and lorabus's caches write) weigh exactly zero beside
any open one, and a continuous-batching slab's rows are mostly unwritten tail (a 1,024-position
slab row 200 tokens long reads a fifth of its cache), a static cache's rows their future. A
stretch of one block reads its keys at once: at batch 64 a step is bound by such chains of
loads, not by their bytes, and the scan would lengthen them. The stretches are sized so a
step has enough programs to cover the GPU at any batch; a second launch merges each (row, KV
head)'s stretches by their log-sum-exps (none where a batch is large enough for one stretch
each: the one launch writes the output). Scores are `q . k * scale + mask` as SDPA computes
them; on a GPU in half precision the probabilities are rounded to TF32 (10 bits) as the tensor
cores weight the values, finer than the half-precision rounding flash kernels make there. The
result differs from SDPA's in that rounding and the order of the float32 sums.

`attend` returns None for a call it does not take (a query of more than one position, a head
size that is not a power of two from 16 to 256, a mask that is not [batch or 1, 1, 1, length],
a tensor that needs its gradient, a CPU tensor outside Triton's interpreter); the caller then
runs SDPA. LORABUS_FUSED_ATTENTION=0 turns it off (read at each call); a kernel that fails to
build is given up once, with a log line. Launches read no device value on the host, so a CUDA
graph captures them as they are.

Invariant: where it runs, the output is SDPA's softmax(q k^T * scale + mask) v for every query
head, [batch, kv_heads, g, dim] in the query's dtype, up to float32 summation order; a row whose
mask closes every position gets zeros (as flash kernels give; SDPA gives NaN or the mean of the
values, by the mask's kind), which no decode reads: every live row attends to its own prompt.
"""

from __future__ import annotations

import os

import torch

from services.rollout.lora_kernels import give_up, triton, triton_runs

if triton is not None:
    import triton.language as tl

BLOCK_N = 64
"""cache positions per step of a program's loop"""

TARGET_PROGRAMS = 512
"""programs a step aims for: about four per SM of an H100 (132) or H200, so that a small batch
still keeps the GPU's bandwidth busy"""

_BROKEN: list[str] = []
"""why the kernel failed in this process (then it is not tried again)"""


def available(device: torch.device) -> bool:
    """Triton on a CUDA device, or its interpreter (TRITON_INTERPRET=1: tests on CPU);
    LORABUS_FUSED_ATTENTION=0 turns it off."""
    return triton_runs(device, "LORABUS_FUSED_ATTENTION", _BROKEN)


def takes(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether the kernel computes this step: query [b, kv_heads, g, d], key and value
    [b, kv_heads, L, d] with each head's positions evenly strided and d contiguous, one dtype
    (float32, bfloat16, float16), d a power of two in [16, 256], mask None or
    [b or 1, 1, 1, >= L] (additive, or boolean with True to attend)."""
    if query.dim() != 4 or key.dim() != 4 or key.shape != value.shape:
        return False
    b, h, g, d = query.shape
    if key.shape[:2] != (b, h) or key.shape[3] != d or key.shape[2] == 0 or g == 0:
        return False
    if d < 16 or d > 256 or d & (d - 1) or query.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    if key.dtype != query.dtype or value.dtype != query.dtype:
        return False
    if any(t.stride(-1) != 1 for t in (query, key, value)):
        return False
    if mask is not None:
        if mask.dim() != 4 or mask.shape[0] not in (1, b) or mask.shape[1:3] != (1, 1) or mask.shape[3] < key.shape[2]:
            return False
        if mask.dtype not in (torch.bool, query.dtype, torch.float32) or mask.device != query.device:
            return False
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    return not grad and available(query.device)


def target_programs() -> int:
    """TARGET_PROGRAMS, or LORABUS_ATTENTION_PROGRAMS where set (read at each launch, so a graph
    captures what it said): benchmarks/decode_breakdown.py's `few_stretches` variant sets 128,
    one program a (row, KV head) at batch 64 and no merge launch, against the 512 measured."""
    raw = os.environ.get("LORABUS_ATTENTION_PROGRAMS")
    if raw is None:
        return TARGET_PROGRAMS
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(
            f"LORABUS_ATTENTION_PROGRAMS: {raw!r} is not a positive integer; unset it for {TARGET_PROGRAMS}"
        )
    return int(raw)


def splits_for(batch_heads: int, length: int, target: int = TARGET_PROGRAMS) -> int:
    """How many stretches each (row, KV head) is cut into: enough for `target` programs, each at
    least one block long. A pure function of its arguments: a graph captured once stays right."""
    blocks = -(-length // BLOCK_N)
    want = -(-target // batch_heads)
    return max(1, min(blocks, want))


def attend(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor | None:
    """softmax(query key^T * scale + mask) value for one position (see the module docstring), or
    None where the kernel does not take the call or cannot be built."""
    if not takes(query, key, value, mask):
        return None
    try:
        return _launch(query, key, value, mask, scale)
    except Exception as exc:  # a Triton that cannot build it: SDPA's path, said once
        give_up(_BROKEN, exc, "fused decode attention", "attending with SDPA")
        return None


def _launch(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    assert triton is not None
    b, h, g, d = query.shape
    length = key.shape[2]
    per = -(-length // splits_for(b * h, length, target_programs()))
    span = -(-per // BLOCK_N) * BLOCK_N  # positions per stretch, in whole blocks
    splits = -(-length // span)
    out = torch.empty((b, h, g, d), dtype=query.dtype, device=query.device)
    if splits == 1:  # one stretch a (row, KV head), as at batch 256: its values are the output
        part, lse = out, out
    else:
        part = torch.empty((b, h, splits, g, d), dtype=torch.float32, device=query.device)
        lse = torch.empty((b, h, splits, g), dtype=torch.float32, device=query.device)
    # an additive mask closes a position with its dtype's lowest value (transformers' and the
    # static caches' masks) or -inf
    closed_at = torch.finfo(mask.dtype).min if mask is not None and mask.dtype.is_floating_point else 0.0
    if mask is None:
        mask_arg, mask_b, mask_l, has_mask, bool_mask = query, 0, 0, False, False
    else:
        mask_arg = mask.view(torch.int8) if mask.dtype == torch.bool else mask
        mask_b = 0 if mask.shape[0] == 1 else mask.stride(0)
        mask_l, has_mask, bool_mask = mask.stride(3), True, mask.dtype == torch.bool
    g_pad = max(16, triton.next_power_of_2(g))
    _attention_split[(b * h, splits)](
        query, key, value, mask_arg, part, lse, h, g, length, span, float(scale), closed_at,
        query.stride(0), query.stride(1), query.stride(2),
        key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2),
        mask_b, mask_l,
        has_mask=has_mask, bool_mask=bool_mask, direct=splits == 1, g_pad=g_pad, dim=d, block_n=BLOCK_N,
        # a stretch of one block has nothing to skip, and the scan would put a load before its keys'
        scan=has_mask and span > BLOCK_N,
        # the operands are widened to float32 in registers: TF32 holds a half-precision value
        # exactly, so the tensor cores' TF32 products are the half-precision ones; a float32
        # model gets float32 products
        precision="ieee" if query.dtype == torch.float32 else "tf32", num_warps=4,
    )  # fmt: skip
    if splits == 1:
        return out
    _attention_merge[(b * h * g,)](part, lse, out, splits, g, s_pad=triton.next_power_of_2(splits), dim=d, num_warps=4)
    return out


if triton is not None:

    @triton.jit
    def _opened(at, valid, closed_at, bool_mask: tl.constexpr):
        """Which of a block's positions the mask opens: True in a boolean mask, above its dtype's
        lowest value (`closed_at`) in an additive one; none past `valid`."""
        m = tl.load(at, mask=valid, other=0)
        opened = m != 0 if bool_mask else m.to(tl.float32) > closed_at
        return opened & valid

    @triton.jit
    def _attention_split(
        q_ptr, k_ptr, v_ptr, m_ptr, part_ptr, lse_ptr, heads, groups, length, span, scale, closed_at,
        sqb, sqh, sqg, skb, skh, skl, svb, svh, svl, smb, sml,
        has_mask: tl.constexpr, bool_mask: tl.constexpr, direct: tl.constexpr, scan: tl.constexpr,
        g_pad: tl.constexpr, dim: tl.constexpr, block_n: tl.constexpr, precision: tl.constexpr,
    ):  # fmt: skip
        """One program per ((row, KV head), stretch): the stretch's softmax-weighted values and
        log-sum-exp for each of the g queries; `direct` (one stretch): the values alone, in the
        output's dtype, into the output."""
        bh = tl.program_id(0).to(tl.int64)
        split = tl.program_id(1)
        row = bh // heads
        head = bh % heads
        gi = tl.arange(0, g_pad)
        di = tl.arange(0, dim)
        q_at = q_ptr + row * sqb + head * sqh + gi[:, None] * sqg + di[None, :]
        q = tl.load(q_at, mask=gi[:, None] < groups, other=0.0).to(tl.float32)
        run_max = tl.full((g_pad,), -float("inf"), tl.float32)
        run_sum = tl.zeros((g_pad,), tl.float32)
        acc = tl.zeros((g_pad, dim), tl.float32)
        k_base = k_ptr + row * skb + head * skh + di[None, :]
        v_base = v_ptr + row * svb + head * svh + di[None, :]
        lo = split * span
        hi = tl.minimum(lo + span, length)
        begin, end = lo, hi
        if scan:
            # the stretch's keys and values are read from its first open position's block to its
            # last open position only: the mask's closed blocks (a slab row's unwritten tail, a
            # short prompt's padding) weigh exactly zero beside any open position. The scan reads
            # 2 bytes a position where the loop below reads 4 * dim
            first, last = hi, lo - 1
            for start in range(lo, hi, block_n):
                ni = start + tl.arange(0, block_n)
                opened = _opened(m_ptr + row * smb + ni * sml, ni < hi, closed_at, bool_mask)
                first = tl.minimum(first, tl.min(tl.where(opened, ni, hi), axis=0))
                last = tl.maximum(last, tl.max(tl.where(opened, ni, lo - 1), axis=0))
            begin = lo + (first - lo) // block_n * block_n
            end = last + 1
        for start in range(begin, end, block_n):
            ni = start + tl.arange(0, block_n)
            valid = ni < end
            k = tl.load(k_base + ni[:, None] * skl, mask=valid[:, None], other=0.0).to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=precision) * scale
            if has_mask:
                at = m_ptr + row * smb + ni * sml
                if bool_mask:
                    s = tl.where(_opened(at, valid, closed_at, bool_mask)[None, :], s, -float("inf"))
                else:
                    s = s + tl.load(at, mask=valid, other=0).to(tl.float32)[None, :]
            s = tl.where(valid[None, :], s, -float("inf"))
            new_max = tl.maximum(run_max, tl.max(s, axis=1))
            # a row of the block with nothing to attend to yet keeps its sums (-inf - -inf is NaN)
            safe = tl.where(new_max == -float("inf"), 0.0, new_max)
            p = tl.exp(s - safe[:, None])
            alpha = tl.exp(run_max - safe)
            v = tl.load(v_base + ni[:, None] * svl, mask=valid[:, None], other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=precision)
            run_sum = run_sum * alpha + tl.sum(p, axis=1)
            run_max = new_max
        seen = run_sum > 0
        out = acc / tl.where(seen, run_sum, 1.0)[:, None]
        where = (bh * tl.num_programs(1) + split) * groups + gi
        tl.store(
            part_ptr + where[:, None] * dim + di[None, :], out.to(part_ptr.dtype.element_ty), mask=gi[:, None] < groups
        )
        if not direct:
            tl.store(lse_ptr + where, tl.where(seen, run_max + tl.log(run_sum), -float("inf")), mask=gi < groups)

    @triton.jit
    def _attention_merge(part_ptr, lse_ptr, out_ptr, splits, groups, s_pad: tl.constexpr, dim: tl.constexpr):
        """One program per (row, KV head, query): its stretches merged by their log-sum-exps."""
        pid = tl.program_id(0).to(tl.int64)
        bh = pid // groups
        gq = pid % groups
        si = tl.arange(0, s_pad)
        di = tl.arange(0, dim)
        at = (bh * splits + si) * groups + gq
        lse = tl.load(lse_ptr + at, mask=si < splits, other=-float("inf"))
        big = tl.max(lse, axis=0)
        w = tl.exp(lse - tl.where(big == -float("inf"), 0.0, big))
        part = tl.load(part_ptr + at[:, None] * dim + di[None, :], mask=(si < splits)[:, None], other=0.0)
        total = tl.sum(w, axis=0)
        # a row whose mask closes every position has no stretch to merge: zeros, as flash kernels give
        out = tl.sum(part * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
        tl.store(out_ptr + pid * dim + di, out.to(out_ptr.dtype.element_ty))
