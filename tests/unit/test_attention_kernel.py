"""The decode attention kernel (`attention_kernel`) against torch's SDPA, and the engine's decodes
with it on and off, on CPU under Triton's interpreter (in one child process for the module:
tests/fixtures/interpreted.py says why). On a GPU the same source compiles;
benchmarks/decode_breakdown.py --variants fused_swiglu fused_attention times it there.

What "the same" means: SDPA's softmax(q k^T * scale + mask) v computed in float32, with the sums
in another order (and on a GPU in half precision, the probabilities rounded to TF32): float32 to
1e-5, half precision to a few units of its own last place.
"""

import logging
import os

import pytest
import torch

from tests.fixtures.broken_kernel import ERROR, break_kernel
from tests.fixtures.interpreted import Outcome, checks_in, run_checks

pytestmark = pytest.mark.unit

SWITCHES = ("LORABUS_FUSED_ATTENTION", "LORABUS_FUSED_SWIGLU", "LORABUS_FUSED_NORM_KERNEL", "LORABUS_FUSED_KV_WRITE",
            "LORABUS_FUSED_ROPE", "LORABUS_FUSED_SAMPLER")  # fmt: skip

INTERPRETED = checks_in(
    __file__,
    {
        "steps": ("check_steps",),
        "static engine": ("interpreted_static_engine",),
        "slab engine": ("interpreted_slab_engine",),
    },
)


@pytest.fixture(scope="module")
def outcomes() -> dict[str, Outcome]:
    pytest.importorskip("triton")
    return run_checks(INTERPRETED, drop_env=SWITCHES)


def test_the_kernel_attends_as_sdpa_does(outcomes):
    assert "steps checked" in outcomes["steps"].output()


def test_the_batch_engine_decodes_the_same_with_the_kernel_on_and_off(outcomes):
    assert "static engine checked" in outcomes["static engine"].output()


def test_the_slab_engine_decodes_the_same_with_the_kernel_on_and_off(outcomes):
    assert "slab engine checked" in outcomes["slab engine"].output()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the interpreted tests stand for it")
def test_on_a_gpu_the_compiled_kernel_attends_as_sdpa_does(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.delenv("LORABUS_FUSED_ATTENTION", raising=False)
    check_steps("cuda")


def test_the_kernel_builds_for_an_h100_with_its_mask_scan():
    """The interpreter runs the kernel as Python, which takes what Triton's compiler may not (a
    loop over bounds computed in the kernel): built for sm_90 here, the masked kernel has the
    scan's loop that the unmasked one lacks."""
    pytest.importorskip("triton")
    from services.rollout import attention_kernel
    from tests.fixtures.ptx import sm90_ptx

    args = ("q_ptr k_ptr v_ptr m_ptr part_ptr lse_ptr heads groups length span scale closed_at "
            "sqb sqh sqg skb skh skl svb svh svl smb sml").split()  # fmt: skip
    types = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "m_ptr": "*bf16", "part_ptr": "*fp32",
             "lse_ptr": "*fp32", "scale": "fp32", "closed_at": "fp32"}  # fmt: skip
    signature = {a: types.get(a, "i32") for a in args}
    signature |= dict.fromkeys(
        ("has_mask", "bool_mask", "direct", "scan", "g_pad", "dim", "block_n", "precision"), "constexpr"
    )
    branches = {}
    for has_mask in (True, False):
        constants = {"has_mask": has_mask, "bool_mask": False, "direct": False, "scan": has_mask, "g_pad": 16,
                     "dim": 128, "block_n": 64, "precision": "tf32"}  # fmt: skip
        ptx = sm90_ptx(attention_kernel._attention_split, signature, constants, num_warps=4)
        branches[has_mask] = ptx.count("bra")
    assert branches[True] > branches[False]


def test_the_programs_a_step_aims_for_can_be_set_and_a_bad_setting_is_named(monkeypatch):
    from services.rollout.attention_kernel import TARGET_PROGRAMS, splits_for, target_programs

    monkeypatch.delenv("LORABUS_ATTENTION_PROGRAMS", raising=False)
    assert target_programs() == TARGET_PROGRAMS
    monkeypatch.setenv("LORABUS_ATTENTION_PROGRAMS", "128")
    assert target_programs() == 128
    # batch 64 of two KV heads on a 256-position cache: four stretches at 512, one at 128
    assert splits_for(128, 256, TARGET_PROGRAMS) == 4 and splits_for(128, 256, target_programs()) == 1
    for bad in ("0", "-4", "many"):
        monkeypatch.setenv("LORABUS_ATTENTION_PROGRAMS", bad)
        with pytest.raises(ValueError, match="LORABUS_ATTENTION_PROGRAMS: .* not a positive integer; unset it"):
            target_programs()


