"""Issue 28 end to end: a real registry process, a real nats-server, two embedded replicas.

One replica's fetch is a buggy cache: for v1 it hands the engine v0's bytes (a stale copy
served under the new name; the event's sha256 is v1's). Its loader hashes what it handed the
engine, so its v1 trajectories name v0's digest, and the registry rejects every one of them
(`identity`), while the healthy replica's v1 trajectories are accepted: nothing the stale copy
generated reaches the accepted stream, and the run goes on with the healthy replica.
"""

from __future__ import annotations

import asyncio
import copy
import time
import uuid

import pytest

from proto import subjects
from proto.messages import AdapterLoaded, AdapterReady, ObjectPayload, RolloutReport, Trajectory, TrajectoryDecision
from services.common import adapter_io
from services.common.bus import Bus
from services.common.store import LocalStore
from services.config.schema import BusConfig, DatasetConfig, GenerationConfig, LorabusConfig, RolloutConfig, StoreConfig
from services.rollout.__main__ import fetcher
from services.rollout.engines.embedded import EmbeddedEngine
from services.rollout.service import RolloutService
from tests.fixtures.waiting import wait_until
from tests.integration.test_registry_service import accepted_ids, start_registry, status
from tests.integration.test_rollout_service import EOS, KEEP, PROMPTS, SPEC, Recorder, encode, peft_version


@pytest.fixture
def base():
    from tests.fixtures.tiny import tiny_qwen2

    return tiny_qwen2()


async def test_a_stale_copy_under_a_new_name_is_never_accepted(nats_url, tmp_path, base):
    run = f"id{uuid.uuid4().hex[:8]}"
    # B large enough that the staleness capacity never binds: with B = 2 the healthy replica
    # could take every v1 grant there is, and the stale one would never show its lie
    registry = start_registry(
        tmp_path, nats_url, run,
        "  max_head_offpolicyness: 1\n  consumer_batch_size: 64\n  max_concurrent_rollouts: 4\n  lease_seconds: 30\n",
    )  # fmt: skip
    cfg = LorabusConfig(
        run=run,
        seed=5,
        bus=BusConfig(url=nats_url),
        store=StoreConfig(uri=f"file://{tmp_path}/store"),
        gconfig=GenerationConfig(n_samples=2, max_new_tokens=3, temperature=1.0),
        rollout=RolloutConfig(lora_name="tiny", lora_keep_versions=KEEP, batch_groups=1, heartbeat_s=0.2),
        train_dataset=DatasetConfig(path="builtin:none", shuffle=True),
    )
    bus = await Bus.connect(cfg.bus, run=run, service="test")
    store = LocalStore(tmp_path / "store")
    rec = Recorder()
    decided: list[TrajectoryDecision] = []
    stops: list[asyncio.Event] = []
    tasks: list[asyncio.Task] = []
    try:
        await bus.ensure_streams()
        await status(bus, registry)
        await bus.subscribe(subjects.rollout_report_all(run), RolloutReport, rec.on_report)
        await bus.subscribe(subjects.trajectory_all(run), Trajectory, rec.on_trajectory)

        async def on_decision(msg, meta):
            decided.append(msg)

        await bus.subscribe(subjects.decision_all(run), TrajectoryDecision, on_decision)
        weights = {v: peft_version(base, seed=40 + v)[1] for v in range(2)}

        async def publish(version: int) -> None:
            ref = store.put_bytes(f"{run}/adapters/v{version}/adapter_model.safetensors", weights[version])
            ev = AdapterReady(
                run=run, trainer_epoch="e0", lora_name="tiny", version=version,
                parent_version=version - 1 if version else None, trainer_step=version, created_at=time.time(),
                lora=SPEC, payloads=[ObjectPayload(uri=ref.uri, bytes=ref.bytes, sha256=ref.sha256)],
            )  # fmt: skip
            await bus.publish(subjects.adapter_ready(run, version), ev, msg_id=f"v{version}")

        verified = fetcher(cfg)

        def stale_cache(ev: AdapterReady) -> bytes:
            return weights[0] if ev.version == 1 else verified(ev)

        def replica(name: str, fetch) -> None:
            engine = EmbeddedEngine(copy.deepcopy(base), eos_ids=[EOS], pad_id=0, slots=KEEP + 1)
            service = RolloutService(
                cfg, name, engine, bus, fetch=fetch, encode=encode,
                decode_text=lambda ids: "".join(chr(48 + i % 10) for i in ids),
                reward_fn=lambda prompt, completion, answer: 0.0, prompts=PROMPTS, load_attempts=2, retry_base_s=0.05,
            )  # fmt: skip
            stops.append(asyncio.Event())
            tasks.append(asyncio.create_task(service.run(stops[-1])))

        await publish(0)
        replica("good", verified)
        replica("stale", stale_cache)
        for name in ("good", "stale"):
            await wait_until(lambda n=name: rec.of(AdapterLoaded, n, version=0), what=f"{name} loaded v0")
        await publish(1)

        def v1_decisions(name: str) -> list[TrajectoryDecision]:
            v1 = {t.trajectory_id for t in rec.trajectories if t.replica == name and t.oldest_version() == 1}
            return [d for d in decided if d.trajectory_id in v1]

        await wait_until(lambda: len(v1_decisions("stale")) >= 2, 60, what="decisions on the stale replica's v1")
        await wait_until(lambda: len(v1_decisions("good")) >= 2, 60, what="decisions on the healthy replica's v1")
        stale = v1_decisions("stale")
        assert all(d.verdict == "rejected-invalid" and d.reason.startswith("identity: tokens of v1") for d in stale)
        assert adapter_io.sha256(weights[0]) in stale[0].reason and adapter_io.sha256(weights[1]) in stale[0].reason
        assert all(d.verdict == "accepted" for d in v1_decisions("good"))
        # the stale replica's v0 work (the real v0) was accepted: only the lie is refused
        stale_v0 = {t.trajectory_id for t in rec.trajectories if t.replica == "stale" and t.oldest_version() == 0}
        assert any(d.verdict == "accepted" for d in decided if d.trajectory_id in stale_v0)
        accepted = set(await accepted_ids(bus))
        assert not accepted & {d.trajectory_id for d in stale}, "a stale-copy trajectory reached the trainer"
        assert accepted & {d.trajectory_id for d in v1_decisions("good")}
        ledger = (await status(bus, registry)).ledger
        assert ledger.rejected.get("identity", 0) >= len(stale)
    finally:
        for stop in stops:
            stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        await bus.close()
        registry.stop()
