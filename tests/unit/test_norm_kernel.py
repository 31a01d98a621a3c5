"""The RMSNorm kernel (`norm_kernel`) against transformers' own norm modules, and the engine's
decodes with it on and off, on CPU under Triton's interpreter (in one child process for the module:
tests/fixtures/interpreted.py says why). On a GPU the same source compiles;
benchmarks/decode_breakdown.py --variants fused_kv fused_norm_kernel times it there.

What "the same" means here: the kernel computes transformers' formula with transformers' order
of roundings; only the order in which a row's squares are summed is its own. Where every partial
sum is exact (`exact_rows`) that order cannot matter, and the output must be bit for bit the
module's, in every dtype. On random rows it must be the module's formula with the row's mean of
squares moved by a few float32 ulps, and nothing else.
"""

import logging
import os

import pytest
import torch

from tests.fixtures.broken_kernel import ERROR, break_kernel
from tests.fixtures.interpreted import Outcome, checks_in, run_checks

pytestmark = pytest.mark.unit

SWITCHES = ("LORABUS_FUSED_NORM_KERNEL", "LORABUS_FUSED_KV_WRITE", "LORABUS_FUSED_ROPE", "LORABUS_FUSED_SAMPLER")

WIDTHS = (1, 5, 64, 128, 896, 1536, 3584)
"""hidden and head sizes: Qwen2.5-0.5B 896, 1.5B 1536, 7B 3584, a head 128, odd ones"""

ROWS = (1, 3, 64, 256)
"""batch sizes of a decode step"""


WEIGHTS = ("own", "mixed")

INTERPRETED = checks_in(
    __file__,
    {
        **{f"exact {weights}": ("check_exact", weights) for weights in WEIGHTS},
        **{f"random {weights}": ("check_random", weights) for weights in WEIGHTS},
        "static engine": ("interpreted_static_engine",),
        "slab engine": ("interpreted_slab_engine",),
    },
)


@pytest.fixture(scope="module")
def outcomes() -> dict[str, Outcome]:
    pytest.importorskip("triton")
    return run_checks(INTERPRETED, drop_env=SWITCHES)


@pytest.mark.parametrize("weights", WEIGHTS)
def test_where_the_sums_are_exact_the_kernel_is_transformers_norm_bit_for_bit(outcomes, weights):
    assert "exact checked" in outcomes[f"exact {weights}"].output()


@pytest.mark.parametrize("weights", WEIGHTS)
def test_on_random_rows_only_the_order_of_the_sum_differs(outcomes, weights):
    assert "random checked" in outcomes[f"random {weights}"].output()


def test_the_batch_engine_decodes_the_same_with_the_kernel_on_and_off(outcomes):
    assert "static engine checked" in outcomes["static engine"].output()


def test_the_slab_engine_decodes_the_same_with_the_kernel_on_and_off(outcomes):
    assert "slab engine checked" in outcomes["slab engine"].output()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the interpreted tests stand for it")
@pytest.mark.parametrize("weights", WEIGHTS)
def test_on_a_gpu_the_compiled_kernel_is_transformers_norm_too(monkeypatch, weights):
    """The same checks on the GPU's compiled kernel, transformers' module on the CPU as reference:
    the GPU sums in its own tree, rounds bfloat16 by the same bits."""
    pytest.importorskip("triton")
    monkeypatch.delenv("LORABUS_FUSED_NORM_KERNEL", raising=False)
    check_exact(weights, "cuda")
    check_random(weights, "cuda")


def test_compiled_for_an_h100_every_thread_of_a_row_sums_the_same(monkeypatch):
    """Built as `_launch` builds it, the row's butterfly sum has no fused multiply-add: on an H100
    a thread that fused its own square held a sum its partner did not (9 float32 ulps)."""
    pytest.importorskip("triton")
    from services.rollout import norm_kernel
    from tests.fixtures.ptx import sm90_ptx

    signature = {"x_ptr": "*fp32", "w_ptr": "*fp32", "o_ptr": "*fp32", "eps": "fp32", "width": "constexpr",
                 "block": "constexpr"}  # fmt: skip
    ptx = sm90_ptx(norm_kernel._rms_norm, signature, {"width": 5, "block": 8}, num_warps=1, **norm_kernel.BUILD)
    assert "shfl.sync.bfly" in ptx and "fma" not in ptx
    assert ptx.count("div.rn.f32") == 2 and "sqrt.rn.f32" in ptx
    fused = sm90_ptx(norm_kernel._rms_norm, signature, {"width": 5, "block": 8}, num_warps=1)
    assert "fma.rn.f32" in fused  # what the check above would miss without BUILD