def test_a_step_is_cut_into_enough_stretches_to_cover_the_gpu_and_no_more_than_its_blocks():
    from services.rollout.attention_kernel import BLOCK_N, TARGET_PROGRAMS, splits_for

    for batch_heads in (1, 2, 16, 128, 512, 4096):
        for length in (1, BLOCK_N, 256, 4096, 32768):
            splits = splits_for(batch_heads, length)
            blocks = -(-length // BLOCK_N)
            assert 1 <= splits <= blocks
            assert splits == blocks or batch_heads * splits >= TARGET_PROGRAMS


def test_calls_it_does_not_take_are_left_to_sdpa(monkeypatch):
    pytest.importorskip("triton")
    from services.rollout import attention_kernel

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # what makes a CPU tensor eligible
    monkeypatch.delenv("LORABUS_FUSED_ATTENTION", raising=False)
    monkeypatch.setattr(attention_kernel, "_BROKEN", [])
    q, k = torch.randn(2, 2, 6, 32), torch.randn(2, 2, 40, 32)
    mask = torch.zeros(2, 1, 1, 48)
    takes = attention_kernel.takes
    assert takes(q, k, k, mask) and takes(q, k, k, None) and takes(q, k, k, mask[:1]) and takes(q, k, k, mask > 0)
    assert not takes(q, k, k, mask[..., :39])  # a mask shorter than the cache
    assert not takes(q, k, k, torch.zeros(2, 1, 6, 40))  # a mask per query: not a one-token step's
    assert not takes(q, k, k, mask.double())
    assert not takes(q[..., :24], k[..., :24], k[..., :24], mask)  # head size not a power of two
    assert not takes(q[..., :8], k[..., :8], k[..., :8], mask)  # below 16
    assert not takes(q, k.half(), k.half(), mask)
    assert not takes(q, k.transpose(2, 3).contiguous().transpose(2, 3), k, mask)  # d strided
    assert not takes(q.requires_grad_(), k, k, mask)  # training: autograd's path
    monkeypatch.setenv("LORABUS_FUSED_ATTENTION", "0")
    assert not attention_kernel.available(torch.device("cuda"))
    monkeypatch.delenv("LORABUS_FUSED_ATTENTION")
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not attention_kernel.available(torch.device("cpu"))


def test_a_kernel_that_fails_is_left_for_sdpa_once_and_said(monkeypatch, caplog):
    pytest.importorskip("triton")
    from services.rollout import attention_kernel, decode_attention

    calls = break_kernel(monkeypatch, attention_kernel, "LORABUS_FUSED_ATTENTION")
    g = torch.Generator().manual_seed(1)
    module = torch.nn.Module()
    module.num_key_value_groups = 3
    q, k, v = torch.randn(2, 6, 1, 16, generator=g), torch.randn(2, 2, 9, 16, generator=g), torch.randn(2, 2, 9, 16)
    want = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1))
    with caplog.at_level(logging.WARNING), torch.no_grad():
        for _ in range(3):
            out, _ = decode_attention.grouped_decode_attention(module, q, k, v, None)
            torch.testing.assert_close(out, want.transpose(1, 2))
    assert calls == [1] and caplog.text.count(ERROR) == 1


# --- run in the interpreted child process (the step check also on a GPU) ---


def sdpa(q, k, v, mask, scale) -> torch.Tensor:
    """The reference in float32: each query head against its KV head."""
    m = None if mask is None else (mask if mask.dtype == torch.bool else mask.float())
    return torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=m, scale=scale)


