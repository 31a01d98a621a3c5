import copy
import gc
import weakref

import pytest
import torch
from torch import nn

from services.common.lora_targets import HF_LINEAR
from services.rollout.lora_slots import LoraSlots, SlotLinear
from services.rollout.versions import NoFreeSlot
from tests.fixtures.tiny import merged_reference as tiny_merged
from tests.fixtures.tiny import random_lora, tiny_qwen2

TARGETS = HF_LINEAR
RANK, SCALE = 4, 2.0


def tiny_model(seed: int = 0):
    return tiny_qwen2(seed, max_position_embeddings=128)


def random_adapter(model, seed: int) -> dict[str, torch.Tensor]:
    return random_lora(model, seed, RANK, 0.1, TARGETS)


def merged_reference(base, adapter: dict[str, torch.Tensor]):
    return tiny_merged(base, adapter, SCALE)


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.fixture
def setup():
    base = tiny_model()
    pristine = copy.deepcopy(base)
    adapters = {v: random_adapter(base, seed=100 + v) for v in range(3)}
    slots = LoraSlots.install(base, adapters[0], slots=3)
    return base, pristine, adapters, slots


def test_install_replaces_every_target_linear(setup):
    base, _, _, slots = setup
    assert len(slots.layers) == 2 * len(TARGETS)
    assert all(isinstance(base.get_submodule(p), SlotLinear) for p in slots.layers)
    assert isinstance(base.lm_head, nn.Linear) and not isinstance(base.lm_head, SlotLinear)


def test_install_lets_the_replaced_layers_go():
    base = tiny_model()
    replaced = [weakref.ref(m) for n, m in base.named_modules() if n.rpartition(".")[2] in TARGETS]
    slots = LoraSlots.install(base, random_adapter(base, seed=1), slots=2)
    gc.collect()
    assert replaced and not [r for r in replaced if r() is not None], "the pool kept base layers it copied"
    assert len(slots.layers) == len(replaced)


def test_a_float32_adapter_lands_in_bfloat16_slots_scaled_then_rounded_once():
    base = tiny_model().to(torch.bfloat16)
    adapter = random_adapter(base, seed=3)
    adapter = {k: t.float() * 1.37 for k, t in adapter.items()}  # values bf16 cannot hold exactly
    slots = LoraSlots.install(base, adapter, slots=2)
    slot = slots.load(5, adapter, 0.3)
    for path, layer in slots.layers.items():
        a, b = adapter[f"base_model.model.{path}.lora_A.weight"], adapter[f"base_model.model.{path}.lora_B.weight"]
        assert torch.equal(layer.a[slot], a.to(torch.bfloat16)), path
        assert torch.equal(layer.b[slot], (b * 0.3).to(torch.bfloat16)), path


def test_mixed_batch_equals_per_version_reference(setup):
    base, pristine, adapters, slots = setup
    for v in range(3):
        slots.load(v, adapters[v], SCALE)
    slots.set_head(2)
    ids = torch.randint(0, 97, (5, 7), generator=torch.Generator().manual_seed(1))
    row_versions = [0, 0, 2, 1, 2]
    with slots.route(row_versions):
        got = logits(base, ids)
    refs = {v: merged_reference(pristine, adapters[v]) for v in range(3)}
    for row, v in enumerate(row_versions):
        want = logits(refs[v], ids[row : row + 1])[0]
        torch.testing.assert_close(got[row], want, atol=1e-5, rtol=1e-5)
    # outside `route` every row is on the head
    torch.testing.assert_close(logits(base, ids), logits(refs[2], ids), atol=1e-5, rtol=1e-5)


def test_many_head_swaps_do_not_drift():
    torch.manual_seed(0)
    layer = nn.Linear(64, 48, bias=False).to(torch.bfloat16)
    holder = nn.Sequential(layer)
    w0 = layer.weight.detach().clone()
    adapter = lambda seed: {  # noqa: E731
        "0.lora_A.weight": torch.randn(RANK, 64, generator=torch.Generator().manual_seed(seed)),
        "0.lora_B.weight": torch.randn(48, RANK, generator=torch.Generator().manual_seed(seed + 1)),
    }
    slots = LoraSlots.install(holder, adapter(0), slots=2)
    final = None
    for v in range(200):
        if len(slots.versions()) == 2:
            slots.unload(min(slots.versions()))
        slots.load(v, adapter(v), SCALE)
        slots.set_head(v)
        final = v
    a, b = adapter(final)["0.lora_A.weight"], adapter(final)["0.lora_B.weight"]
    # the same single rounding as merging once from W0
    want = torch.addmm(w0, (b * SCALE).to(torch.bfloat16), a.to(torch.bfloat16))
    assert torch.equal(holder[0].weight, want)


def test_unload_frees_the_slot_and_head_rules(setup):
    base, pristine, adapters, slots = setup
    for v in range(3):
        slots.load(v, adapters[v], SCALE)
    with pytest.raises(NoFreeSlot):
        slots.load(3, adapters[0], SCALE)
    slots.set_head(2)
    with pytest.raises(ValueError, match="merged head"):
        slots.unload(2)
    freed = slots.table.slot_of(0)
    slots.unload(0)
    assert slots.versions() == [1, 2]
    layer = next(iter(slots.layers.values()))
    assert not layer.a[freed].any() and not layer.b[freed].any()
    assert slots.load(3, adapters[0], SCALE) == freed
    with pytest.raises(KeyError, match="not loaded"):
        with slots.route([0]):
            pass
    # no head: the model is the pristine base again
    slots.set_head(None)
    ids = torch.randint(0, 97, (2, 5))
    torch.testing.assert_close(logits(base, ids), logits(pristine, ids))


def test_bad_adapters_are_rejected_with_the_module_named(setup):
    base, _, adapters, slots = setup
    bad = dict(adapters[1])
    key = next(k for k in bad if k.endswith("lora_A.weight"))
    bad[key] = torch.zeros(RANK + 1, bad[key].shape[1])
    with pytest.raises(ValueError, match="do not fit rank"):
        slots.load(1, bad, SCALE)
    partial = {k: v for k, v in adapters[1].items() if "layers.0." in k}
    with pytest.raises(ValueError, match="missing"):
        slots.load(1, partial, SCALE)
    assert slots.versions() == []  # nothing half-loaded
