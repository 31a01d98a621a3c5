"""A rollout replica against a real nats-server and a local object store."""

from __future__ import annotations

import asyncio
import copy
import time
import uuid

import pytest
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

from proto import subjects
from proto.messages import (
    AdapterFailed,
    AdapterLoaded,
    AdapterReady,
    AdapterUnloaded,
    AdmissionGrant,
    AdmissionRequest,
    LoraSpec,
    ObjectPayload,
    ReplicaHeartbeat,
    RolloutReport,
    Trajectory,
)
from services.common import adapter_io
from services.common.bus import Bus
from services.common.data import Prompt
from services.common.lora_targets import HF_LINEAR
from services.common.store import LocalStore
from services.config.schema import (
    BusConfig,
    DatasetConfig,
    GenerationConfig,
    LorabusConfig,
    RolloutConfig,
    StoreConfig,
)
from services.rollout.__main__ import fetcher
from services.rollout.engines.embedded import EmbeddedEngine
from services.rollout.service import INCARNATION, RolloutService
from tests.fixtures.tiny import tiny_qwen2
from tests.fixtures.waiting import wait_until

TARGETS = list(HF_LINEAR)
RANK, ALPHA, EOS, KEEP = 4, 8.0, 96, 2
SPEC = LoraSpec(rank=RANK, alpha=ALPHA, target_modules=TARGETS, base_model="tiny")


def tiny_model():
    return tiny_qwen2()


def peft_version(base, seed: int):
    torch.manual_seed(seed)
    cfg = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, init_lora_weights=False)
    model = get_peft_model(copy.deepcopy(base), cfg).eval()
    state = {adapter_io.standardize_key(k): v for k, v in get_peft_model_state_dict(model).items()}
    return model, adapter_io.to_bytes(state)


def encode(text: str) -> list[int]:
    return [1 + ord(c) % 90 for c in text]


class Recorder:
    def __init__(self):
        self.reports: list = []
        self.trajectories: list[Trajectory] = []

    async def on_report(self, msg, meta):
        self.reports.append(msg)

    async def on_trajectory(self, msg, meta):
        self.trajectories.append(msg)

    def of(self, kind, replica, **match):
        return [
            r
            for r in self.reports
            if isinstance(r, kind) and r.replica == replica and all(getattr(r, k) == v for k, v in match.items())
        ]


PROMPTS = [Prompt(prompt_id=f"p{i}", text=f"{i}+{i}=", answer=str(2 * i)) for i in range(5)]


class Run:
    """One test's run: its config, store, bus (streams made, every admission granted the
    newest version the replica has loaded) and the recorder of its reports and trajectories."""

    def __init__(self, cfg: LorabusConfig, store: LocalStore, bus: Bus, rec: Recorder):
        self.cfg, self.run, self.store, self.bus, self.rec = cfg, cfg.run, store, bus, rec

    async def publish(self, version: int, data: bytes, sha: str | None = None, epoch: str = "e0") -> None:
        """Store `data` as `version` and announce it, with `sha` in place of its real sha256."""
        ref = self.store.put_bytes(f"{self.run}/adapters/v{version}/adapter_model.safetensors", data)
        ev = AdapterReady(
            run=self.run,
            trainer_epoch=epoch,
            lora_name="tiny",
            version=version,
            parent_version=version - 1 if version else None,
            trainer_step=version,
            created_at=time.time(),
            lora=SPEC,
            payloads=[ObjectPayload(uri=ref.uri, bytes=ref.bytes, sha256=sha or ref.sha256)],
        )
        await self.bus.publish(
            subjects.adapter_ready(self.run, version), ev, msg_id=f"{self.run}-v{version}-{sha}-{epoch}"
        )

    def service(self, name: str, engine: EmbeddedEngine, reward_fn, **extra) -> RolloutService:
        return RolloutService(
            self.cfg,
            name,
            engine,
            self.bus,
            fetch=fetcher(self.cfg),
            encode=encode,
            decode_text=lambda ids: "".join(chr(48 + i % 10) for i in ids),
            reward_fn=reward_fn,
            prompts=PROMPTS,
            load_attempts=2,
            retry_base_s=0.05,
            **extra,
        )


@pytest.fixture
async def start_run(nats_url, tmp_path):
    """`await start_run(prefix, seed=, max_new_tokens=, batch_groups=)`: a Run; its bus is
    closed after the test."""
    buses: list[Bus] = []

    async def start(prefix: str, *, seed: int, max_new_tokens: int, batch_groups: int) -> Run:
        run = f"{prefix}{uuid.uuid4().hex[:8]}"
        cfg = LorabusConfig(
            run=run,
            seed=seed,
            bus=BusConfig(url=nats_url),
            store=StoreConfig(uri=f"file://{tmp_path}/store"),
            gconfig=GenerationConfig(n_samples=2, max_new_tokens=max_new_tokens, temperature=1.0),
            rollout=RolloutConfig(
                lora_name="tiny", lora_keep_versions=KEEP, batch_groups=batch_groups, heartbeat_s=0.2
            ),
            train_dataset=DatasetConfig(path="builtin:none", shuffle=True),
        )
        bus = await Bus.connect(cfg.bus, run=run, service="test")
        buses.append(bus)
        await bus.ensure_streams()
        rec = Recorder()
        await bus.subscribe(subjects.rollout_report_all(run), RolloutReport, rec.on_report)
        await bus.subscribe(subjects.trajectory_all(run), Trajectory, rec.on_trajectory)

        async def admission(req: AdmissionRequest):
            return AdmissionGrant(
                request_id=req.request_id,
                grant_id=uuid.uuid4().hex,
                version=max(req.loaded_versions),
                lease_expires_at=time.time() + 60,
            )

        await bus.serve(subjects.admission(run), AdmissionRequest, admission)
        return Run(cfg, LocalStore(tmp_path / "store"), bus, rec)

    yield start
    for bus in buses:
        await bus.close()