@torch.no_grad()
def check_steps(device: str = "cpu") -> None:
    from services.rollout import attention_kernel

    g = torch.Generator().manual_seed(4)
    cases = [
        # (batch, kv heads, queries per KV head, head size, cache length, dtype, mask)
        (2, 2, 6, 64, 100, torch.float32, "additive"),
        (3, 2, 6, 128, 257, torch.float32, "bool"),  # a last stretch of one position
        (1, 1, 1, 16, 5, torch.float32, None),
        (4, 2, 7, 32, 130, torch.float16, "additive"),
        (5, 4, 2, 128, 192, torch.bfloat16, "additive"),
        (64, 2, 6, 128, 256, torch.bfloat16, "additive"),  # Qwen2.5-1.5B's decode step
        (256, 2, 6, 64, 130, torch.bfloat16, "additive"),  # one stretch a row: no merge
        (64, 2, 6, 64, 1024, torch.bfloat16, "slab"),  # rows far shorter than the slab: blocks skipped
        (3, 2, 6, 64, 700, torch.float32, "slab bool"),
    ]
    for b, h, gq, d, length, dtype, kind in cases:
        # the query as the model hands it: [b, heads, 1, d], viewed per KV head
        q = torch.randn(b, h * gq, 1, d, generator=g).to(dtype).reshape(b, h, gq, d)
        k, v = (torch.randn(b, h, length, d, generator=g).to(dtype) for _ in range(2))
        # left padding and an unwritten tail, as the static cache has them
        pos = torch.arange(length)
        start = torch.randint(0, length // 2, (b, 1), generator=g)
        end = torch.randint(length // 2, length, (b, 1), generator=g) + 1
        if kind is not None and kind.startswith("slab"):  # a row's keys from 0 to its length, some in one block
            start, end = torch.zeros_like(start), torch.randint(1, 200, (b, 1), generator=g)
            end[0] = 3
        keep = (pos >= start) & (pos < end)
        if kind in ("additive", "slab"):
            mask = torch.where(keep, 0.0, torch.finfo(dtype).min).to(dtype)[:, None, None, :]
        else:
            mask = None if kind is None else keep[:, None, None, :]
        k_read, v_read = k.clone(), v.clone()
        block = attention_kernel.BLOCK_N
        span = -(-length // attention_kernel.splits_for(b * h, length) // block) * block
        if kind is not None and span > block:
            # stretches of several blocks scan the mask: NaN in the blocks before a row's first
            # open position and after its last, which must never be read
            unread = (pos < start // block * block) | (pos >= (end + block - 1) // block * block)
            k_read[unread[:, None, :, None].expand_as(k)] = float("nan")
            v_read[unread[:, None, :, None].expand_as(v)] = float("nan")
        got = attention_kernel.attend(
            q.to(device), k_read.to(device), v_read.to(device), None if mask is None else mask.to(device), d**-0.5
        )
        assert got is not None, (b, h, gq, d, length, dtype, kind)
        want = sdpa(q, k, v, mask, d**-0.5)
        assert got.dtype == dtype and got.shape == (b, h, gq, d)
        tol = 1e-5 if dtype == torch.float32 else 4 * torch.finfo(dtype).eps
        torch.testing.assert_close(got.float().cpu(), want, atol=tol, rtol=tol)
    # a row with nothing to attend to (a free slab row): zeros, never NaN, beside a row that is served
    q = torch.randn(2, 2, 6, 64, generator=g)
    k, v = (torch.randn(2, 2, 300, 64, generator=g) for _ in range(2))
    for closed in (torch.zeros(2, 1, 1, 300, dtype=torch.bool), torch.full((2, 1, 1, 300), float("-inf"))):
        mask = closed.clone()
        mask[1, ..., :90] = True if mask.dtype == torch.bool else 0.0
        got = attention_kernel.attend(q.to(device), k.to(device), v.to(device), mask.to(device), 0.125)
        assert got is not None
        assert torch.equal(got[0].cpu(), torch.zeros_like(got[0].cpu()))
        torch.testing.assert_close(got[1].cpu(), sdpa(q, k, v, mask, 0.125)[1], atol=1e-5, rtol=1e-5)
    print("steps checked")


def same_on_and_off(slab_rows: int) -> None:
    from services.rollout import attention_kernel
    from tests.fixtures.kernel_engine import assert_same_answers, off_and_on
    from tests.fixtures.tiny import tiny_qwen2

    def model():  # head size 16: the kernel's smallest
        return tiny_qwen2(seed=6, head_dim=16)

    for dtype in (torch.float32, torch.bfloat16):
        for switch in SWITCHES[1:]:
            os.environ[switch] = "0" if dtype == torch.float32 else "1"
        off, on = off_and_on(attention_kernel, "LORABUS_FUSED_ATTENTION", model, dtype, slab_rows)
        assert_same_answers(on, off, tol=1e-5 if dtype == torch.float32 else 3e-2)


def interpreted_static_engine() -> None:
    same_on_and_off(slab_rows=0)
    print("static engine checked")


def interpreted_slab_engine() -> None:
    same_on_and_off(slab_rows=3)
    print("slab engine checked")
