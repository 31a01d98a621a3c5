"""The decoder layer's fused residual adds (`decoder_layer`, `norm_kernel.add_normalize`,
`lora_kernels.expand_stacked` with a residual, `lora_slots.deferred`) against transformers' layer
and the unfused corrections, on CPU under Triton's interpreter (in one child process for the
module: tests/fixtures/interpreted.py says why). On a GPU the same source compiles;
benchmarks/decode_breakdown.py --variants fused_attention fused_residual times it there.

What "the same" means: the sum `residual + x` is torch's bit for bit (each add rounded as torch
rounds it); the norm of it is `norm_kernel.normalize`'s bit for bit; a row's LoRA correction is
the stacked expand's up to the order its products are summed in.
"""

import os

import pytest
import torch

from tests.fixtures.interpreted import Outcome, checks_in, run_checks

pytestmark = pytest.mark.unit

SWITCHES = ("LORABUS_FUSED_RESIDUAL", "LORABUS_FUSED_NORM_KERNEL", "LORABUS_FUSED_SWIGLU", "LORABUS_FUSED_KV_WRITE",
            "LORABUS_FUSED_ROPE", "LORABUS_FUSED_SAMPLER")  # fmt: skip

INTERPRETED = checks_in(
    __file__,
    {
        "sums": ("check_sums",),
        "corrections": ("check_corrections",),
        "models": ("check_models",),
        "mixed model": ("check_mixed_model",),
        "static engine": ("interpreted_engine", "0"),
        "slab engine": ("interpreted_engine", "3"),
    },
)


@pytest.fixture(scope="module")
def outcomes() -> dict[str, Outcome]:
    pytest.importorskip("triton")
    return run_checks(INTERPRETED, drop_env=SWITCHES)


def test_the_fused_add_is_torchs_sum_and_the_norm_of_it_bit_for_bit(outcomes):
    assert "sums checked" in outcomes["sums"].output()


def test_a_deferred_correction_is_added_by_the_kernel_that_reads_the_output(outcomes):
    assert "corrections checked" in outcomes["corrections"].output()


def test_models_get_the_fused_layer_only_where_their_logits_stay_their_own(outcomes):
    assert "models checked" in outcomes["models"].output()


def test_a_mixed_version_batch_gives_the_unfused_logits_with_three_launches_fewer_a_layer(outcomes):
    assert "mixed model checked" in outcomes["mixed model"].output()


@pytest.mark.parametrize("engine", ["static engine", "slab engine"])
def test_the_engine_decodes_the_same_with_the_fused_layer_on_and_off(outcomes, engine):
    assert f"engine checked {engine.split()[0]}" in outcomes[engine].output()


def test_outside_a_slot_layer_nothing_is_deferred():
    from services.rollout import lora_slots

    proj = torch.nn.Linear(4, 4)
    with torch.no_grad(), lora_slots.deferred(proj) as late:
        out = proj(torch.randn(2, 4))
        assert late.take(out) is None


def test_a_held_correction_is_given_only_for_the_outputs_it_belongs_to():
    from services.rollout import lora_kernels, lora_slots

    y = torch.randn(3, 8)
    pending = lora_kernels.Pending(y, torch.randn(3, 8), torch.ones(3, 4), torch.randn(4, 8), 1, 2, (0, 5, 8))
    late = lora_slots.Late()
    late.hold(pending)
    with pytest.raises(RuntimeError, match="ran twice"):
        late.hold(pending)
    with pytest.raises(RuntimeError, match="not the layer's outputs"):
        late.take(y[:, :5].clone(), y[:, 5:])
    late.hold(pending)
    with pytest.raises(RuntimeError, match="not the layer's outputs"):
        late.take(y)  # the whole output, not its two members
    late.hold(pending)
    assert late.take(y[:, :5], y[:, 5:]) is pending  # the members' views
    assert late.take(y[:, :5], y[:, 5:]) is None  # handed over once


def test_without_triton_the_model_keeps_its_own_layers(monkeypatch):
    from services.rollout import decoder_layer
    from tests.fixtures.tiny import tiny_qwen2

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = tiny_qwen2(seed=1)
    assert decoder_layer.use(model) == 0
    assert all("forward" not in layer.__dict__ for layer in model.model.layers)


