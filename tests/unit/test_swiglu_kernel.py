"""The SwiGLU kernel (`swiglu_kernel`) against torch's `silu(gate) * up`, transformers' MLPs with it
routed in, and the engine's decodes with it on and off, on CPU under Triton's interpreter (in one
child process for the module: tests/fixtures/interpreted.py says why). On a GPU the same source
compiles; benchmarks/decode_breakdown.py --variants fused_norm_kernel fused_swiglu times it there.

What "the same" means: torch's roundings in torch's order, with Triton's `exp` in place of the
one torch calls. In half precision that leaves the output bit for bit torch's but where the SiLU
lands within a float32 ulp or two of a rounding tie (rare: at least 99.9 % of elements equal,
none further off than one ulp of the SiLU moves the product); in float32 a few ulps.
"""

import logging
import os

import pytest
import torch

from tests.fixtures.broken_kernel import ERROR, break_kernel
from tests.fixtures.interpreted import Outcome, checks_in, run_checks

pytestmark = pytest.mark.unit

SWITCHES = ("LORABUS_FUSED_SWIGLU", "LORABUS_FUSED_NORM_KERNEL", "LORABUS_FUSED_KV_WRITE", "LORABUS_FUSED_ROPE",
            "LORABUS_FUSED_SAMPLER")  # fmt: skip

INTERPRETED = checks_in(
    __file__,
    {
        "products": ("check_products",),
        "corrected products": ("check_corrected_products",),
        "mlps": ("check_mlps",),
        "static engine": ("interpreted_static_engine",),
        "slab engine": ("interpreted_slab_engine",),
    },
)


@pytest.fixture(scope="module")
def outcomes() -> dict[str, Outcome]:
    pytest.importorskip("triton")
    return run_checks(INTERPRETED, drop_env=SWITCHES)


def test_the_kernel_is_torchs_silu_times_up_on_a_matmuls_column_slices(outcomes):
    assert "products checked" in outcomes["products"].output()


def test_gate_and_up_get_their_lora_correction_in_the_same_launch(outcomes):
    assert "corrected products checked" in outcomes["corrected products"].output()


def test_transformers_gated_mlps_are_routed_through_it_and_others_are_not(outcomes):
    assert "mlps checked" in outcomes["mlps"].output()


def test_the_batch_engine_decodes_the_same_with_the_kernel_on_and_off(outcomes):
    assert "static engine checked" in outcomes["static engine"].output()


def test_the_slab_engine_decodes_the_same_with_the_kernel_on_and_off(outcomes):
    assert "slab engine checked" in outcomes["slab engine"].output()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the interpreted tests stand for it")
