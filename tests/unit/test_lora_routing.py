"""`lora.rows_by_adapter`: each row of a routed forward is what peft gives it with that row's
adapter active (mixed ranks and targets, an adapter in two spans, rows whose adapter a layer
lacks, bf16 autocast), and each adapter's gradient comes from its own rows only."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from services.trainer import lora
from tests.fixtures.tiny import tiny_qwen2

ADAPTERS = {  # name -> (rank, alpha, targets)
    "one": (8, 16.0, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "two": (4, 4.0, ["q_proj", "v_proj"]),
    "three": (2, 8.0, ["down_proj"]),
}
ROUTE = [("one", 0, 2), ("two", 2, 3), ("three", 3, 4), ("one", 4, 5), ("none", 5, 6)]


def wrapped():
    base = tiny_qwen2()
    for p in base.parameters():
        p.requires_grad_(False)
    model = None
    for name, (rank, alpha, targets) in ADAPTERS.items():
        cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, bias="none")
        if model is None:
            model = get_peft_model(base, cfg, adapter_name=name)
        else:
            model.add_adapter(name, cfg)
    torch.manual_seed(1)
    for n, p in model.named_parameters():
        if "lora_B" in n:  # B starts at zero: give every adapter an effect
            p.data.normal_(0, 0.5)
    return model


def alone(model, ids: torch.Tensor, adapter: str) -> torch.Tensor:
    if adapter == "none":
        with model.disable_adapter():
            return model(input_ids=ids).logits
    model.set_adapter(adapter)
    return model(input_ids=ids).logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_routed_row_is_its_adapters_own_forward(dtype):
    model = wrapped()
    ids = torch.randint(1, 90, (6, 5), generator=torch.Generator().manual_seed(0))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if dtype == torch.bfloat16 else torch.no_grad()
    with torch.no_grad(), autocast:
        with lora.rows_by_adapter(model) as route:
            route[0] = ROUTE
            routed = model(input_ids=ids).logits
        expected = torch.cat([alone(model, ids[lo:hi], a) for a, lo, hi in ROUTE])
        other = alone(model, ids[0:2], "two")
    assert routed.dtype == expected.dtype
    tol = 1e-5 if dtype == torch.float32 else 0.05
    assert torch.allclose(routed, expected, atol=tol, rtol=tol), (routed - expected).abs().max()
    # and the adapters differ from each other and from the base (the comparison can fail)
    assert not torch.allclose(expected[0:2], other, atol=tol)


def test_each_adapters_gradient_comes_from_its_own_rows():
    model = wrapped()
    ids = torch.randint(1, 90, (6, 5), generator=torch.Generator().manual_seed(0))
    for n, p in model.named_parameters():
        p.requires_grad_("lora_" in n)
    with lora.rows_by_adapter(model) as route:
        route[0] = ROUTE
        model(input_ids=ids).logits[3:4].sum().backward()  # the rows of "three" only
    for n, p in model.named_parameters():
        if "lora_" not in n:
            continue
        moved = p.grad is not None and bool(p.grad.abs().sum() > 0)
        assert moved == (".three." in n), n


def test_an_adapter_with_dropout_is_refused_by_name():
    model = wrapped()
    model.add_adapter("d", LoraConfig(r=2, target_modules=["q_proj"], lora_dropout=0.1))
    with pytest.raises(ValueError, match="no dropout"):
        with lora.rows_by_adapter(model):
            pass
