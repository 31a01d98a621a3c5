"""The sampler of one decode step as one Triton kernel: read each row's logits once.

`sampling.sample` in torch makes about twenty passes over [rows, vocab] in float32 (the cast, the
temperature, log-softmax, the Gumbel hash and its logs, two argmaxes): 2.2 ms of a 8.8 ms step at
batch 256 on an H100 (decode_breakdown_h100.json), more than the GEMMs. This kernel streams each
row's logits once in blocks and keeps, in registers: the running max and sum of exp for the
log-softmax, the greedy argmax, and the argmax of logits / T + Gumbel noise, whose hash of
(row key, token id) it computes in place instead of reading a [rows, vocab] tensor.

A row is split into chunks of `CHUNK` tokens, one program each, and a second launch combines a
row's chunks (the log-sum-exp from each chunk's max and sum, the argmaxes by value, ties to the
earlier chunk). With one program a row, a batch of 64 on Qwen2.5's vocabulary kept 64 of an
H100's 132 SMs busy, each streaming 152 K logits alone: 0.18 ms of a 3.47 ms step
(decode_breakdown_rope_h100.json), where reading the 19 MB takes about 6 us.

Invariant: the same tokens and logprobs as `sampling.sample` without truncation (top_p = 1,
top_k = 0): the same hash (`_mix32` on int32 bit patterns), the same float32 scaling (a
division by T, not a product with 1/T), argmax ties to the lowest token id. The logs of the
noise and the log-sum-exp may differ from torch's in the last bit, so a token can part at a
near-tie of the noisy logits; it is still a pure function of (seed, step, logits), whatever the
batch (the chunks are fixed by the vocabulary, not by the batch). tests/unit/test_sample_kernel.py
checks it against torch under Triton's interpreter on CPU; benchmarks/sampler.py measures both on
a GPU and counts agreement.
"""

from __future__ import annotations

import torch

from services.rollout.lora_kernels import triton

if triton is not None:
    import triton.language as tl

BLOCK = 2048
"""tokens per step of a chunk's loop (8 KB of float32 in registers across the program)"""

CHUNK = 4 * BLOCK
"""tokens per program: 19 programs a row on Qwen2.5's 151,936, enough for a batch of one to
spread over the SMs and few enough that the combine reads a handful of partials"""