def test_calls_it_does_not_take_are_left_to_torch(monkeypatch):
    pytest.importorskip("triton")
    from services.rollout import norm_kernel

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # what makes a CPU tensor eligible
    monkeypatch.delenv("LORABUS_FUSED_NORM_KERNEL", raising=False)
    monkeypatch.setattr(norm_kernel, "_BROKEN", [])
    x, w = torch.randn(4, 8), torch.ones(8)
    assert norm_kernel.takes(x, w) and norm_kernel.takes(x.view(2, 2, 8), w)
    assert not norm_kernel.takes(torch.randn(8, 4).t(), w)  # rows not contiguous
    assert not norm_kernel.takes(x, torch.ones(16)[::2])  # a strided weight
    assert not norm_kernel.takes(x, torch.ones(4))  # a weight of another width
    assert not norm_kernel.takes(x.double(), w.double())  # float64: torch's
    assert not norm_kernel.takes(torch.randn(0, 8), w)
    assert not norm_kernel.takes(torch.randn(2, norm_kernel.MAX_WIDTH + 1), torch.ones(norm_kernel.MAX_WIDTH + 1))
    assert not norm_kernel.takes(x, w.requires_grad_())  # training: autograd's path
    with torch.no_grad():
        assert norm_kernel.takes(x, w)
    monkeypatch.setenv("LORABUS_FUSED_NORM_KERNEL", "0")
    assert not norm_kernel.available(torch.device("cuda"))
    monkeypatch.delenv("LORABUS_FUSED_NORM_KERNEL")
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not norm_kernel.available(torch.device("cpu"))
    assert norm_kernel.normalize(x, torch.ones(8), 1e-6) is None


def test_a_kernel_that_fails_is_left_for_torch_once_and_said(monkeypatch, caplog):
    pytest.importorskip("triton")
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    from services.rollout import fused_norm, norm_kernel

    calls = break_kernel(monkeypatch, norm_kernel, "LORABUS_FUSED_NORM_KERNEL")
    own = Qwen2RMSNorm(16, eps=1e-6)
    norm = fused_norm.RMSNorm(own.weight, own.variance_epsilon)
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(2))
    with caplog.at_level(logging.WARNING), torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(norm(x), own(x))  # torch's rms_norm, every time
    assert calls == [1] and caplog.text.count(ERROR) == 1
    assert not norm_kernel.available(torch.device("cuda"))


# --- run in the interpreted child process (the checks also on a GPU) ---


def own_norm(index: int, width: int, weight_dtype: torch.dtype, g: torch.Generator) -> torch.nn.Module:
    """transformers' RMSNorm of Qwen2, Llama or Qwen3 (by `index`), its weight not ones."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    cls, eps = ((Qwen2RMSNorm, 1e-6), (LlamaRMSNorm, 1e-5), (Qwen3RMSNorm, 1e-6))[index % 3]
    norm = cls(width, eps=eps)
    norm.weight = torch.nn.Parameter((torch.randn(width, generator=g) * 0.3 + 1.0).to(weight_dtype))
    return norm


def cases(weights: str) -> list[tuple[int, torch.dtype, torch.dtype, int]]:
    """(width, input dtype, weight dtype, rows): every width in every dtype, the batch sizes in
    turn (the interpreter runs a program in milliseconds: the full product would take minutes).
    `weights` "own": the weight in the input's dtype, as the model has it; "mixed": a float32
    weight under half-precision input and the reverse, so the output is float32 (torch promotes
    `weight * x`) and the normalised row is rounded to the input's dtype first, or not at all."""
    if weights == "own":
        pairs = [(d, d) for d in (torch.float32, torch.bfloat16, torch.float16)]
    else:
        pairs = [(torch.bfloat16, torch.float32), (torch.float16, torch.float32), (torch.float32, torch.bfloat16)]
    grid = [(width, dtype, weight_dtype) for width in WIDTHS for dtype, weight_dtype in pairs]
    return [(*case, ROWS[i % len(ROWS)]) for i, case in enumerate(grid)]