def test_on_a_gpu_the_compiled_kernel_is_torchs_product_too(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.delenv("LORABUS_FUSED_SWIGLU", raising=False)
    check_products("cuda")
    check_corrected_products("cuda")


def test_compiled_for_an_h100_it_calls_libdevices_exp_and_divides_exactly():
    """Triton's own `exp` and `/` (ex2.approx of -g*log2(e), div.full) put float32 products on an
    H100 more than 4 ulps from torch's; compiled, the kernel calls libdevice's expf (a fused
    range reduction before its ex2) and divides correctly rounded."""
    pytest.importorskip("triton")
    from services.rollout import swiglu_kernel
    from tests.fixtures.ptx import sm90_ptx

    signature = {"g_ptr": "*fp32", "u_ptr": "*fp32", "o_ptr": "*fp32", "g_row": "i32", "u_row": "i32",
                 "width": "i32", "block": "constexpr", "compiled": "constexpr"}  # fmt: skip
    ptx = sm90_ptx(swiglu_kernel._swiglu, signature, {"block": 1024, "compiled": True}, num_warps=4)
    assert "div.full" not in ptx and "div.rn.f32" in ptx
    assert "fma.rn.ftz.f32" in ptx  # expf's range reduction, which Triton's own exp has not
    own = sm90_ptx(swiglu_kernel._swiglu, signature, {"block": 1024, "compiled": False}, num_warps=4)
    assert "div.full" in own and "fma.rn.ftz.f32" not in own


def test_calls_it_does_not_take_are_left_to_torch(monkeypatch):
    pytest.importorskip("triton")
    from services.rollout import swiglu_kernel

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # what makes a CPU tensor eligible
    monkeypatch.delenv("LORABUS_FUSED_SWIGLU", raising=False)
    monkeypatch.setattr(swiglu_kernel, "_BROKEN", [])
    both = torch.randn(2, 3, 16)
    gate, up = both[..., :8], both[..., 8:]
    assert swiglu_kernel.takes(gate, up) and swiglu_kernel.takes(gate[0], up[1])
    assert not swiglu_kernel.takes(gate, up[..., :4])  # another shape
    assert not swiglu_kernel.takes(both.transpose(1, 2)[..., :2], both.transpose(1, 2)[..., 2:4])  # columns strided
    assert not swiglu_kernel.takes(both[:, ::2, :8], both[:, 1:, 8:])  # rows not evenly strided
    assert not swiglu_kernel.takes(gate.double(), up.double())  # float64: torch's
    assert not swiglu_kernel.takes(gate, up.half())
    assert not swiglu_kernel.takes(gate.clone().requires_grad_(), up)  # training: autograd's path
    monkeypatch.setenv("LORABUS_FUSED_SWIGLU", "0")
    assert not swiglu_kernel.available(torch.device("cuda"))
    monkeypatch.delenv("LORABUS_FUSED_SWIGLU")
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not swiglu_kernel.available(torch.device("cpu"))
    assert swiglu_kernel.silu_times(gate, up) is None


def test_a_kernel_that_fails_is_left_for_torch_once_and_said(monkeypatch, caplog):
    pytest.importorskip("triton")
    from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP

    from services.rollout import swiglu_kernel
    from tests.fixtures.tiny import tiny_qwen2

    calls = break_kernel(monkeypatch, swiglu_kernel, "LORABUS_FUSED_SWIGLU")
    mlp = Qwen2MLP(tiny_qwen2().config)
    forward = swiglu_kernel.gated_forward(mlp)
    x = torch.randn(3, mlp.hidden_size, generator=torch.Generator().manual_seed(2))
    with caplog.at_level(logging.WARNING), torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(forward(x), mlp(x))  # torch's product, every time
    assert calls == [1] and caplog.text.count(ERROR) == 1
    assert not swiglu_kernel.available(torch.device("cuda"))


# --- run in the interpreted child process (the product check also on a GPU) ---


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Within what one ulp of the rounded SiLU can move the product: where Triton's `exp` puts
    the SiLU on the other side of a rounding tie, the product moves by that ulp and its own
    rounding (across a binade that is two units of the product's last place)."""
    eps = torch.finfo(got.dtype).eps
    rtol = 4 * eps if got.dtype == torch.float32 else 2 * eps
    return bool(torch.allclose(got.float(), want.float(), rtol=rtol, atol=torch.finfo(got.dtype).tiny))


@torch.no_grad()
def check_products(device: str = "cpu") -> None:
    from services.rollout import swiglu_kernel

    g = torch.Generator().manual_seed(3)
    same = total = 0
    for i, (width, rows) in enumerate(((1, 1), (7, 3), (1024, 2), (1500, 64), (8960, 5))):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            # one matmul's output [rows, 2 * width]: the gate and up are its column halves; a
            # pre-activation's spread, both tails of the SiLU included
            both = (torch.randn(rows, 2 * width, generator=g) * (1 + 4 * (i % 2))).to(dtype)
            gate, up = both[:, :width], both[:, width:]
            got = swiglu_kernel.silu_times(gate.to(device), up.to(device))
            assert got is not None, (width, rows, dtype)
            got = got.cpu()
            want = torch.nn.functional.silu(gate) * up
            assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous()
            assert close(got, want), (width, rows, dtype)
            if dtype != torch.float32:
                same += int((got == want).sum())
                total += got.numel()
    # the MLP's [batch, positions, intermediate]
    both = torch.randn(2, 3, 2 * 96, generator=g).to(torch.bfloat16)
    got = swiglu_kernel.silu_times(both[..., :96].to(device), both[..., 96:].to(device)).cpu()
    assert close(got, torch.nn.functional.silu(both[..., :96]) * both[..., 96:])
    assert same >= 0.999 * total, (same, total)
    print(f"products checked: half precision bit for bit {same}/{total}")


@torch.no_grad()
def check_corrected_products(device: str = "cpu") -> None:
    """gate/up as the stacked matmul leaves them for a mixed-version batch (a column slice each
    of [rows, 2 * width + 2 * S * r], the shrink beside them) and their `Pending` correction:
    the product of the corrected gate and up, which `Pending.resolved` computes apart."""
    from services.rollout import lora_kernels, swiglu_kernel
    from tests.unit.test_decoder_layer import signs

    g = torch.Generator().manual_seed(8)
    shapes = [(40, 9, 3, 4, 1), (72, 37, 2, 16, 2)] if device == "cpu" else [(8960, 64, 4, 16, 1)]
    dtypes = (torch.float32,) if device == "cpu" else (torch.bfloat16,)
    for width, batch, n_slots, rank, per_row in shapes:
        for dtype in dtypes:
            rows, sr = batch * per_row, n_slots * rank
            ya = torch.randn(rows, 2 * width + 2 * sr, generator=g).to(device, dtype)
            y, t = ya[:, : 2 * width], ya[:, 2 * width :]
            bt = (torch.randn(sr, 2 * width, generator=g) / rank).to(device, dtype)
            cols = signs(batch, n_slots, rank, 0, dtype).to(device)
            pending = lora_kernels.Pending(y, t, cols, bt, per_row, rank, (0, width, 2 * width))
            got = swiglu_kernel.silu_times(y[:, :width], y[:, width:], pending)
            assert got is not None and got.shape == (rows, width) and got.is_contiguous()
            both = pending.resolved()
            want = torch.nn.functional.silu(both[:, :width]) * both[:, width:]
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(got, want, atol=tol, rtol=tol)
            plain = torch.nn.functional.silu(y[:, :width]) * y[:, width:]
            assert (want - plain).abs().max() > 0.1  # the correction is not nothing
            on_head = (cols == 0).all(1).repeat_interleave(per_row)
            assert close(got[on_head], plain[on_head])  # rows on the head: the plain product
    # a group of other bounds (not gate | up of equal widths) is left to the caller
    y = torch.randn(4, 20).to(device)
    odd = lora_kernels.Pending(y, torch.randn(4, 8).to(device), torch.ones(4, 4).to(device),
                               torch.randn(4, 20).to(device), 1, 4, (0, 12, 20))  # fmt: skip
    assert swiglu_kernel.silu_times(y[:, :10], y[:, 10:], odd) is None
    print("corrected products checked")


@torch.no_grad()
def check_mlps() -> None:
    from transformers.activations import ACT2FN
    from transformers.models.llama.configuration_llama import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaForCausalLM

    from services.rollout import swiglu_kernel
    from tests.fixtures.tiny import tiny_qwen2

    llama = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=61)  # fmt: skip
    for model in (tiny_qwen2(seed=4), LlamaForCausalLM(llama).eval()):
        ids = torch.tensor([[3, 9, 4, 1, 5]])
        want = model(ids).logits
        assert swiglu_kernel.use(model) == model.config.num_hidden_layers
        assert swiglu_kernel.use(model) == 0  # idempotent
        launches = []
        launch = swiglu_kernel._launch
        swiglu_kernel._launch = lambda *args: (launches.append(1), launch(*args))[1]
        try:
            got = model(ids).logits
        finally:
            swiglu_kernel._launch = launch
        assert len(launches) == model.config.num_hidden_layers
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert [n for n, _ in model.named_modules()] == [n for n, _ in type(model)(model.config).named_modules()]
    # a GELU MLP is not a SiLU one: not a candidate; one whose act_fn is SiLU by name but
    # computes something else fails the probe
    gelu = tiny_qwen2(seed=5, hidden_act="gelu")
    assert swiglu_kernel.use(gelu) == 0
    odd = tiny_qwen2(seed=5)
    for layer in odd.model.layers:
        layer.mlp.act_fn = ACT2FN["silu"]
        layer.mlp.act_fn.forward = lambda x: torch.nn.functional.silu(x) * 2
    assert swiglu_kernel.use(odd) == 0
    print("mlps checked")


def same_on_and_off(slab_rows: int) -> None:
    from services.rollout import swiglu_kernel
    from tests.fixtures.kernel_engine import assert_same_answers, off_and_on
    from tests.fixtures.tiny import tiny_qwen2

    # bfloat16 with every other kernel a GPU runs; float32 with torch's beside it, which halves
    # the interpreter's time
    for dtype in (torch.float32, torch.bfloat16):
        for switch in SWITCHES[1:]:
            os.environ[switch] = "0" if dtype == torch.float32 else "1"
        off, on = off_and_on(swiglu_kernel, "LORABUS_FUSED_SWIGLU", lambda: tiny_qwen2(seed=6), dtype, slab_rows)
        assert_same_answers(on, off, tol=1e-5 if dtype == torch.float32 else 2e-2)


def interpreted_static_engine() -> None:
    same_on_and_off(slab_rows=0)
    print("static engine checked")


def interpreted_slab_engine() -> None:
    same_on_and_off(slab_rows=3)
    print("slab engine checked")
