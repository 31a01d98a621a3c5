"""Issue 28: the load canary on an embedded replica against a real nats-server.

The trainer's half (`services.trainer.canary.reference`, run here on a peft model of each
version, as the trainer's step would) follows the event as its own message (AdapterCanary), as
the trainer sends it; the replica marks each version loaded at once, obtains the canary and
decodes the same prompts under it while it serves, holding what it generates until the check
passed. An engine that loads but answers with the base model, or with the wrong alpha, or with a
corrupted tensor of the right shape, under v2's name is caught: v2 is generated with (its canary
is slowed here so that grants certainly land on it) yet nothing it generated is published; it is
withdrawn, reported with the figures, unloaded, and the replica goes on serving v1. So is a v2
whose canary never comes, or vouches for other weights. A healthy version's first output waits
for its canary (one that comes late, or one carried on the event as older trainers did), and is
published once it passed.
"""

from __future__ import annotations

import asyncio
import copy
import time

import msgspec
import pytest
import torch

from proto import subjects
from proto.messages import AdapterFailed, AdapterLoaded, AdapterReady, AdapterUnloaded, ObjectPayload
from services.common import adapter_io, streams
from services.rollout import metrics
from services.rollout.canary import TOLERANCE
from services.rollout.engines.embedded import EmbeddedEngine
from services.trainer import canary as trainer_canary
from services.trainer.publish import canary_message, publish_canary
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


class Calls:
    """Every generate of an engine, its canary decodes told apart (greedy, seed 0: the run's
    own requests sample): (canary?, version, start, end) in time.time()."""

    def __init__(self, engine: EmbeddedEngine, slow: dict[int, float]):
        self.calls: list[tuple[bool, int, float, float]] = []
        generate = engine.generate

        async def recording_generate(requests, version):
            is_canary = all(r.temperature == 0.0 and r.seed == 0 for r in requests)
            start = time.time()
            if is_canary:
                await asyncio.sleep(slow.get(version, 0.0))
            out = await generate(requests, version)
            self.calls.append((is_canary, version, start, time.time()))
            return out

        engine.generate = recording_generate  # type: ignore[method-assign]

    def batches(self, version: int) -> list[tuple[float, float]]:
        return [(start, end) for canary, v, start, end in self.calls if v == version and not canary]

    def canary_end(self, version: int) -> float | None:
        return next((end for canary, v, _, end in self.calls if canary and v == version), None)


def publisher(run, base):
    """`await publish(version, canary_of=None, after=0.0, embedded=False)`: the version's
    adapter announced saying its canary follows, then (as the trainer does, after the event) the
    trainer's canary of adapter `canary_of` (its own by default) `after` seconds later; `after`
    None: never sent. `embedded`: carried on the event instead, as trainers before
    `canary_follows` did. `step`: the event's trainer step (default: the version).
    `sent[version]`: when each canary was published (time.time())."""
    prompt_ids = trainer_canary.prompts(base.config.vocab_size, seed=run.cfg.seed)
    sending: list[asyncio.Task] = []
    sent: dict[int, float] = {}

    async def publish(version: int, canary_of: int | None = None, after: float | None = 0.0,
                      embedded: bool = False, step: int | None = None) -> None:  # fmt: skip
        data = peft_version(base, seed=50 + version)[1]
        model = peft_version(base, seed=50 + (version if canary_of is None else canary_of))[0]
        reference = trainer_canary.reference(model, prompt_ids, "float32")
        ref = run.store.put_bytes(f"{run.run}/adapters/v{version}/adapter_model.safetensors", data)
        ev = AdapterReady(
            run=run.run, trainer_epoch="e0", lora_name="tiny", version=version,
            parent_version=version - 1 if version else None, trainer_step=version if step is None else step,
            created_at=time.time(), lora=SPEC,
            payloads=[ObjectPayload(uri=ref.uri, bytes=ref.bytes, sha256=ref.sha256)],
            canary=reference if embedded else None, canary_follows=not embedded,
        )  # fmt: skip
        await run.bus.publish(subjects.adapter_ready(run.run, version), ev, msg_id=f"v{version}")
        if embedded or after is None:
            return

        async def follow() -> None:
            await asyncio.sleep(after)
            await publish_canary(run.bus, ev, reference)
            sent[version] = time.time()

        sending.append(asyncio.create_task(follow()))

    publish.sent = sent  # type: ignore[attr-defined]
    return publish


