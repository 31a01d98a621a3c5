"""The fused rotary embedding (`rope_kernel`) against transformers' own, on CPU under Triton's
interpreter (in one child process for the module: tests/fixtures/interpreted.py says why). On a
GPU the same source compiles; benchmarks/decode_breakdown.py --variants fused_rope times it."""

import pytest
import torch

from tests.fixtures.interpreted import Outcome, checks_in, run_checks

pytestmark = pytest.mark.unit


INTERPRETED = checks_in(__file__, {"rope": ("interpreted",), "model": ("interpreted_model",)})


@pytest.fixture(scope="module")
def outcomes() -> dict[str, Outcome]:
    pytest.importorskip("triton")
    return run_checks(INTERPRETED)


def test_the_kernel_rotates_as_transformers_does(outcomes):
    assert "rope checked" in outcomes["rope"].output()


def test_a_model_decodes_the_same_with_the_kernel_in_place(outcomes):
    assert "model checked" in outcomes["model"].output()


def test_without_triton_on_the_device_nothing_is_replaced(monkeypatch):
    from transformers.models.qwen2 import modeling_qwen2

    from services.rollout import rope_kernel
    from tests.fixtures.tiny import tiny_qwen2

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    own = modeling_qwen2.apply_rotary_pos_emb
    assert rope_kernel.use(tiny_qwen2(seed=0)) == 0
    assert modeling_qwen2.apply_rotary_pos_emb is own


def reference(q, k, cos, sin):
    """transformers' formula in float32, rounded once to q's dtype."""
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    oq, ok = apply_rotary_pos_emb(q.float(), k.float(), cos.float(), sin.float())
    return oq.to(q.dtype), ok.to(k.dtype)


def interpreted() -> None:
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    from services.rollout import rope_kernel

    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        for b, s, hq, hk, d, cos_batch in ((2, 3, 4, 2, 8, 2), (3, 1, 6, 1, 10, 1), (1, 5, 2, 2, 16, 1)):
            # q and k as the attention layer makes them: [b, s, h, d] viewed as [b, h, s, d]
            q = torch.randn(b, s, hq, d, generator=g).to(dtype).transpose(1, 2)
            k = torch.randn(b, s, hk, d, generator=g).to(dtype).transpose(1, 2)
            angle = torch.randn(cos_batch, s, d // 2, generator=g).repeat(1, 1, 2)
            cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
            assert rope_kernel._takes(q, k, cos, sin, 1)
            got_q, got_k = rope_kernel.rotate(q, k, cos, sin)
            want_q, want_k = reference(q, k, cos, sin)
            own_q, own_k = apply_rotary_pos_emb(q, k, cos, sin)
            ulp = 0.0 if dtype == torch.float32 else 2**-7
            for got, want, own in ((got_q, want_q, own_q), (got_k, want_k, own_k)):
                assert got.shape == own.shape
                torch.testing.assert_close(got.float(), want.float(), atol=1e-6, rtol=ulp)
                # the eager bf16 chain rounds each product and the sum: a few of its ulps apart,
                # in absolute terms where the two products cancel
                torch.testing.assert_close(got.float(), own.float(), atol=1e-5 if ulp == 0 else 2**-6, rtol=2 * ulp)
    # a call the kernel does not take falls back to the module's own function, gradient and all
    fused = rope_kernel.fused(apply_rotary_pos_emb)
    q = torch.randn(1, 2, 3, 8, requires_grad=True)
    k = torch.randn(1, 2, 3, 8)
    angle = torch.randn(1, 3, 4).repeat(1, 1, 2)
    oq, _ = fused(q, k, angle.cos(), angle.sin())
    assert oq.grad_fn is not None
    oq.sum().backward()
    assert q.grad is not None
    print("rope checked")


def interpreted_model() -> None:
    import copy

    from transformers.models.qwen2 import modeling_qwen2

    from services.rollout import rope_kernel
    from tests.fixtures.tiny import tiny_qwen2

    model = tiny_qwen2(seed=5, vocab_size=61).eval()
    plain = copy.deepcopy(model)
    ids = torch.randint(1, 61, (2, 7), generator=torch.Generator().manual_seed(0))
    own = modeling_qwen2.apply_rotary_pos_emb
    try:
        with torch.no_grad():
            want = plain(input_ids=ids).logits
            assert rope_kernel.use(model) == 1
            assert modeling_qwen2.apply_rotary_pos_emb is not own
            assert rope_kernel.use(model) == 0  # once per module
            got = model(input_ids=ids).logits
    finally:  # the swap is for the whole process: a check run after this one must find transformers' own
        modeling_qwen2.apply_rotary_pos_emb = own
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    print("model checked")