@pytest.fixture
def base():
    return tiny_model()


async def test_rollout_replica_follows_versions(start_run, base):
    run = await start_run("rt", seed=3, max_new_tokens=6, batch_groups=2)
    rec, publish = run.rec, run.publish
    versions = {v: peft_version(base, seed=20 + v) for v in range(3)}

    def replica(name: str):
        engine = EmbeddedEngine(copy.deepcopy(base), eos_ids=[EOS], pad_id=0, slots=KEEP + 1)
        return engine, run.service(
            name, engine, reward_fn=lambda prompt, completion, answer: float(completion.startswith(answer))
        )

    await publish(0, versions[0][1])
    engine, service = replica("r1")
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    try:
        await wait_until(lambda: rec.of(AdapterLoaded, "r1", version=0), what="v0 loaded")
        await wait_until(lambda: any(t.replica == "r1" for t in rec.trajectories), what="a trajectory")
        await wait_until(lambda: rec.of(ReplicaHeartbeat, "r1"), what="a heartbeat")
        # issue 30: it names this process, so the registry tells a restart by identity
        assert {b.incarnation for b in rec.of(ReplicaHeartbeat, "r1")} == {INCARNATION}

        # trajectories carry the version and logprobs of a separate forward of base + v0
        traj = next(t for t in rec.trajectories if t.replica == "r1")
        assert traj.prompt_id in {p.prompt_id for p in PROMPTS}
        assert len(traj.completions) == 2
        for c in traj.completions:
            assert c.versions == [0] * len(c.token_ids)
            ids = torch.tensor([traj.prompt_token_ids + c.token_ids])
            with torch.no_grad():
                logits = versions[0][0](input_ids=ids).logits[0]
            p = len(traj.prompt_token_ids)
            want = logits[p - 1 : -1].log_softmax(-1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(c.logprobs), want, atol=1e-4, rtol=0)
            # issue 28: every token's range names the bytes the loader hashed and the engine
            assert [(r.start, r.end, r.version) for r in c.ranges] == [(0, len(c.token_ids), 0)]
            assert c.ranges[0].adapter_sha256 == adapter_io.sha256(versions[0][1])
            assert (c.ranges[0].engine, c.ranges[0].engine_id) == ("embedded", "r1")

        await publish(1, versions[1][1])
        await wait_until(lambda: rec.of(AdapterLoaded, "r1", version=1), what="v1 loaded")
        await wait_until(lambda: any(t.oldest_version() == 1 for t in rec.trajectories), what="a v1 trajectory")
        await publish(2, versions[2][1])
        await wait_until(lambda: rec.of(AdapterUnloaded, "r1", version=0), what="v0 unloaded")
        assert await engine.loaded_versions() == [1, 2]

        # a late replica starts from the head and skips what is outside the window
        engine2, service2 = replica("r2")
        stop2 = asyncio.Event()
        task2 = asyncio.create_task(service2.run(stop2))
        await wait_until(lambda: rec.of(AdapterLoaded, "r2"), what="r2 loaded something")
        assert rec.of(AdapterLoaded, "r2")[0].version == 2
        await wait_until(lambda: rec.of(AdapterLoaded, "r2", version=1), what="r2 loaded v1")
        await asyncio.sleep(0.3)
        assert not rec.of(AdapterLoaded, "r2", version=0)
        stop2.set()
        await asyncio.wait_for(task2, 30)

        # a corrupt object: given up at once (reading again gives the same bytes), reported,
        # never loaded, and the next version loads behind it
        await publish(3, versions[0][1], sha="0" * 64)
        await wait_until(lambda: rec.of(AdapterFailed, "r1", version=3), what="v3 failed")
        failed = rec.of(AdapterFailed, "r1", version=3)
        assert len(failed) == 1 and not failed[0].will_retry and "sha" in failed[0].reason.lower()
        await publish(4, versions[0][1])
        await wait_until(lambda: rec.of(AdapterLoaded, "r1", version=4), what="v4 loaded after v3 was given up")
        assert 3 not in await engine.loaded_versions()
        assert not rec.of(AdapterLoaded, "r1", version=3)

        # Issue 17: a jump to v1000000 (once the rollouts' frozen head for the rest of the run)
        # and another trainer epoch's v6 are refused, not followed; a replica starting after
        # them starts from the real head
        await publish(5, versions[1][1])
        await publish(1_000_000, versions[2][1])
        await publish(6, versions[0][1], epoch="forger")
        await wait_until(lambda: rec.of(AdapterLoaded, "r1", version=5), what="the real v5 loaded")
        engine3, service3 = replica("r3")
        stop3 = asyncio.Event()
        task3 = asyncio.create_task(service3.run(stop3))
        await wait_until(lambda: rec.of(AdapterLoaded, "r3"), what="r3 loaded something")
        assert rec.of(AdapterLoaded, "r3")[0].version == 5
        await asyncio.sleep(0.5)
        stop3.set()
        await asyncio.wait_for(task3, 30)
        for r in ("r1", "r3"):
            assert not rec.of(AdapterLoaded, r, version=1_000_000) and not rec.of(AdapterLoaded, r, version=6)
        assert service.adapters.newest_seen == 5 and service3.adapters.newest_seen == 5
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