@pytest.mark.parametrize("fault", sorted(FAULTS))
async def test_a_load_that_does_not_answer_as_the_trainer_is_withdrawn(start_run, base, fault):
    run = await start_run(f"ca{fault[:2]}", seed=6, max_new_tokens=3, batch_groups=1)
    rec, publish = run.rec, publisher(run, base)
    engine = EmbeddedEngine(copy.deepcopy(base), eos_ids=[EOS], pad_id=0, slots=KEEP + 1)
    faulty(engine, fault, version=2)
    calls = Calls(engine, slow={2: 1.0})
    name = f"c{fault[:2]}"
    service = run.service(name, engine, reward_fn=lambda prompt, completion, answer: 0.0)
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    try:
        await publish(1)
        await wait_until(lambda: calls.canary_end(1), what="the healthy v1's canary")
        gaps = metrics.CANARY_GAP.labels(run.run, name)
        assert gaps._sum.get() <= TOLERANCE["float32"], "the healthy v1's canary gap"
        await wait_until(lambda: rec.trajectories, what="a v1 trajectory")
        await publish(2)
        # marked loaded at once, and generated with while its canary decodes
        await wait_until(lambda: rec.of(AdapterLoaded, name, version=2), what="v2 marked loaded")
        assert rec.of(AdapterLoaded, name, version=2)[0].canary_seconds is None
        await wait_until(lambda: rec.of(AdapterFailed, name, version=2), what=f"v2 ({FAULTS[fault]}) refused")
        failed = rec.of(AdapterFailed, name, version=2)
        assert len(failed) == 1 and not failed[0].will_retry
        assert "canary gap" in failed[0].reason and "withdrawn on this replica" in failed[0].reason
        assert 2 not in service.adapters.loaded(), "withdrawn: never granted again"
        await wait_until(lambda: rec.of(AdapterUnloaded, name, version=2), what="v2 unloaded once unpinned")
        assert "canary failed" in rec.of(AdapterUnloaded, name, version=2)[0].reason
        assert 2 not in await engine.loaded_versions() and service.adapters.loaded() == [1]
        end = calls.canary_end(2)
        assert end is not None and any(start < end for start, _ in calls.batches(2)), "no grant landed on v2"
        # the replica goes on with the version it has
        n = len(rec.trajectories)
        await wait_until(lambda: len(rec.trajectories) >= n + 2, what="trajectories after the refusal")
        await asyncio.sleep(0.3)
        assert len(rec.of(AdapterLoaded, name, version=2)) == 1, "a version whose canary failed is not loaded again"
        assert {v for t in rec.trajectories for c in t.completions for v in c.versions} == {1}
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


@pytest.mark.parametrize("flow", ["late-canary", "slow-decode", "embedded"])
async def test_a_version_generates_before_its_canary_ends_and_its_output_waits_for_it(start_run, base, flow):
    """`late-canary`: the canary message comes 1.5 s after the event (a trainer still computing
    it); `slow-decode`: it comes at once and the replica's decode takes 1.5 s; `embedded`: the
    event carries it (older trainers), decoded slowly."""
    run = await start_run("cw", seed=7, max_new_tokens=3, batch_groups=1)
    rec, publish = run.rec, publisher(run, base)
    engine = EmbeddedEngine(copy.deepcopy(base), eos_ids=[EOS], pad_id=0, slots=KEEP + 1)
    calls = Calls(engine, slow={} if flow == "late-canary" else {2: 1.5})
    service = run.service("cw", engine, reward_fn=lambda prompt, completion, answer: 0.0)
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    try:
        await publish(1, embedded=flow == "embedded")
        await wait_until(lambda: rec.trajectories, what="a v1 trajectory")
        await publish(2, after=1.5 if flow == "late-canary" else 0.0, embedded=flow == "embedded")
        await wait_until(lambda: rec.of(AdapterLoaded, "cw", version=2), what="v2 marked loaded")
        loaded = rec.of(AdapterLoaded, "cw", version=2)[0]
        await wait_until(lambda: any(t.oldest_version() == 2 for t in rec.trajectories), what="a v2 trajectory")
        end = calls.canary_end(2)
        assert end is not None and loaded.loaded_at < end, "marked loaded before its canary ended"
        if flow == "late-canary":
            assert loaded.loaded_at < publish.sent[2] <= end, "marked loaded before its canary came"
        first, _ = min(calls.batches(2))
        assert first < end - 1.0, "a v2 batch generated while its canary came or decoded"
        published = [t for t in rec.trajectories if t.oldest_version() == 2]
        assert min(t.finished_at for t in published) >= end, "a v2 trajectory published before its canary passed"
        assert metrics.CANARY_WAIT_SECONDS.labels(run.run, "cw")._sum.get() > 0.5, "the wait is observed"
        assert not rec.of(AdapterFailed, "cw")
        assert service.adapters.loaded() == [1, 2]
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