def test_the_three_kernels_build_for_an_h100_and_a_row_on_the_head_reads_no_slot():
    """Built for sm_90 on this CPU (tests/fixtures/ptx.py) at the Qwen2.5-1.5B decode shapes in
    bf16: the fused add with o_proj's correction (four slots of rank 16) and without, the
    corrected SwiGLU, the last add's expand with its residual. The corrected add branches
    around each slot's loads (a row on the head skips them all), which the plain one has no
    reason to."""
    pytest.importorskip("triton")
    from services.rollout import lora_kernels, norm_kernel, swiglu_kernel
    from tests.fixtures.ptx import sm90_ptx

    args = ("x_ptr r_ptr w_ptr s_ptr o_ptr t_ptr c_ptr bt_ptr eps stride_x stride_t rows_per_mask "
            "stride_bt").split()  # fmt: skip
    signature = {a: "*bf16" if a.endswith("_ptr") else "i32" for a in args} | {"eps": "fp32"}
    signature |= dict.fromkeys(("width", "block", "slots", "rank", "chunk"), "constexpr")
    ptx = {}
    for slots in (0, 4):
        constants = {"width": 1536, "block": 2048, "slots": slots, "rank": 16, "chunk": norm_kernel.RANK_CHUNK}
        ptx[slots] = sm90_ptx(norm_kernel._add_rms_norm, signature, constants, num_warps=8, **norm_kernel.BUILD)
    assert ptx[4].count("bra") > ptx[0].count("bra")
    args = "g_ptr u_ptr t_ptr c_ptr bt_ptr o_ptr n_rows width rows_per_mask g_row u_row stride_t stride_bt".split()
    signature = {a: "*bf16" if a.endswith("_ptr") else "i32" for a in args}
    signature |= dict.fromkeys(("sr", "sr_pad", "bm", "bn", "compiled"), "constexpr")
    constants = {"sr": 64, "sr_pad": 64, "bm": 64, "bn": swiglu_kernel.CORRECTED_BN, "compiled": True}
    assert "div.rn.f32" in sm90_ptx(swiglu_kernel._swiglu_corrected, signature, constants, num_warps=4)
    args = ("y_ptr t_ptr c_ptr bt_ptr r_ptr out_ptr M rows_per_mask stride_y stride_t stride_bt stride_r "
            "stride_out").split()  # fmt: skip
    signature = {a: "*bf16" if a.endswith("_ptr") else "i32" for a in args}
    signature |= dict.fromkeys(("B1", "B2", "B3", "SR", "SR_PAD", "BM", "BN", "HAS_RES"), "constexpr")
    constants = {"B1": 1536, "B2": 1536, "B3": 1536, "SR": 64, "SR_PAD": 64, "BM": 64, "BN": 32, "HAS_RES": True}
    assert sm90_ptx(lora_kernels._expand_stacked, signature, constants, num_warps=4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the interpreted tests stand for it")
def test_on_a_gpu_the_compiled_fused_add_is_the_reference():
    """Compiled for the card at a decode shape (Qwen2.5-1.5B's o_proj, bf16, rank 16, four slots,
    batch 64 with a quarter of the rows on older versions)."""
    pytest.importorskip("triton")
    check_corrections(device="cuda", dtype=torch.bfloat16, width=1536, rank=16, slots=4, batch=64)
    check_sums(device="cuda")


# --- the checks, run in the interpreter's child process (and on a GPU by the test above) ---


def column_slice(rows: int, width: int, extra: int, dtype: torch.dtype, g: torch.Generator, device: str):
    """x as the stacked matmul leaves it: the first `width` columns of [rows, width + extra]."""
    both = torch.randn(rows, width + extra, generator=g).to(device, dtype)
    return both[:, :width], both[:, width:]


def check_sums(device: str = "cpu") -> None:
    from services.rollout import norm_kernel

    g = torch.Generator().manual_seed(2)
    checks = 0
    dtypes = (torch.float32, torch.bfloat16, torch.float16) if device == "cpu" else (torch.bfloat16,)
    for width, rows in ((1, 1), (5, 3), (64, 64), (1536, 7)):
        for dtype in dtypes:
            x, _ = column_slice(rows, width, 12, dtype, g, device)
            residual = torch.randn(rows, width, generator=g).to(device, dtype) * 4
            weight = torch.randn(width, generator=g).to(device, dtype)
            # [batch, 1, width] as a decode step's hidden states are
            got = norm_kernel.add_normalize(x.view(rows, 1, width), residual.view(rows, 1, width), weight, 1e-6)
            assert got is not None, (width, rows, dtype)
            summed, normed = got
            assert summed.shape == normed.shape == (rows, 1, width) and summed.dtype == dtype
            assert torch.equal(summed, (residual + x).view(rows, 1, width)), (width, rows, dtype)
            want = norm_kernel.normalize(summed, weight, 1e-6)
            assert want is not None and torch.equal(normed, want), (width, rows, dtype)
            checks += 1
    # what it does not take goes back to the caller
    x = torch.randn(4, 8).to(device)
    assert norm_kernel.add_normalize(x, torch.randn(4, 6).to(device), torch.ones(6).to(device), 1e-6) is None
    assert norm_kernel.add_normalize(x.t(), torch.randn(8, 4).to(device), torch.ones(4).to(device), 1e-6) is None
    print(f"sums checked {checks}")


def signs(batch: int, slots: int, rank: int, head: int | None, dtype: torch.dtype) -> torch.Tensor:
    """A quarter of the rows on each older slot, the rest on the head (`head`'s slot merged)."""
    s = torch.zeros(batch, slots)
    for row in range(batch):
        own = row % 4
        if own < slots and own != head and row % 4:
            s[row, own] = 1.0
            if head is not None:
                s[row, head] = -1.0
    return s.repeat_interleave(rank, dim=1).to(dtype)


def check_corrections(
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    width: int | None = None,
    rank: int | None = None,
    slots: int | None = None,
    batch: int | None = None,
) -> None:
    from services.rollout import lora_kernels, norm_kernel

    g = torch.Generator().manual_seed(4)
    cases = [(40, 4, 3, 1, 2, 9), (64, 16, 2, 2, None, 5), (96, 64, 3, 1, 0, 17)]  # rank 64: eight chunks
    if width is not None:
        cases = [(width, rank, slots, 1, 0, batch)]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for n, r, n_slots, per_row, head, b in cases:
        rows = b * per_row
        y, t = column_slice(rows, n, n_slots * r, dtype, g, device)
        cols = signs(b, n_slots, r, head, dtype).to(device)
        bt = (torch.randn(n_slots * r, n, generator=g) / r).to(device, dtype)
        residual = torch.randn(rows, n, generator=g).to(device, dtype)
        weight = torch.randn(n, generator=g).to(device, dtype)
        pending = lora_kernels.Pending(y, t, cols, bt, per_row, r, (0, n))
        # the reference: the correction added in torch, then torch's add
        fixed = y.contiguous()
        lora_kernels.expand_reference_(fixed, lora_kernels.masked(t, cols, per_row), bt, [0, n])
        assert (fixed - y).abs().max() > 0.1  # the correction is not nothing
        got = norm_kernel.add_normalize(y, residual, weight, 1e-6, pending)
        assert got is not None
        summed, normed = got
        torch.testing.assert_close(summed, residual + fixed, atol=tol, rtol=tol)
        on_head = (cols == 0).all(1).repeat_interleave(per_row)
        assert on_head.any() and not on_head.all()
        assert torch.equal(summed[on_head], (residual + y)[on_head])  # no correction read for them
        want = norm_kernel.normalize(summed, weight, 1e-6)
        assert want is not None and torch.equal(normed, want)
        # the layer's last add: down_proj's correction and the residual in one expand
        last = lora_kernels.expand_stacked(y, t, bt, [0, n], cols, per_row, residual)
        torch.testing.assert_close(last, residual + fixed, atol=tol, rtol=tol)
        assert torch.equal(last[on_head], (residual + y)[on_head])
        torch.testing.assert_close(pending.resolved(residual), last, atol=tol, rtol=tol)
        torch.testing.assert_close(pending.resolved(), fixed, atol=tol, rtol=tol)
    print("corrections checked")


@torch.no_grad()
def check_models() -> None:
    from transformers.models.llama.configuration_llama import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaForCausalLM

    from services.rollout import decoder_layer, fused_norm, norm_kernel
    from tests.fixtures.tiny import tiny_qwen2, tiny_qwen3

    llama = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=61)  # fmt: skip
    for model in (tiny_qwen2(seed=4), tiny_qwen3(seed=4), LlamaForCausalLM(llama).eval()):
        ids = torch.tensor([[3, 9, 4, 1, 5], [7, 7, 2, 8, 1]])
        want = model(ids).logits
        fused_norm.fuse(model)
        assert decoder_layer.use(model) == model.config.num_hidden_layers
        assert decoder_layer.use(model) == 0  # idempotent
        launches = []
        launch = norm_kernel._launch_add
        norm_kernel._launch_add = lambda *args: (launches.append(1), launch(*args))[1]
        try:
            got = model(ids).logits
        finally:
            norm_kernel._launch_add = launch
        assert len(launches) == model.config.num_hidden_layers  # one a layer: the first add and its norm
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        os.environ["LORABUS_FUSED_RESIDUAL"] = "0"  # read at each call: the layer's own forward
        norm_kernel._launch_add = lambda *args: (launches.append(1), launch(*args))[1]
        try:
            torch.testing.assert_close(model(ids).logits, want, atol=1e-5, rtol=1e-5)
        finally:
            norm_kernel._launch_add = launch
            del os.environ["LORABUS_FUSED_RESIDUAL"]
        assert len(launches) == model.config.num_hidden_layers
    # a layer whose forward computes something else (here: a scaled residual) fails the probe
    # and keeps its own forward
    odd = tiny_qwen2(seed=5)
    for layer in odd.model.layers:
        own = layer.forward
        layer.forward = lambda hidden_states, own=own, **kw: own(hidden_states, **kw) * 1.5
    class_forwards = [layer.forward for layer in odd.model.layers]
    assert decoder_layer.use(odd) == 0
    assert [layer.forward for layer in odd.model.layers] == class_forwards
    # without the fused norm module the layer still computes the same (torch's add and the norm)
    plain = tiny_qwen2(seed=6)
    want = plain(torch.tensor([[1, 2, 3]])).logits
    assert decoder_layer.use(plain) == plain.config.num_hidden_layers
    torch.testing.assert_close(plain(torch.tensor([[1, 2, 3]])).logits, want, atol=1e-5, rtol=1e-5)
    print("models checked")


