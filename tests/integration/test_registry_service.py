"""The registry as its own process (`python -m services.registry`) against a real nats-server:
admissions, decisions, the accepted stream, kill -9 and restart, and bad input."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import msgspec
import nats.errors
import pytest

from proto import codec, subjects
from proto import messages as m
from proto.messages import (
    AdapterLoaded,
    AdapterReady,
    AdmissionDeny,
    AdmissionGrant,
    AdmissionReply,
    AdmissionRequest,
    Completion,
    DeadLetter,
    LoraSpec,
    ObjectPayload,
    Trajectory,
    TrajectoryDecision,
)
from services.common import streams
from services.common.bus import Bus
from services.config.schema import BusConfig
from services.registry.status import RegistryStatus, StatusRequest
from tests.fixtures.service_process import ServiceProcess
from tests.fixtures.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
LORA = LoraSpec(rank=2, alpha=4.0, target_modules=["q_proj"], base_model="tiny")


class Registry(ServiceProcess):
    def __init__(self, config: Path, log: Path):
        super().__init__("services.registry", config, log, stop_timeout_s=10.0)


@pytest.fixture
def run() -> str:
    return f"reg{uuid.uuid4().hex[:8]}"


def start_registry(tmp_path: Path, nats_url: str, run: str, rollout: str) -> Registry:
    """A registry process for `run` with these `rollout:` settings (YAML lines, indented)."""
    config = tmp_path / "registry.yaml"
    config.write_text(
        f"""