def canary_replica(run, base, name: str, canary_wait_s: float):
    """Replica `name` of `run` (embedded, its generates recorded) with `rollout.canary_wait_s`,
    running: (rec, publish, engine, calls, service, stop, task)."""
    run.cfg = msgspec.structs.replace(
        run.cfg, rollout=msgspec.structs.replace(run.cfg.rollout, canary_wait_s=canary_wait_s)
    )
    engine = EmbeddedEngine(copy.deepcopy(base), eos_ids=[EOS], pad_id=0, slots=KEEP + 1)
    calls = Calls(engine, slow={})
    service = run.service(name, engine, reward_fn=lambda prompt, completion, answer: 0.0)
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    return run.rec, publisher(run, base), engine, calls, service, stop, task


@pytest.mark.parametrize("how", ["never-sent", "other-weights"])
async def test_a_version_whose_canary_never_comes_or_is_not_its_own_is_withdrawn(start_run, base, how):
    """v2's event says its canary follows; it never comes within rollout.canary_wait_s (the
    trainer died before sending it), or the message on its subject names other weights (a
    canary of another adapter's bytes). v2 serves meanwhile, yet nothing it generated is
    published: it is withdrawn, reported, unloaded, and the replica goes on with v1."""
    run = await start_run(f"cn{how[:2]}", seed=9, max_new_tokens=3, batch_groups=1)
    name = f"n{how[:2]}"
    rec, publish, engine, calls, service, stop, task = canary_replica(run, base, name, canary_wait_s=1.5)
    try:
        await publish(1)
        await wait_until(lambda: rec.trajectories, what="a v1 trajectory")
        if how == "never-sent":
            await publish(2, after=None)
        else:  # a canary bound to other bytes (right version and epoch), sent after the event
            await publish(2, after=None)
            ev = await run.bus.last(streams.ADAPTERS(run.run), AdapterReady, subjects.adapter_ready(run.run, 2))
            other = msgspec.structs.replace(canary_message(ev, canary_of(base, run, 2)), adapter_sha256="0" * 64)
            await run.bus.publish(subjects.adapter_canary(run.run, 2), other)
        await wait_until(lambda: rec.of(AdapterLoaded, name, version=2), what="v2 marked loaded")
        await wait_until(lambda: rec.of(AdapterFailed, name, version=2), what="v2 refused")
        failed = rec.of(AdapterFailed, name, version=2)
        assert len(failed) == 1 and not failed[0].will_retry and "withdrawn on this replica" in failed[0].reason
        if how == "never-sent":
            assert "none came on" in failed[0].reason and "rollout.canary_wait_s 1.5 s" in failed[0].reason
        else:
            assert "is not this event's (adapter_sha256:" in failed[0].reason
        await wait_until(lambda: rec.of(AdapterUnloaded, name, version=2), what="v2 unloaded once unpinned")
        assert 2 not in service.adapters.loaded() and 2 not in await engine.loaded_versions()
        assert calls.canary_end(2) is None, "no canary to decode"
        if how == "never-sent":
            assert calls.batches(2), "no grant landed on v2 while it waited for its canary"
        n = len(rec.trajectories)
        await wait_until(lambda: len(rec.trajectories) >= n + 2, what="trajectories after the refusal")
        assert {v for t in rec.trajectories for c in t.completions for v in c.versions} == {1}
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


