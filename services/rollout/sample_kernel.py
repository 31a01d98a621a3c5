"""The sampler of one decode step as one Triton kernel: read each row's logits once.

`sampling.sample` in torch makes about twenty passes over [rows, vocab] in float32 (the cast, the
temperature, log-softmax, the Gumbel hash and its logs, two argmaxes): 2.2 ms of a 8.8 ms step at
batch 256 on an H100 (decode_breakdown_h100.json), more than the GEMMs. This kernel streams each
row's logits once in blocks and keeps, in registers: the running max and sum of exp for the
log-softmax, the greedy argmax, and the argmax of logits / T + Gumbel noise, whose hash of
(row key, token id) it computes in place instead of reading a [rows, vocab] tensor.

Invariant: the same tokens and logprobs as `sampling.sample` without truncation (top_p = 1,
top_k = 0): the same hash (`_mix32` on int32 bit patterns), the same float32 scaling (a
division by T, not a product with 1/T), argmax ties to the lowest token id. The logs of the
noise and the log-sum-exp may differ from torch's in the last bit, so a token can part at a
near-tie of the noisy logits; it is still a pure function of (seed, step, logits), whatever the
batch. tests/unit/test_sample_kernel.py checks it against torch under Triton's interpreter on
CPU; benchmarks/sampler.py measures both on a GPU and counts agreement.
"""

from __future__ import annotations

import torch

from services.rollout.lora_kernels import triton

if triton is not None:
    import triton.language as tl

BLOCK = 2048
"""tokens per step of a row's loop (8 KB of float32 in registers across the program)"""


def sample_fused(
    logits: torch.Tensor, temperature: torch.Tensor, row_key: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [rows] (int64) and their logprobs [rows] (float32) for logits [rows, vocab] (any
    float dtype, last dim contiguous), temperature [rows] (<= 0: greedy) and each row's int32
    key (`sampling.row_keys`)."""
    assert triton is not None
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    _sample[(rows,)](
        logits, temperature.float().contiguous(), row_key.to(torch.int32).contiguous(), tokens, logprobs,
        vocab, logits.stride(0), BLOCK=BLOCK, num_warps=8,
    )  # fmt: skip
    return tokens, logprobs


if triton is not None:

    @triton.jit
    def _mix32(x):
        """`sampling._mix32` on int32: the product wraps mod 2**32; shifts made logical by masks."""
        x = (x ^ ((x >> 16) & 0xFFFF)) * 0x45D9F3B
        x = (x ^ ((x >> 16) & 0xFFFF)) * 0x45D9F3B
        return x ^ ((x >> 16) & 0xFFFF)

    @triton.jit
    def _sample(
        logits_ptr, temp_ptr, key_ptr, tok_ptr, lp_ptr, V, stride, BLOCK: tl.constexpr,
    ):  # fmt: skip
        """One program per row: one pass over its logits."""
        row = tl.program_id(0)
        t = tl.load(temp_ptr + row)
        greedy = t <= 0.0
        t = tl.where(greedy, 1.0, t)
        key = tl.load(key_ptr + row)
        base = logits_ptr + row.to(tl.int64) * stride
        run_max = -float("inf")
        run_sum = 0.0
        top = -float("inf")  # greedy: the largest scaled logit so far, and where
        top_i = 0
        drawn = -float("inf")  # sampled: the largest scaled logit + noise so far, where, and its logit
        drawn_i = 0
        drawn_x = 0.0
        for start in range(0, V, BLOCK):
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
        lse = run_max + tl.log(run_sum)
        tl.store(tok_ptr + row, tl.where(greedy, top_i, drawn_i).to(tl.int64))
        tl.store(lp_ptr + row, tl.where(greedy, top, drawn_x) - lse)
