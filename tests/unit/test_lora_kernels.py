"""The Triton correction kernel against the torch reference, on CPU under Triton's interpreter.

Triton decides when it is imported whether it interprets, so the checks run in one child process
started with TRITON_INTERPRET=1 (tests/fixtures/interpreted.py). On a GPU the same source compiles:
the stacked expand, the default there, is checked compiled by the last test (run on the device by
benchmarks/device/pending.sh), and benchmarks/embedded_engine.py compares every correction's
outputs with the reference path."""

import copy
from typing import Any

import pytest
import torch

from tests.fixtures.interpreted import Outcome, checks_in, run_checks

INTERPRETED = checks_in(__file__, {"correction": ("interpreted",), "merge": ("interpreted_merge",)})


@pytest.fixture(scope="module")
def outcomes() -> dict[str, Outcome]:
    pytest.importorskip("triton")
    return run_checks(INTERPRETED)


def test_kernel_matches_the_reference_under_the_interpreter(outcomes):
    assert "checked" in outcomes["correction"].output()


def three_versions(correction: str, device: str = "cpu", dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """The tiny Qwen2 with versions 0-2 of a random adapter loaded under `correction`, 2 the head."""
    from services.rollout.lora_slots import LoraSlots
    from tests.fixtures.tiny import random_lora, tiny_qwen2

    model = tiny_qwen2(0).to(device, dtype)
    adapters = {v: {k: t.to(device, dtype) for k, t in random_lora(model, 300 + v, 4, 0.2).items()} for v in range(3)}
    slots = LoraSlots.install(model, adapters[0], slots=3, correction=correction)
    for v in range(3):
        slots.load(v, adapters[v], 2.0)
    slots.set_head(2)
    return model, slots


def interpreted() -> None:
    from services.rollout import lora_kernels

    assert lora_kernels.kernel_available(torch.device("cpu"), torch.float32)
    checks = 0
    # members' widths (odd ones: tiles that end inside a member), slots, rank, in_features
    # (above K_CHUNK: several split-K programs; not a multiple of the fused kernel's BK), rows
    # per mask row (prefill positions), the head's slot, bias, and the fused kernel's tiles
    for widths, n_slots, rank, k, per_row, head, bias, tiles in [
        ([40, 16, 16], 3, 4, 1100, 2, 2, True, (16, 32, 128)),  # q/k/v-like, padded slot width (12 -> 16)
        ([72, 72], 4, 4, 64, 1, 0, False, (32, 16, 32)),  # gate/up-like
        ([24], 2, 8, 40, 3, None, True, (16, 16, 16)),  # alone; no head merged: rows add their own version only
        ([48, 24], 2, 16, 96, 1, 1, True, (64, 32, 64)),  # rank 16
        ([40], 2, 64, 80, 1, 0, False, (16, 16, 32)),  # rank 64: x @ A^T accumulator [rows, 128]
    ]:
        g = torch.Generator().manual_seed(len(widths) * 100 + rank)
        batch = 37  # three blocks of 16 rows, the first all on the head, the last partial
        segs = [0]
        for w in widths:
            segs.append(segs[-1] + w)
        x = torch.randn(batch * per_row, k, generator=g)
        w = torch.randn(segs[-1], k, generator=g) / k**0.5
        b = torch.randn(segs[-1], generator=g) if bias else None
        a = torch.randn(len(widths) * n_slots * rank, k, generator=g) / k**0.5
        bt = torch.randn(n_slots * rank, segs[-1], generator=g)
        signs = torch.zeros(batch, n_slots)
        for row in range(16, batch):
            if row % 4:  # some rows of the corrected blocks stay on the head
                own = row % n_slots
                signs[row, own] = 1.0
                if head is not None and own != head:
                    signs[row, head] = -1.0
        cols = signs.repeat_interleave(rank, dim=1)
        segs_dev = torch.tensor(segs, dtype=torch.int32)
        y = torch.nn.functional.linear(x, w, b)
        want, got = y.clone(), y.clone()
        lora_kernels.correct_reference_(want, x, a, bt, segs, cols, per_row)
        lora_kernels.correct_kernel_(got, x, a, bt, segs_dev, cols, per_row)
        assert (want - y).abs().max() > 0.1  # the correction is not nothing
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert torch.equal(got[: 16 * per_row], y[: 16 * per_row])  # rows on the head untouched
        # the stacked path: the unmasked shrink comes out of the layer's matmul beside y, as
        # column views of one tensor, and one kernel masks and expands it into a new tensor
        n = segs[-1]
        b_stacked = None if b is None else torch.cat([b, b.new_zeros(len(a))])
        ya = torch.nn.functional.linear(x, torch.cat([w, a]), b_stacked)
        before = ya.clone()
        stacked = lora_kernels.expand_stacked(ya[:, :n], ya[:, n:], bt, segs, cols, per_row)
        assert stacked.shape == (len(x), n) and stacked.is_contiguous()
        assert torch.equal(ya, before)  # out of place: the matmul's output is not written
        torch.testing.assert_close(stacked, want, atol=1e-4, rtol=1e-4)
        # rows on the head, in the first block and between corrected rows, are written too, as y
        on_head = (cols == 0).all(1).repeat_interleave(per_row)
        assert on_head[: 16 * per_row].all() and on_head[16 * per_row :].any()
        assert torch.equal(stacked[on_head], ya[on_head, :n])
        # the CPU fallback of SlotGroup._forward_stacked gives the kernel's result
        fallback = ya[:, :n].contiguous()
        lora_kernels.expand_reference_(fallback, lora_kernels.masked(ya[:, n:], cols, per_row), bt, segs)
        torch.testing.assert_close(stacked, fallback, atol=1e-4, rtol=1e-4)
        config = lora_kernels.with_stages(lora_kernels.FusedConfig(*tiles), n_slots * rank)
        fused = lora_kernels.linear_fused(x, w, b, a, bt, segs_dev, cols, per_row, config)
        torch.testing.assert_close(fused, want, atol=1e-4, rtol=1e-4)
        checks += 1
    # a whole model: every correction gives the same logits for a mixed batch
    models = {correction: three_versions(correction) for correction in ("torch", "triton", "stacked", "fused", "auto")}
    ids = torch.randint(0, 97, (20, 5), generator=torch.Generator().manual_seed(5))
    mix = [0] * 5 + [1] * 5 + [2] * 10
    logits = {}
    for correction, (model, slots) in models.items():
        with torch.no_grad(), slots.route(mix):
            logits[correction] = model(input_ids=ids).logits
    with torch.no_grad(), models["torch"][1].route([2] * 20):
        head_only = models["torch"][0](input_ids=ids).logits
    assert (logits["torch"][:10] - head_only[:10]).abs().max() > 1e-2  # older rows are corrected
    for correction in ("triton", "stacked", "fused", "auto"):
        torch.testing.assert_close(logits[correction], logits["torch"], atol=1e-5, rtol=1e-5)
    assert_lone_members_contiguous(*models["stacked"], *models["torch"], mix)
    # "auto": a shape with a measured choice runs it (here the fused GEMM), the others the default
    model, slots = models["auto"]
    group = slots.groups[0]
    key = (20 * 5, group.segs[-1], group.in_features, len(group.segs) - 1, slots.table.slots * slots.rank)
    lora_kernels.TUNED[key] = lora_kernels.FusedConfig(16, 32, 32)
    calls: dict[str, list[torch.Size]] = {"fused": [], "stacked": []}
    fused_kernel, stacked_kernel = lora_kernels.linear_fused, lora_kernels.expand_stacked

    def fused(x: torch.Tensor, w: torch.Tensor, *rest: Any) -> torch.Tensor:
        calls["fused"].append(w.shape)
        return fused_kernel(x, w, *rest)

    def stacked(y: torch.Tensor, *rest: Any) -> torch.Tensor:
        calls["stacked"].append(y.shape)
        return stacked_kernel(y, *rest)

    lora_kernels.linear_fused, lora_kernels.expand_stacked = fused, stacked  # type: ignore[assignment]
    try:
        with torch.no_grad(), slots.route(mix):
            torch.testing.assert_close(model(input_ids=ids).logits, logits["torch"], atol=1e-5, rtol=1e-5)
    finally:
        del lora_kernels.TUNED[key]
        lora_kernels.linear_fused, lora_kernels.expand_stacked = fused_kernel, stacked_kernel
    # the first group's shape (one group per layer) ran fused, every other group stacked
    same_shape = [g for g in slots.groups if g.weight.shape == group.weight.shape]
    assert len(calls["fused"]) == len(same_shape) == 2
    assert len(calls["stacked"]) == len(slots.groups) - 2 and lora_kernels.DEFAULT_CHOICE == "stacked"
    checks += 1
    print(f"checked {checks}")


def assert_lone_members_contiguous(model: Any, slots: Any, ref_model: Any, ref_slots: Any, mix: list[int]) -> None:
    """o_proj and down_proj (groups of one member) under the stacked correction return a
    contiguous output for a mixed batch, as the plain F.linear of a head-only batch does: the
    residual add after them then runs on torch's vectorised kernel. `ref_*` is the same model
    under the torch correction, whose outputs they must equal."""
    assert slots.routing.correction == "stacked" and ref_slots.routing.correction == "torch"
    generator = torch.Generator().manual_seed(11)
    for name in ("self_attn.o_proj", "mlp.down_proj"):
        proj, ref = (m.model.layers[0].get_submodule(name) for m in (model, ref_model))
        assert proj.group.segs == [0, proj.out_features]  # alone in its group
        x = torch.randn(len(mix), 1, proj.in_features, generator=generator)
        with torch.no_grad(), slots.route(mix), ref_slots.route(mix):
            got, want = proj(x), ref(x)
        assert got.is_contiguous(), f"{name}: stride {got.stride()} for shape {tuple(got.shape)}"
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_lone_members_are_contiguous_on_the_cpu_path():
    """Without Triton's interpreter the stacked correction runs its torch fallback, which
    must give the kernel's contiguous layout too."""
    from services.rollout import lora_kernels

    assert not lora_kernels.kernel_available(torch.device("cpu"), torch.float32)
    assert_lone_members_contiguous(*three_versions("stacked"), *three_versions("torch"), [0, 1, 2, 2, 0, 1])


def test_merge_kernel_matches_torch_under_the_interpreter(outcomes):
    assert "merges checked" in outcomes["merge"].output()


def interpreted_merge() -> None:
    from services.rollout import lora_merge

    checks = 0
    # layers, out (not a multiple of the 64-row tile), in (not a multiple of the 128-column
    # tile), rank (padded to 16 for tl.dot), dtype
    for layers, out, width, rank, dtype in [
        (3, 70, 200, 4, torch.float32),
        (2, 64, 128, 16, torch.float32),
        (2, 130, 40, 8, torch.float16),  # the interpreter has no bfloat16 (numpy)
    ]:
        g = torch.Generator().manual_seed(out + rank)
        # as a slot pool lays them out: W rows above other rows of one buffer (a row stride
        # beyond `out`), A rows further down, B as a transposed view of B^T
        buf = torch.randn(layers, out + 5 + rank, width, generator=g).to(dtype)
        w, a = buf[:, :out], buf[:, out + 5 :]
        w0 = torch.randn(layers, out, width, generator=g).to(dtype)
        bt = torch.randn(layers, rank, out + 3, generator=g).to(dtype)
        b = bt[:, :, :out].transpose(1, 2)
        want = torch.baddbmm(w0.float(), b.float(), a.float()).to(dtype)
        got_torch, got_kernel = w.clone(), w
        lora_merge.merge_(got_torch, w0, b, a)
        lora_merge.merge_(got_kernel, w0, b, a, kernel=True)
        assert not torch.equal(got_kernel, w0)  # the product is not nothing
        tol = 1e-5 if dtype == torch.float32 else 2e-3  # half: the last bit may differ
        torch.testing.assert_close(got_kernel, want, atol=tol, rtol=tol)
        torch.testing.assert_close(got_torch, want, atol=tol, rtol=tol)
        assert torch.equal(buf[:, out : out + 5], buf[:, out : out + 5].clone())  # rows between untouched
        checks += 1
    # a whole pool: the kernel's head merge gives the torch merge's weights
    from services.rollout.lora_slots import LoraSlots
    from tests.fixtures.tiny import random_lora, tiny_qwen2

    weights = []
    for kernel in (False, True):
        model = tiny_qwen2(0)
        first, second = random_lora(model, 7, 4, 0.2), random_lora(model, 8, 4, 0.2)
        slots = LoraSlots.install(model, first, slots=2)
        slots.merge_kernel = kernel
        slots.load(1, second, 2.0)
        slots.set_head(1)
        weights.append([layer.weight.detach().clone() for layer in slots.layers.values()])
    for torch_w, kernel_w in zip(*weights, strict=True):
        torch.testing.assert_close(kernel_w, torch_w, atol=1e-5, rtol=1e-5)
    checks += 1
    print(f"merges checked {checks}")


def test_siblings_share_one_matmul_and_a_lone_call_recomputes():
    """q/k/v read one input: the first call computes the group, the others take their columns;
    a member called with another tensor gets its own correct output."""
    from services.rollout.lora_slots import LoraSlots, SlotGroup
    from tests.fixtures.tiny import random_lora, tiny_qwen2

    model = tiny_qwen2(0)
    pristine = copy.deepcopy(model)
    slots = LoraSlots.install(model, random_lora(model, 1, 4, 0.2), slots=2, correction="torch")
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.group is attn.k_proj.group is attn.v_proj.group
    assert attn.o_proj.group is not attn.q_proj.group
    assert len(slots.groups) == 2 * 4  # per layer: qkv, o, gate/up, down
    calls = []
    forward = SlotGroup._forward
    group = attn.q_proj.group
    group._forward = lambda x: calls.append(x) or forward(group, x)  # type: ignore[method-assign]
    x = torch.randn(3, 1, 32)
    with torch.no_grad():
        got = [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x), attn.k_proj(x.clone())]
        ref = pristine.model.layers[0].self_attn
        want = [ref.q_proj(x), ref.k_proj(x), ref.v_proj(x), ref.k_proj(x)]
    assert len(calls) == 2  # once for q/k/v, once for the lone k
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the interpreted tests stand for it")
def test_on_a_gpu_the_compiled_stacked_expand_is_the_reference():
    """Compiled for the card, at a decode shape (Qwen2.5-1.5B's q/k/v widths, bf16, rank 16, four
    slots, batch 64 with a quarter of its rows on older versions), the stacked expand writes
    what the reference writes, and a whole model's logits under it are the torch correction's."""
    pytest.importorskip("triton")
    from services.rollout import lora_kernels

    dev, dtype = torch.device("cuda"), torch.bfloat16
    assert lora_kernels.kernel_available(dev, dtype)
    g = torch.Generator(device=dev).manual_seed(3)
    segs, n_slots, rank, k, batch, head = [0, 1536, 1792, 2048], 4, 16, 1536, 64, 3
    n = segs[-1]
    x = torch.randn(batch, k, generator=g, device=dev, dtype=dtype)
    w = torch.randn(n, k, generator=g, device=dev, dtype=dtype) / k**0.5
    a = torch.randn(3 * n_slots * rank, k, generator=g, device=dev, dtype=dtype) / k**0.5
    bt = torch.randn(n_slots * rank, n, generator=g, device=dev, dtype=dtype) / rank
    signs = torch.zeros(batch, n_slots, device=dev, dtype=dtype)
    for row in range(0, batch, 4):
        signs[row, row % head] = 1.0
        signs[row, head] = -1.0
    cols = signs.repeat_interleave(rank, dim=1)
    ya = torch.nn.functional.linear(x, torch.cat([w, a]))
    got = lora_kernels.expand_stacked(ya[:, :n], ya[:, n:], bt, segs, cols, 1)
    want = ya[:, :n].float()
    lora_kernels.expand_reference_(want, lora_kernels.masked(ya[:, n:].float(), cols.float(), 1), bt.float(), segs)
    assert got.is_contiguous() and (want - ya[:, :n].float()).abs().max() > 0.05
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    on_head = (cols == 0).all(1)
    assert torch.equal(got[on_head], ya[on_head, :n])

    # in half precision, where the kernel runs
    built = [three_versions(correction, "cuda", dtype) for correction in ("stacked", "torch")]
    ids = torch.randint(0, 97, (20, 5), generator=torch.Generator().manual_seed(5)).to(dev)
    mix = [0] * 5 + [1] * 5 + [2] * 10
    logits = []
    for model, slots in built:
        with torch.no_grad(), slots.route(mix):
            logits.append(model(input_ids=ids).logits)
    torch.testing.assert_close(logits[0].float(), logits[1].float(), atol=3e-2, rtol=3e-2)