async def test_fast_load_path_publishes_nothing_generated_beside_unverified_weights(start_run, base, monkeypatch):
    """The embedded fast path serves a version before its sha256 check ends. A version whose
    bytes fail the check (the event announces another sha256) is generated with while the
    check runs (it is slowed down here so that grants certainly land on it), yet no trajectory
    generated meanwhile is published; the version is withdrawn, reported, and never served
    again, and the replica goes on with the verified versions."""
    from services.rollout import load_path

    run = await start_run("rf", seed=4, max_new_tokens=4, batch_groups=1)
    rec, publish = run.rec, run.publish

    slow_check = asyncio.Event()
    verify = load_path._verify

    def slow_verify(buf, obj, times):
        if slow_check.is_set():
            time.sleep(1.5)
        return verify(buf, obj, times)

    monkeypatch.setattr(load_path, "_verify", slow_verify)
    generated_on: list[int] = []
    engine = EmbeddedEngine(copy.deepcopy(base), eos_ids=[EOS], pad_id=0, slots=KEEP + 1)
    generate = engine.generate

    async def recording_generate(requests, version):
        generated_on.append(version)
        return await generate(requests, version)

    engine.generate = recording_generate  # type: ignore[method-assign]
    stager = load_path.Stager(engine, lambda uri: run.store)
    service = run.service("f1", engine, reward_fn=lambda prompt, completion, answer: 0.0, stager=stager)

    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    try:
        # the first version's bytes are not the announced ones: served at once, checked slowly
        slow_check.set()
        await publish(0, peft_version(base, seed=30)[1], sha="0" * 64)
        await wait_until(lambda: 0 in generated_on, what="a generation on the unverified v0")
        await wait_until(
            lambda: any("withdrawn" in f.reason for f in rec.of(AdapterFailed, "f1", version=0)), what="v0 withdrawn"
        )
        # the verify-first retry fails too (the bytes never match), and v0 is gone for good
        await wait_until(lambda: rec.of(AdapterFailed, "f1", version=0, will_retry=False), what="final failure")
        assert 0 not in await engine.loaded_versions() and 0 not in service.adapters.loaded()
        assert not rec.trajectories, "a trajectory generated with unverified weights was published"

        slow_check.clear()
        await publish(1, peft_version(base, seed=31)[1])
        await wait_until(lambda: len(rec.trajectories) >= 3, what="trajectories of the verified v1")
        assert {t.oldest_version() for t in rec.trajectories} == {1}
        # issue 28: the digest the ranges name is the background check's, of the bytes copied
        want = adapter_io.sha256(peft_version(base, seed=31)[1])
        assert {(r.version, r.adapter_sha256) for t in rec.trajectories for c in t.completions for r in c.ranges} == {
            (1, want)
        }
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


async def test_a_batch_whose_trajectories_cannot_be_stored_fails_by_name_and_the_replica_goes_on(
    start_run, base, monkeypatch, caplog
):
    from services.common import streams
    from services.rollout import service as rollout_service

    monkeypatch.setattr(rollout_service, "PUBLISH_TIMEOUT_S", 0.3)
    run = await start_run("rs", seed=4, max_new_tokens=4, batch_groups=2)
    await run.publish(0, peft_version(base, seed=30)[1])
    await run.bus.js.delete_stream(streams.TRAJECTORIES(run.run))  # nothing stores a trajectory now
    engine = EmbeddedEngine(copy.deepcopy(base), eos_ids=[EOS], pad_id=0, slots=KEEP + 1)
    service = run.service("r1", engine, reward_fn=lambda prompt, completion, answer: 0.0)
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    try:
        await wait_until(lambda: "trajectories not stored on" in caplog.text, what="the batch's failure, named")
        assert f"{subjects.trajectory(run.run, 'r1')}" in caplog.text and "ensure_streams" in caplog.text
        await run.bus.ensure_streams()
        stored: list[Trajectory] = []

        async def some_stored() -> bool:
            stored[:] = await run.bus.read_all(streams.TRAJECTORIES(run.run), Trajectory)
            return bool(stored)

        await wait_until(some_stored, what="trajectories stored once the stream is back")
        assert all(t.replica == "r1" and len(t.completions) == 2 for t in stored)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