experiment_name: {run}
trial_name: t
run: {run}
bus: {{url: "{nats_url}"}}
metrics: {{host: 127.0.0.1, port: 0}}
actor: {{path: examples/tiny/model}}
train_dataset: {{path: "builtin:arith"}}
rollout:
{rollout}"""
    )
    reg = Registry(config, tmp_path / "registry.log")
    reg.start()
    return reg


@pytest.fixture
def registry(tmp_path, nats_url, run):
    reg = start_registry(
        tmp_path,
        nats_url,
        run,
        "  max_head_offpolicyness: 1\n  consumer_batch_size: 2\n  max_concurrent_rollouts: 3\n  lease_seconds: 30\n",
    )
    yield reg
    reg.stop()


@pytest.fixture
async def bus(nats_url, run):
    bus = await Bus.connect(BusConfig(url=nats_url), run=run, service="tester")
    await bus.ensure_streams()
    yield bus
    await bus.close()


async def status(bus: Bus, registry: Registry, timeout: float = 15.0) -> RegistryStatus:
    async def answer() -> RegistryStatus | None:
        assert registry.alive(), f"registry exited:\n{registry.log_tail()}"
        try:
            return await bus.request(
                subjects.registry_status(bus.run), StatusRequest(run=bus.run), RegistryStatus,
                timeout=0.5,
            )  # fmt: skip
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
            return None

    return await wait_until(answer, timeout, lambda: f"the registry to answer:\n{registry.log_tail()}", interval=0.1)


async def wait_status(bus, registry, predicate, timeout: float = 10.0) -> RegistryStatus:
    last: list[RegistryStatus] = []

    async def matched() -> RegistryStatus | None:
        last[:] = [await status(bus, registry)]
        return last[0] if predicate(last[0]) else None

    return await wait_until(matched, timeout, lambda: f"a matching status; last: {last[0].ledger}")


def ready(run: str, version: int, step: int | None = None) -> AdapterReady:
    return AdapterReady(
        run=run, trainer_epoch="e0", lora_name="lora", version=version,
        trainer_step=version if step is None else step, created_at=1000.0 + version, lora=LORA,
        payloads=[ObjectPayload(uri=f"file:///store/v{version}", bytes=1, sha256="0" * 64)],
    )  # fmt: skip


def trajectory(run: str, grant: AdmissionGrant, tid: str, replica: str = "r1", versions=None) -> Trajectory:
    versions = versions if versions is not None else [grant.version] * 3
    return Trajectory(
        run=run, trajectory_id=tid, grant_id=grant.grant_id, replica=replica, prompt_id="p0",
        prompt_token_ids=[1, 2, 3],
        completions=[Completion(token_ids=[4] * len(versions), logprobs=[-0.7] * len(versions),
                                versions=list(versions), reward=1.0)],
        started_at=time.time() - 1, finished_at=time.time(),
    )  # fmt: skip


class Decisions:
    """Collects the decisions published for one replica."""

    def __init__(self):
        self.got: list[TrajectoryDecision] = []

    async def __call__(self, msg, meta):
        self.got.append(msg)

    async def wait(self, n: int, timeout: float = 10.0) -> list[TrajectoryDecision]:
        await wait_until(lambda: len(self.got) >= n, timeout, lambda: f"{n} decisions; got {self.got}", interval=0.02)
        return self.got


async def admit(bus, replica="r1", rid=None, loaded=(0,)) -> AdmissionReply:
    req = AdmissionRequest(
        run=bus.run, replica=replica, request_id=rid or uuid.uuid4().hex, loaded_versions=list(loaded)
    )
    return await bus.request(subjects.admission(bus.run), req, AdmissionReply, timeout=5.0)


async def stream_messages(bus, stream: str, subject: str) -> list[bytes]:
    sub = await bus.js.pull_subscribe(subject, stream=stream)
    try:
        msgs = await sub.fetch(1000, timeout=0.5)
    except (TimeoutError, nats.errors.TimeoutError):
        msgs = []
    finally:
        await sub.unsubscribe()
    return [m.data for m in msgs]


async def accepted_ids(bus) -> list[str]:
    raw = await stream_messages(bus, streams.ACCEPTED(bus.run), subjects.accepted(bus.run))
    return [codec.decode(r, Trajectory).trajectory_id for r in raw]


async def dead_letters(bus, n: int, timeout: float = 10.0) -> list[DeadLetter]:
    letters: list[DeadLetter] = []

    async def enough() -> bool:
        raw = await stream_messages(bus, streams.DEADLETTER(bus.run), subjects.dead_letter(bus.run, "registry"))
        letters[:] = [codec.decode(r, DeadLetter) for r in raw]
        return len(letters) >= n

    await wait_until(enough, timeout, lambda: f"{n} dead letters from the registry; got {letters}", interval=0.1)
    return letters


async def test_admit_decide_kill9_restart_keeps_ledger(bus, registry, run):
    await status(bus, registry)
    decisions = Decisions()
    await bus.subscribe(subjects.decision(run, "r1"), TrajectoryDecision, decisions)

    denied = await admit(bus)
    assert isinstance(denied, AdmissionDeny) and denied.reason.startswith("no-adapter")

    await bus.publish(subjects.adapter_ready(run, 0), ready(run, 0), msg_id="v0")
    await wait_status(bus, registry, lambda s: s.ledger.head == 0)
    g1 = await admit(bus, rid="q1")
    g2 = await admit(bus, rid="q2")
    assert isinstance(g1, AdmissionGrant) and isinstance(g2, AdmissionGrant)
    assert g1.version == g2.version == 0
    # k=1, B=2, H=0: (k + H + 1) * B = 4 accepted-or-running; max_concurrent 3
    g3 = await admit(bus, rid="q3")
    assert isinstance(g3, AdmissionGrant)
    over = await admit(bus, rid="q4")
    assert isinstance(over, AdmissionDeny) and over.reason.startswith("max-concurrent")

    t1 = trajectory(run, g1, "traj-1")
    await bus.publish(subjects.trajectory(run, "r1"), t1, msg_id=t1.trajectory_id)
    (d1,) = await decisions.wait(1)
    assert (d1.trajectory_id, d1.verdict, d1.head_version, d1.oldest_version) == ("traj-1", "accepted", 0, 0)
    assert await accepted_ids(bus) == ["traj-1"]

    # v1, v2: g2 (v0) is now H - v = 2 > k at decision time even though it was admissible
    await bus.publish(subjects.adapter_ready(run, 1), ready(run, 1), msg_id="v1")
    await bus.publish(subjects.adapter_ready(run, 2), ready(run, 2), msg_id="v2")
    await wait_status(bus, registry, lambda s: s.ledger.head == 2)
    t2 = trajectory(run, g2, "traj-2")
    await bus.publish(subjects.trajectory(run, "r1"), t2, msg_id=t2.trajectory_id)
    d2 = (await decisions.wait(2))[1]
    assert d2.verdict == "rejected-stale" and d2.oldest_version == 0 and d2.head_version == 2

    before = await status(bus, registry)
    assert before.ledger.accepted == 1 and before.ledger.rejected == {"stale": 1}
    # status lists grants by a digest, never by the id that would let its reader use them
    assert len(before.ledger.grants) == 1 and g3.grant_id not in msgspec.json.encode(before).decode()
    assert not before.ledger.grant_by_request

    registry.kill()
    registry.start()
    after = await status(bus, registry)
    assert after.ledger.head == 2
    assert after.ledger.accepted == 1 and after.ledger.rejected == {"stale": 1}
    assert after.ledger.grants == before.ledger.grants
    assert after.ledger_revision == before.ledger_revision
    assert after.ledger.next_grant == before.ledger.next_grant

    # a duplicate after the restart (new stream message, same trajectory id) gets the first
    # decision and is not accepted again
    await bus.publish(subjects.trajectory(run, "r1"), t1, msg_id="resend-traj-1")
    d_dup = (await decisions.wait(3))[2]
    assert d_dup == d1
    # g3's lease survived the restart: its trajectory (made with v0, now stale) is decided
    # normally, and a replica that loads v2 is admitted at head
    t3 = trajectory(run, g3, "traj-3", versions=[0, 1])
    await bus.publish(subjects.trajectory(run, "r1"), t3, msg_id=t3.trajectory_id)
    d3 = (await decisions.wait(4))[3]
    assert d3.verdict == "rejected-stale", d3
    await bus.publish(
        subjects.rollout_report(run, "r1", "loaded"),
        AdapterLoaded(run=run, replica="r1", version=2, via="object", load_seconds=0.1, loaded_at=time.time()),
    )
    await wait_status(bus, registry, lambda s: s.ledger.versions[2].loaded_by == {"r1"})
    g4 = await admit(bus, rid="q5", loaded=())
    assert isinstance(g4, AdmissionGrant) and g4.version == 2
    t4 = trajectory(run, g4, "traj-4")
    await bus.publish(subjects.trajectory(run, "r1"), t4, msg_id=t4.trajectory_id)
    assert (await decisions.wait(5))[4].verdict == "accepted"

    final = await status(bus, registry)
    assert final.ledger.accepted == 2
    assert sorted(await accepted_ids(bus)) == ["traj-1", "traj-4"]


async def test_bad_input_is_dead_lettered_and_registry_keeps_serving(bus, registry, run):
    await status(bus, registry)
    await bus.publish(subjects.adapter_ready(run, 1), ready(run, 1), msg_id="v1")
    await wait_status(bus, registry, lambda s: s.ledger.head == 1)

    good = msgspec.to_builtins(ready(run, 2))
    adapter_subject = subjects.adapter_ready(run, 0)
    bad_adapters = [
        b"{not json",
        msgspec.json.encode({"schema_version": "1.0", "run": run, "version": "two"}),
        msgspec.json.encode({**good, "schema_version": "9.0"}),
    ]
    for raw in bad_adapters:
        await bus.js.publish(adapter_subject, raw)
    # a regression (v0 below head v1) and a conflicting republish of v1 decode fine but are
    # refused by the policy
    await bus.publish(subjects.adapter_ready(run, 0), ready(run, 0), msg_id="v0-late")
    await bus.publish(subjects.adapter_ready(run, 1), ready(run, 1, step=77), msg_id="v1-again")
    await bus.js.publish(subjects.trajectory(run, "r1"), b"\x00\x01 binary")
    # a malformed admission request gets no reply (the requester times out) and a letter
    with pytest.raises(nats.errors.TimeoutError):
        await bus.nc.request(subjects.admission(run), b"[1, 2]", timeout=0.5)
    # oversized: the server itself refuses it (stream max_msg_size = the codec's limit), so it
    # never reaches the registry
    with pytest.raises(nats.errors.Error):
        await bus.js.publish(subjects.trajectory(run, "r1"), b"x" * (2 * 1024 * 1024))

    letters = await dead_letters(bus, 7)
    reasons = sorted(letter.reason for letter in letters)
    assert reasons == sorted(["decode", "validation", "schema-version", "validation",
                              "validation", "decode", "validation"]), letters  # fmt: skip
    policy_errors = [x.error for x in letters if "not above the head" in x.error or "different content" in x.error]
    assert len(policy_errors) == 2, [x.error for x in letters]
    assert all(x.service == "registry" for x in letters)

    st = await status(bus, registry)
    assert st.ledger.head == 1 and st.ledger.versions[1].trainer_step == 1
    # still serving
    grant = await admit(bus, loaded=(1,))
    assert isinstance(grant, AdmissionGrant) and grant.version == 1
    assert registry.alive()


async def test_status_command_prints_the_ledger(bus, registry, run):
    await status(bus, registry)
    await bus.publish(subjects.adapter_ready(run, 0), ready(run, 0), msg_id="v0")
    await wait_status(bus, registry, lambda s: s.ledger.head == 0)
    grant = await admit(bus, replica="r7")
    # issue 17: grant ids are random tokens, not `<replica>-<n>`, and status never lists them
    assert isinstance(grant, AdmissionGrant) and len(grant.grant_id.partition(".")[2]) >= 24
    out = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "services.cli", "registry", "status", "--config", str(registry.config)],
        cwd=REPO, capture_output=True, text=True, timeout=60, env={**os.environ},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert f"run {run}: head v0" in out.stdout
    assert " r7 " in out.stdout and "running 1" in out.stdout
    assert grant.grant_id not in out.stdout


async def test_forged_versions_reports_and_trajectories_are_refused(bus, registry, run):
    """Issue 17, against the real registry process: a version of another trainer epoch, a jump
    to v1000000, a heartbeat naming another replica and a trajectory sent from another
    replica's subject are all refused with their reason; the real work goes on."""
    await status(bus, registry)
    await bus.publish(subjects.adapter_ready(run, 0), ready(run, 0), msg_id="v0")
    await wait_status(bus, registry, lambda s: s.ledger.head == 0)
    forged_epoch = msgspec.structs.replace(ready(run, 1), trainer_epoch="forger")
    await bus.publish(subjects.adapter_ready(run, 1), forged_epoch, msg_id="v1-forged")
    await bus.publish(subjects.adapter_ready(run, 1_000_000), ready(run, 1_000_000), msg_id="jump")
    # once refused at decode: a version past the proto's bound (v = 2**70 crashed the trainer)
    too_big = msgspec.json.encode({**msgspec.to_builtins(ready(run, 2)), "version": 2**70})
    await bus.js.publish(subjects.adapter_ready(run, 2), too_big)
    beat = m.ReplicaHeartbeat(run=run, replica="r2", engine="embedded", loaded_versions=[0], in_flight=0,
                              sent_at=time.time())  # fmt: skip
    await bus.publish(subjects.rollout_report(run, "r1", "heartbeat"), beat)
    # the real v1 still becomes the head after all that
    await bus.publish(subjects.adapter_ready(run, 1), ready(run, 1), msg_id="v1")
    await wait_status(bus, registry, lambda s: s.ledger.head == 1)

    decisions = Decisions()
    await bus.subscribe(subjects.decision(run, "r1"), TrajectoryDecision, decisions)
    grant = await admit(bus, replica="r1", loaded=(1,))
    assert isinstance(grant, AdmissionGrant)
    # r2's subject carrying r1's trajectory and grant: refused, and the grant stays r1's
    forged = trajectory(run, grant, "forged-1", replica="r1")
    await bus.publish(subjects.trajectory(run, "r2"), forged, msg_id="forged-1")
    guessed = msgspec.structs.replace(trajectory(run, grant, "guess-1"), grant_id=grant.grant_id.partition(".")[0])
    await bus.publish(subjects.trajectory(run, "r1"), guessed, msg_id="guess-1")
    real = trajectory(run, grant, "forged-1")  # same id as the forged copy, sent first
    await bus.publish(subjects.trajectory(run, "r1"), real, msg_id="real-1")
    got = await decisions.wait(3)
    verdicts = {(d.trajectory_id, d.verdict, d.reason.partition(":")[0]) for d in got}
    assert verdicts == {("forged-1", "rejected-invalid", "sender"), ("guess-1", "rejected-invalid", "unknown-grant"),
                        ("forged-1", "accepted", "")}, got  # fmt: skip

    letters = await dead_letters(bus, 4)
    errors = " | ".join(x.error for x in letters)
    for words in ("trainer_epoch", "jumps more than", "version", "sender"):
        assert words in errors, errors
    st = await status(bus, registry)
    assert st.ledger.head == 1 and st.ledger.epoch == "e0" and set(st.ledger.replicas) <= {"r1"}
    assert st.ledger.accepted == 1 and registry.alive()
