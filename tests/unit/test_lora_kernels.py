"""The Triton correction kernel against the torch reference, on CPU under Triton's interpreter.

Triton decides when it is imported whether it interprets, so the checks run in a child process
started with TRITON_INTERPRET=1. On a GPU the same source compiles;
benchmarks/embedded_engine.py compares its outputs with the reference path there."""

import copy
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def test_kernel_matches_the_reference_under_the_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    run = subprocess.run(
        [sys.executable, "-c", "from tests.unit.test_lora_kernels import interpreted; interpreted()"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "checked" in run.stdout


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
        # column views of one tensor, and one kernel masks and expands it in place
        b_stacked = None if b is None else torch.cat([b, b.new_zeros(len(a))])
        ya = torch.nn.functional.linear(x, torch.cat([w, a]), b_stacked)
        lora_kernels.expand_stacked_(ya[:, : segs[-1]], ya[:, segs[-1] :], bt, segs, cols, per_row)
        torch.testing.assert_close(ya[:, : segs[-1]], want, atol=1e-4, rtol=1e-4)
        config = lora_kernels.with_stages(lora_kernels.FusedConfig(*tiles), n_slots * rank)
        fused = lora_kernels.linear_fused(x, w, b, a, bt, segs_dev, cols, per_row, config)
        torch.testing.assert_close(fused, want, atol=1e-4, rtol=1e-4)
        checks += 1
    # a whole model: every correction gives the same logits for a mixed batch
    from services.rollout.lora_slots import LoraSlots
    from tests.fixtures.tiny import random_lora, tiny_qwen2

    models = {}
    for correction in ("torch", "triton", "stacked", "fused", "auto"):
        model = tiny_qwen2(0)
        adapters = {v: random_lora(model, 300 + v, 4, 0.2) for v in range(3)}
        slots = LoraSlots.install(model, adapters[0], slots=3, correction=correction)
        for v in range(3):
            slots.load(v, adapters[v], 2.0)
        slots.set_head(2)
        models[correction] = (model, slots)
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
    # "auto": a shape with a measured choice runs it (here the fused GEMM), the others the default
    model, slots = models["auto"]
    group = slots.groups[0]
    key = (20 * 5, group.segs[-1], group.in_features, len(group.segs) - 1, slots.table.slots * slots.rank)
    lora_kernels.TUNED[key] = lora_kernels.FusedConfig(16, 32, 32)
    calls: dict[str, list[torch.Size]] = {"fused": [], "stacked": []}
    fused_kernel, stacked_kernel = lora_kernels.linear_fused, lora_kernels.expand_stacked_

    def fused(x: torch.Tensor, w: torch.Tensor, *rest: Any) -> torch.Tensor:
        calls["fused"].append(w.shape)
        return fused_kernel(x, w, *rest)

    def stacked(y: torch.Tensor, *rest: Any) -> None:
        calls["stacked"].append(y.shape)
        stacked_kernel(y, *rest)

    lora_kernels.linear_fused, lora_kernels.expand_stacked_ = fused, stacked  # type: ignore[assignment]
    try:
        with torch.no_grad(), slots.route(mix):
            torch.testing.assert_close(model(input_ids=ids).logits, logits["torch"], atol=1e-5, rtol=1e-5)
    finally:
        del lora_kernels.TUNED[key]
        lora_kernels.linear_fused, lora_kernels.expand_stacked_ = fused_kernel, stacked_kernel
    # the first group's shape (one group per layer) ran fused, every other group stacked
    same_shape = [g for g in slots.groups if g.weight.shape == group.weight.shape]
    assert len(calls["fused"]) == len(same_shape) == 2
    assert len(calls["stacked"]) == len(slots.groups) - 2 and lora_kernels.DEFAULT_CHOICE == "stacked"
    checks += 1
    print(f"checked {checks}")


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