async def test_a_version_whose_trainer_was_replaced_before_its_canary_is_withdrawn_at_once(start_run, base):
    """v2 is announced and its trainer dies before sending its canary; its successor resumed from
    v1's checkpoint and announces v3 at v1's trainer step. No canary of v2 can come any more, so
    the replica stops waiting at v3's event, not after rollout.canary_wait_s (60 s here: the
    stall CI's chaos run showed), withdraws v2 and goes on with v3."""
    run = await start_run("corph", seed=9, max_new_tokens=3, batch_groups=1)
    name = "norph"
    rec, publish, engine, calls, service, stop, task = canary_replica(run, base, name, canary_wait_s=60.0)
    try:
        await publish(1)
        await wait_until(lambda: rec.trajectories, what="a v1 trajectory")
        await publish(2, after=None)
        await wait_until(lambda: rec.of(AdapterLoaded, name, version=2), what="v2 marked loaded")
        await wait_until(lambda: calls.batches(2), what="a grant on v2 while it waits for its canary")
        replaced = time.time()
        await publish(3, step=1)
        await wait_until(lambda: rec.of(AdapterFailed, name, version=2), what="v2 given up", timeout=20.0)
        assert time.time() - replaced < 20.0
        [failed] = rec.of(AdapterFailed, name, version=2)
        assert not failed.will_retry and "its successor resumed from an older checkpoint" in failed.reason
        assert "v3 was announced at trainer step 1, not after v2's step 2" in failed.reason
        await wait_until(lambda: any(3 in c.versions for t in rec.trajectories for c in t.completions),
                         what="a v3 trajectory", timeout=30.0)  # fmt: skip
        assert not any(2 in c.versions for t in rec.trajectories for c in t.completions)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


def canary_of(base, run, version: int):
    model = peft_version(base, seed=50 + version)[0]
    prompt_ids = trainer_canary.prompts(base.config.vocab_size, seed=run.cfg.seed)
    return trainer_canary.reference(model, prompt_ids, "float32")


async def test_the_fast_path_serves_with_both_checks_in_flight_and_both_must_pass(start_run, base):
    """The embedded fast path: the sha256 of the bytes copied and the canary both run while the
    version serves. v2's bytes are the announced ones (its sha256 passes) but its canary is
    another adapter's: it is withdrawn and given up, not loaded again verify-first."""
    from services.rollout import load_path

    run = await start_run("cf", seed=8, max_new_tokens=3, batch_groups=1)
    rec, publish = run.rec, publisher(run, base)
    engine = EmbeddedEngine(copy.deepcopy(base), eos_ids=[EOS], pad_id=0, slots=KEEP + 1)
    calls = Calls(engine, slow={2: 1.0})
    stager = load_path.Stager(engine, lambda uri: run.store)
    service = run.service("cf", engine, reward_fn=lambda prompt, completion, answer: 0.0, stager=stager)
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    try:
        await publish(1)
        await wait_until(lambda: rec.trajectories, what="a v1 trajectory, both its checks passed")
        want = adapter_io.sha256(peft_version(base, seed=51)[1])
        assert {r.adapter_sha256 for t in rec.trajectories for c in t.completions for r in c.ranges} == {want}
        await publish(2, canary_of=9)
        await wait_until(lambda: rec.of(AdapterUnloaded, "cf", version=2), what="v2 withdrawn and unloaded")
        failed = rec.of(AdapterFailed, "cf", version=2)
        assert len(failed) == 1 and not failed[0].will_retry and "canary gap" in failed[0].reason
        end = calls.canary_end(2)
        assert end is not None and any(start < end for start, _ in calls.batches(2)), "no grant landed on v2"
        n = len(rec.trajectories)
        await wait_until(lambda: len(rec.trajectories) >= n + 2, what="trajectories after the refusal")
        assert len(rec.of(AdapterLoaded, "cf", version=2)) == 1, "not loaded again verify-first"
        assert {v for t in rec.trajectories for c in t.completions for v in c.versions} == {1}
        assert 2 not in await engine.loaded_versions()
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
