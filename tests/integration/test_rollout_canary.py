"""Issue 28: the load canary on an embedded replica against a real nats-server.

The trainer's half (`services.trainer.canary.reference`, run here on a peft model of each
version, as the trainer's step would) rides on the event; the replica decodes the same prompts
under each version after loading it and before serving it. An engine that loads but answers
with the base model, or with the wrong alpha, or with a corrupted tensor of the right shape,
under v2's name is caught: v2 is unloaded and reported with the figures, never served, and the
replica goes on serving v1. The healthy v1 passed its canary.
"""

from __future__ import annotations

import asyncio
import copy
import time

import msgspec
import pytest
import torch

from proto import subjects
from proto.messages import AdapterFailed, AdapterLoaded, AdapterReady, ObjectPayload
from services.common import adapter_io
from services.rollout import metrics
from services.rollout.canary import TOLERANCE
from services.rollout.engines.embedded import EmbeddedEngine
from services.trainer import canary as trainer_canary
from tests.fixtures.waiting import wait_until
from tests.integration.test_rollout_service import EOS, KEEP, SPEC, base, peft_version, start_run  # noqa: F401

FAULTS = {
    "base": "loads, then answers with the base model under the adapter's name",
    "alpha": "applies the adapter with 4x its alpha",
    "corrupt": "holds a tensor of the right shape with other values",
}


def faulty(engine: EmbeddedEngine, fault: str, version: int) -> None:
    """`engine` mis-loads `version` as `fault` says; its other versions load as sent."""
    load = engine.load_version

    async def load_version(v, weights, lora):
        if v != version:
            return await load(v, weights, lora)
        tensors = adapter_io.from_bytes(weights)
        if fault == "base":
            tensors = {k: torch.zeros_like(t) if ".lora_B." in k else t for k, t in tensors.items()}
        elif fault == "alpha":
            lora = msgspec.structs.replace(lora, alpha=lora.alpha * 4)
        else:
            key = sorted(k for k in tensors if ".lora_B." in k)[0]
            tensors[key] = torch.randn_like(tensors[key])
        return await load(v, tensors, lora)

    engine.load_version = load_version  # type: ignore[method-assign]


@pytest.mark.parametrize("fault", sorted(FAULTS))
async def test_a_load_that_does_not_answer_as_the_trainer_is_withdrawn(start_run, base, fault):
    run = await start_run(f"ca{fault[:2]}", seed=6, max_new_tokens=3, batch_groups=1)
    rec = run.rec
    prompt_ids = trainer_canary.prompts(base.config.vocab_size, seed=run.cfg.seed)

    async def publish(version: int) -> None:
        model, data = peft_version(base, seed=50 + version)
        ref = run.store.put_bytes(f"{run.run}/adapters/v{version}/adapter_model.safetensors", data)
        ev = AdapterReady(
            run=run.run, trainer_epoch="e0", lora_name="tiny", version=version,
            parent_version=version - 1 if version else None, trainer_step=version, created_at=time.time(), lora=SPEC,
            payloads=[ObjectPayload(uri=ref.uri, bytes=ref.bytes, sha256=ref.sha256)],
            canary=trainer_canary.reference(model, prompt_ids, "float32"),
        )  # fmt: skip
        await run.bus.publish(subjects.adapter_ready(run.run, version), ev, msg_id=f"v{version}")

    engine = EmbeddedEngine(copy.deepcopy(base), eos_ids=[EOS], pad_id=0, slots=KEEP + 1)
    faulty(engine, fault, version=2)
    name = f"c{fault[:2]}"
    service = run.service(name, engine, reward_fn=lambda prompt, completion, answer: 0.0)
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    try:
        await publish(1)
        await wait_until(lambda: rec.of(AdapterLoaded, name, version=1), what="the healthy v1 loaded")
        gaps = metrics.CANARY_GAP.labels(run.run, name)
        assert gaps._sum.get() <= TOLERANCE["float32"], "the healthy v1's canary gap"
        await publish(2)
        await wait_until(lambda: rec.of(AdapterFailed, name, version=2), what=f"v2 ({FAULTS[fault]}) refused")
        failed = rec.of(AdapterFailed, name, version=2)
        assert len(failed) == 1 and not failed[0].will_retry
        assert "canary gap" in failed[0].reason and "withdrawn on this replica" in failed[0].reason
        assert not rec.of(AdapterLoaded, name, version=2)
        assert 2 not in await engine.loaded_versions() and service.adapters.loaded() == [1]
        # the replica goes on with the version it has
        n = len(rec.trajectories)
        await wait_until(lambda: len(rec.trajectories) >= n + 2, what="trajectories after the refusal")
        assert {t.oldest_version() for t in rec.trajectories} == {1}
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