def exact_rows(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Quarters in [-4, 4]: every square is a multiple of 1/16 below 16, so every partial sum of a
    row of up to 2**18 of them is exact in float32, whatever order adds them."""
    return (torch.randint(-16, 17, shape, generator=g) / 4).to(dtype)


def on(device: str, x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor | None:
    """The kernel's norm of `x` with `norm`'s weight, computed on `device`, back on the CPU (where
    transformers' module computes the reference)."""
    from services.rollout import norm_kernel

    got = norm_kernel.normalize(x.to(device), norm.weight.to(device), norm.variance_epsilon)
    return None if got is None else got.cpu()


@torch.no_grad()
def check_exact(weights: str, device: str = "cpu") -> None:
    g = torch.Generator().manual_seed(5)
    for i, (width, dtype, weight_dtype, rows) in enumerate(cases(weights)):
        norm = own_norm(i, width, weight_dtype, g)
        x = exact_rows((rows, width), dtype, g)
        got, want = on(device, x, norm), norm(x)
        assert got is not None, (width, dtype, weight_dtype, rows)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want), (type(norm).__name__, width, dtype, weight_dtype, rows)
    # the layer's [b, s, hidden] and Qwen3's per-head q/k norm on [b, s, heads, head size]
    for i, shape in enumerate(((4, 7, 1536), (3, 1, 12, 128), (2, 5, 2, 128))):
        dtype, weight_dtype = cases(weights)[i][1:3]
        norm = own_norm(i, shape[-1], weight_dtype, g)
        x = exact_rows(shape, dtype, g)
        assert torch.equal(on(device, x, norm), norm(x)), shape
    print("exact checked")


def ulps_to_explain(x: torch.Tensor, weight: torch.Tensor, eps: float, got: torch.Tensor, most: int) -> torch.Tensor:
    """For each row, the fewest float32 ulps by which transformers' mean of squares must move for
    transformers' formula to give `got` bit for bit (`most` + 1 where none up to `most` does)."""
    x32 = x.float()
    mean = x32.pow(2).mean(-1, keepdim=True)
    need = torch.full(mean.shape[:-1], most + 1)
    for shift in sorted(range(-most, most + 1), key=abs):
        moved = (mean.view(torch.int32) + shift).view(torch.float32)  # the mean is positive
        formula = weight * (x32 * torch.rsqrt(moved + eps)).to(x.dtype)
        same = (formula == got).all(-1)
        need = torch.where(same & (need > most), abs(shift), need)
    return need


@torch.no_grad()
def check_random(weights: str, device: str = "cpu") -> None:
    g = torch.Generator().manual_seed(6)
    most = same = total = fp32_ulps = 0
    for i, (width, dtype, weight_dtype, rows) in enumerate(cases(weights)):
        # a residual stream's spread: rows of very different scales
        x = (torch.randn(rows, width, generator=g) * torch.rand(rows, 1, generator=g) * 40).to(dtype)
        norm = own_norm(i, width, weight_dtype, g)
        got, want = on(device, x, norm), norm(x)
        assert got is not None and got.dtype == want.dtype and got.shape == want.shape
        need = ulps_to_explain(x, norm.weight, norm.variance_epsilon, got, most=8)
        assert int(need.max()) <= 8, (width, dtype, weight_dtype, rows, need.max())
        most = max(most, int(need.max()))
        if dtype == torch.float32:  # nothing rounded in between; same signs: ulps = the bits' distance
            fp32_ulps = max(fp32_ulps, int((got.view(torch.int32) - want.view(torch.int32)).abs().max()))
        if dtype == weight_dtype == torch.bfloat16:
            same += int((got == want).sum())
            total += got.numel()
    if total:  # the model's dtype: a moved mean rarely crosses a bfloat16 rounding boundary
        assert same >= 0.999 * total, (same, total)
    print(f"random checked: the mean of squares moved by at most {most} float32 ulps; float32 outputs "
          f"{fp32_ulps} ulps from transformers' at most; bfloat16 outputs bit for bit {same}/{total}")  # fmt: skip


def norms_not_ones() -> torch.nn.Module:
    """The workload's model with norm weights that are not ones, so a norm that skipped them would show."""
    from tests.fixtures.tiny import tiny_qwen2

    model = tiny_qwen2(seed=6)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.3, generator=torch.Generator().manual_seed(7))
    return model


def same_on_and_off(slab_rows: int) -> None:
    from services.rollout import norm_kernel
    from tests.fixtures.kernel_engine import assert_same_answers, off_and_on

    for dtype in (torch.float32, torch.bfloat16):
        # bfloat16 with every kernel a GPU runs; float32 with torch's rotation, cache write and
        # sampler beside the norm, which halves the interpreter's time
        for switch in SWITCHES[1:]:
            os.environ[switch] = "0" if dtype == torch.float32 else "1"
        off, on = off_and_on(norm_kernel, "LORABUS_FUSED_NORM_KERNEL", norms_not_ones, dtype, slab_rows)
        # bfloat16 bit for bit (the norms' outputs are); float32 not: torch's rms_norm sums the
        # squares in its own order, and a logprob moves in its last bits (4.8e-7 at most here)
        assert_same_answers(on, off, tol=2e-6 if dtype == torch.float32 else 0.0)


def interpreted_static_engine() -> None:
    same_on_and_off(slab_rows=0)
    print("static engine checked")


def interpreted_slab_engine() -> None:
    same_on_and_off(slab_rows=3)
    print("slab engine checked")