@torch.no_grad()
def check_mixed_model() -> None:
    from services.rollout import decoder_layer, fused_norm, lora_kernels, norm_kernel, swiglu_kernel
    from tests.unit.test_lora_kernels import three_versions

    ids = torch.randint(0, 97, (20, 3), generator=torch.Generator().manual_seed(5))
    mix = [0] * 5 + [1] * 5 + [2] * 10
    ref, ref_slots = three_versions("torch")
    with ref_slots.route([2] * 20):
        head_only = ref(input_ids=ids).logits
    for mlp in (False, True):
        model, slots = three_versions("stacked")
        fused_norm.fuse(model)
        layers = decoder_layer.use(model)
        assert layers == 2
        if mlp:
            assert swiglu_kernel.use(model) == layers
        calls: dict[str, list[bool]] = {"add_norm": [], "expand": [], "swiglu": []}
        launch, expand, swiglu = norm_kernel._launch_add, lora_kernels.expand_stacked, swiglu_kernel._launch_corrected

        def spy_launch(*args):
            calls["add_norm"].append(args[4] is not None)
            return launch(*args)

        def spy_expand(*args):
            calls["expand"].append(len(args) > 6 and args[6] is not None)
            return expand(*args)

        def spy_swiglu(*args):
            calls["swiglu"].append(True)
            return swiglu(*args)

        norm_kernel._launch_add, lora_kernels.expand_stacked = spy_launch, spy_expand
        swiglu_kernel._launch_corrected = spy_swiglu
        try:
            with slots.route(mix), ref_slots.route(mix):
                got, want = model(input_ids=ids).logits, ref(input_ids=ids).logits
        finally:
            norm_kernel._launch_add, lora_kernels.expand_stacked = launch, expand
            swiglu_kernel._launch_corrected = swiglu
        assert (want[:10] - head_only[:10]).abs().max() > 1e-2  # older rows are corrected
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        # per layer: o_proj's correction in the fused add, down_proj's in the last add's expand,
        # gate/up's in the SwiGLU kernel where the MLP has it (else expanded as before), q/k/v's
        # expanded as before
        assert calls["add_norm"] == [True] * layers
        assert sorted(calls["expand"]) == [False] * ((1 if mlp else 2) * layers) + [True] * layers
        assert calls["swiglu"] == [True] * (layers if mlp else 0)
    print("mixed model checked")


def interpreted_engine(slab_rows: str) -> None:
    import asyncio

    from services.rollout import norm_kernel
    from tests.fixtures.kernel_engine import TOKENS, assert_same_answers, mixed_generation
    from tests.fixtures.tiny import tiny_qwen2

    answers, launches = {}, {}
    for on in ("0", "1"):
        os.environ["LORABUS_FUSED_RESIDUAL"] = on
        count = []
        launch = norm_kernel._launch_add
        norm_kernel._launch_add = lambda *args: (count.append(1), launch(*args))[1]
        try:
            model = tiny_qwen2(seed=6).to(torch.float32)
            answers[on] = asyncio.run(mixed_generation(model, torch.float32, int(slab_rows)))
        finally:
            norm_kernel._launch_add = launch
        launches[on] = len(count)
    assert launches["0"] == 0 and launches["1"] > 0, launches
    assert sum(len(r.token_ids) for group in answers["1"] for r in group) == TOKENS
    assert_same_answers(answers["1"], answers["0"], tol=1e-5)
    print(f"engine checked {'slab' if int(slab_rows) else 'static'}")
