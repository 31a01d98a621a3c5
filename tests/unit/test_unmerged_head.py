"""rollout.merge_head false: the embedded engine serves every version, the head too, as a separate
LoRA product over the untouched base weights (the unmerged baseline of issue 28's mismatch)."""

from __future__ import annotations

import asyncio
import copy

import torch

from proto.messages import LoraSpec
from services.common import adapter_io
from services.common.lora_targets import HF_LINEAR
from services.rollout.engines.base import GenRequest
from services.rollout.engines.embedded import EmbeddedEngine
from services.rollout.lora_slots import LoraSlots
from tests.fixtures.tiny import merged_reference, random_lora, tiny_qwen2

RANK, SCALE = 4, 2.0


def test_unmerged_rows_equal_the_merged_reference_and_the_weights_stay_w0():
    base = tiny_qwen2(0, max_position_embeddings=128)
    pristine = copy.deepcopy(base)
    adapters = {v: random_lora(base, 100 + v, RANK, 0.1, HF_LINEAR) for v in range(2)}
    slots = LoraSlots.install(base, adapters[0], slots=3)
    slots.merge_head = False
    for v in range(2):
        slots.load(v, adapters[v], SCALE)
    slots.set_head(1)
    assert slots.head == 1 and slots.merged is None
    assert all(torch.equal(layer.weight, layer.w0) for layer in slots.layers.values())
    ids = torch.randint(0, 97, (3, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), slots.route([1, 0, 1]) as corrected:
        got = base(input_ids=ids).logits
    assert corrected, "the head's rows run their LoRA product too"
    for row, v in enumerate([1, 0, 1]):
        want = merged_reference(pristine, adapters[v], SCALE)(input_ids=ids[row : row + 1]).logits[0]
        torch.testing.assert_close(got[row], want.detach(), atol=1e-5, rtol=1e-5)


def test_the_engine_answers_alike_merged_or_not_in_float32():
    base = tiny_qwen2(0, max_position_embeddings=128)
    adapter = random_lora(base, 7, RANK, 0.1, HF_LINEAR)
    spec = LoraSpec(rank=RANK, alpha=SCALE * RANK, target_modules=list(HF_LINEAR), base_model="tiny")
    req = GenRequest(prompt_token_ids=[3, 4, 5], n=2, max_new_tokens=6, temperature=1.0, seed=11)

    def answers(merge_head: bool):
        engine = EmbeddedEngine(copy.deepcopy(base), eos_ids=[96], pad_id=0, slots=2, merge_head=merge_head)

        async def go():
            await engine.load_version(1, adapter_io.to_bytes(adapter), spec)
            return await engine.generate([req], 1)

        return asyncio.run(go())[0]

    merged, native = answers(True), answers(False)
    for a, b in zip(merged, native):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=1e-5)