def sample_fused(
    logits: torch.Tensor, temperature: torch.Tensor, row_key: torch.Tensor, chunk: int = CHUNK
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [rows] (int64) and their logprobs [rows] (float32) for logits [rows, vocab] (any
    float dtype, last dim contiguous), temperature [rows] (<= 0: greedy) and each row's int32
    key (`sampling.row_keys`). `chunk` (a multiple of BLOCK) is for tests of the combine."""
    assert triton is not None
    if chunk % BLOCK:
        raise ValueError(f"chunk: {chunk}, not a multiple of BLOCK ({BLOCK}); pass a multiple")
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    chunks = triton.cdiv(vocab, chunk)
    # per chunk: max, sum of exp below it, greedy top, drawn top, the drawn token's logit; and
    # the two argmaxes
    floats = torch.empty((rows, chunks, 5), dtype=torch.float32, device=logits.device)
    ids = torch.empty((rows, chunks, 2), dtype=torch.int32, device=logits.device)
    temperature = temperature.float().contiguous()
    _sample_chunk[(rows, chunks)](
        logits, temperature, row_key.to(torch.int32).contiguous(), floats, ids,
        vocab, logits.stride(0), chunks, CHUNK=chunk, BLOCK=BLOCK, num_warps=8,
    )  # fmt: skip
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    _sample_combine[(rows,)](temperature, floats, ids, tokens, logprobs, chunks, C=triton.next_power_of_2(chunks))
    return tokens, logprobs


if triton is not None:

    @triton.jit
    def _mix32(x):
        """`sampling._mix32` on int32: the product wraps mod 2**32; shifts made logical by masks."""
        x = (x ^ ((x >> 16) & 0xFFFF)) * 0x45D9F3B
        x = (x ^ ((x >> 16) & 0xFFFF)) * 0x45D9F3B
        return x ^ ((x >> 16) & 0xFFFF)

    @triton.jit
    def _sample_chunk(
        logits_ptr, temp_ptr, key_ptr, floats_ptr, ids_ptr, V, stride, chunks,
        CHUNK: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        """One program per (row, chunk): one pass over the chunk's logits."""
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        t = tl.load(temp_ptr + row)
        t = tl.where(t <= 0.0, 1.0, t)
        key = tl.load(key_ptr + row)
        base = logits_ptr + row.to(tl.int64) * stride
        run_max = -float("inf")
        run_sum = 0.0
        top = -float("inf")  # greedy: the largest scaled logit so far, and where
        top_i = 0
        drawn = -float("inf")  # sampled: the largest scaled logit + noise so far, where, and its logit
        drawn_i = 0
        drawn_x = 0.0
        lo = chunk * CHUNK
        for start in range(lo, tl.minimum(lo + CHUNK, V), BLOCK):
            offs = start + tl.arange(0, BLOCK)
            valid = offs < V
            x = tl.load(base + offs, mask=valid, other=-float("inf")).to(tl.float32) / t
            block_max = tl.max(x, axis=0)
            new_max = tl.maximum(run_max, block_max)
            run_sum = run_sum * tl.exp(run_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
            run_max = new_max
            i = tl.argmax(x, axis=0)
            if block_max > top:
                top = block_max
                top_i = start + i
            bits = _mix32(key ^ _mix32(offs.to(tl.int32)))
            u = (((bits >> 8) & 0xFFFFFF).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
            y = x - tl.log(-tl.log(u))
            j = tl.argmax(y, axis=0)
            y_max = tl.max(y, axis=0)
            if y_max > drawn:
                drawn = y_max
                drawn_i = start + j
                drawn_x = tl.sum(tl.where(offs == start + j, x, 0.0), axis=0)
        at = row * chunks + chunk
        tl.store(floats_ptr + at * 5 + 0, run_max)
        tl.store(floats_ptr + at * 5 + 1, run_sum)
        tl.store(floats_ptr + at * 5 + 2, top)
        tl.store(floats_ptr + at * 5 + 3, drawn)
        tl.store(floats_ptr + at * 5 + 4, drawn_x)
        tl.store(ids_ptr + at * 2 + 0, top_i)
        tl.store(ids_ptr + at * 2 + 1, drawn_i)

    @triton.jit
    def _sample_combine(temp_ptr, floats_ptr, ids_ptr, tok_ptr, lp_ptr, chunks, C: tl.constexpr):
        """One program per row: its chunks' partials into the token and its logprob."""
        row = tl.program_id(0)
        greedy = tl.load(temp_ptr + row) <= 0.0
        c = tl.arange(0, C)
        valid = c < chunks
        at = row * chunks + c
        m = tl.load(floats_ptr + at * 5 + 0, mask=valid, other=-float("inf"))
        s = tl.load(floats_ptr + at * 5 + 1, mask=valid, other=0.0)
        top = tl.load(floats_ptr + at * 5 + 2, mask=valid, other=-float("inf"))
        drawn = tl.load(floats_ptr + at * 5 + 3, mask=valid, other=-float("inf"))
        drawn_x = tl.load(floats_ptr + at * 5 + 4, mask=valid, other=0.0)
        top_i = tl.load(ids_ptr + at * 2 + 0, mask=valid, other=0)
        drawn_i = tl.load(ids_ptr + at * 2 + 1, mask=valid, other=0)
        big = tl.max(m, axis=0)
        lse = big + tl.log(tl.sum(tl.where(valid, s * tl.exp(m - big), 0.0), axis=0))
        # argmax takes the first of equal values: a tie goes to the lower token id, as in one pass
        g = tl.argmax(top, axis=0)
        d = tl.argmax(drawn, axis=0)
        g_i = tl.sum(tl.where(c == g, top_i, 0), axis=0)
        g_x = tl.max(top, axis=0)
        d_i = tl.sum(tl.where(c == d, drawn_i, 0), axis=0)
        d_x = tl.sum(tl.where(c == d, drawn_x, 0.0), axis=0)
        tl.store(tok_ptr + row, tl.where(greedy, g_i, d_i).to(tl.int64))
        tl.store(lp_ptr + row, tl.where(greedy, g_x, d_x) - lse)
