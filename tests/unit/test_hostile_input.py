"""Issue 17 without servers: the wire contract and the registry's policy under hostile and
malformed input (the findings each test was written for are in its docstring).

The same findings against running services are in tests/integration (test_registry_service,
test_exporter_service, test_rollout_service, test_bus, test_store, test_trainer_publish), the
NATS rights in tests/deploy/test_nats_permissions.py, and the whole run under a fuzzer in
tests/e2e/test_fuzz.py.
"""

from __future__ import annotations

import msgspec
import pytest

from proto import codec
from proto import messages as m
from services.common.lineage import lineage_problem
from services.registry import policy as p
from services.registry.persistence import Snapshot, encode_snapshot
from services.registry.status import RegistryStatus

RUN = "run1"
LORA = m.LoraSpec(rank=4, alpha=8.0, target_modules=["q_proj"], base_model="tiny")
CFG = p.PolicyConfig(max_head_offpolicyness=2, consumer_batch_size=2, max_concurrent_rollouts=8, lease_seconds=60.0)


def ready(version: int, epoch: str = "e0", **kw) -> m.AdapterReady:
    return m.AdapterReady(
        run=RUN, trainer_epoch=epoch, lora_name="lora", version=version, trainer_step=version,
        created_at=1000.0 + version, lora=LORA,
        payloads=[m.ObjectPayload(uri=f"file:///s/v{version}", bytes=1, sha256="0" * 64)], **kw,
    )  # fmt: skip


def heartbeat(replica: str, versions: list[int], sent_at: float = 1.0) -> m.ReplicaHeartbeat:
    return m.ReplicaHeartbeat(run=RUN, replica=replica, engine="embedded", loaded_versions=versions, in_flight=0,
                              sent_at=sent_at)  # fmt: skip


# --- bounded messages --------------------------------------------------------------------------


def test_a_deeply_nested_document_is_undecodable_not_a_recursion_error():
    """A 2 KB document nested 1000 deep on an adapter subject made RecursionError escape
    `codec.decode`: the exporter exited and consumers died."""
    for depth in (1000, 100_000):
        nested = b'{"schema_version":"1.0","run":' + b"[" * depth + b"]" * depth + b"}"
        with pytest.raises(codec.DecodeError) as info:
            codec.decode(nested, m.AdapterReady)
        assert info.value.reason in ("decode", "validation")


def test_each_message_type_has_its_own_size_cap():
    """Two 800 KB heartbeats grew the ledger past a NATS message; ~1 MB admission requests
    made the registry a zombie: both are refused by size before they are parsed."""
    beat = codec.encode(heartbeat("r1", [0])).replace(
        b'"loaded_versions":[0]', b'"loaded_versions":[' + b"0," * 400_000 + b"0]"
    )
    with pytest.raises(codec.DecodeError) as info:
        codec.decode(beat, m.RolloutReport)
    assert info.value.reason == "too-large"
    request = m.AdmissionRequest(run=RUN, replica="r1", request_id="x")
    big = codec.encode(request).replace(b'"request_id":"x"', b'"request_id":"' + b"x" * 1_000_000 + b'"')
    with pytest.raises(codec.DecodeError, match="exceeds 8192"):
        codec.decode(big, m.AdmissionRequest)
    assert codec.max_bytes_of(m.RolloutReport) == 16 * 1024
    assert codec.max_bytes_of(m.Trajectory) == codec.MAX_MESSAGE_BYTES


def test_a_full_ledgers_status_is_under_its_cap():
    """The status reply carries the ledger: with the default 4 KiB cap, 64 replicas made
    `registry status` (and the registry benchmark) fail to decode the registry's answer."""
    ledger = p.new_ledger(RUN)
    for i in range(p.MAX_REPLICAS):
        p.heard_from(ledger, f"replica-{i:04d}", 1.0)
    status = RegistryStatus(
        run=RUN, ledger=ledger, seen_count=0, capacity=0, max_head_offpolicyness=2, consumer_batch_size=2,
        max_concurrent_rollouts=8, ledger_revision=1, sent_at=1.0,
    )  # fmt: skip
    assert codec.decode(codec.encode(status), RegistryStatus).ledger.replicas == ledger.replicas


@pytest.mark.parametrize(
    ("type_", "field", "value"),
    [
        (m.AdapterReady, "version", 2**70),  # crashed the trainer's collate
        (m.AdapterReady, "version", m.MAX_VERSION + 1),
        (m.ReplicaHeartbeat, "loaded_versions", list(range(m.MAX_LOADED + 1))),
        (m.AdmissionRequest, "loaded_versions", list(range(m.MAX_LOADED + 1))),
        (m.Trajectory, "grant_id", "g" * 129),
        (m.AdapterFailed, "reason", "r" * 2001),
    ],
)
def test_values_and_counts_beyond_their_bound_are_refused_at_decode(type_, field, value):
    examples = {
        m.AdapterReady: ready(1),
        m.ReplicaHeartbeat: heartbeat("r1", [0]),
        m.AdmissionRequest: m.AdmissionRequest(run=RUN, replica="r1", request_id="q"),
        m.Trajectory: m.Trajectory(
            run=RUN,
            trajectory_id="t",
            grant_id="g",
            replica="r1",
            prompt_id="p",
            prompt_token_ids=[1],
            completions=[m.Completion(token_ids=[1], logprobs=[-1.0], versions=[0], reward=0.0)],
            started_at=1.0,
            finished_at=2.0,
        ),  # fmt: skip
        m.AdapterFailed: m.AdapterFailed(
            run=RUN, replica="r1", version=0, reason="x", attempt=1, will_retry=False, failed_at=1.0
        ),  # fmt: skip
    }
    data = msgspec.to_builtins(examples[type_])
    data[field] = value
    with pytest.raises(codec.DecodeError) as info:
        codec.decode(msgspec.json.encode(data), type_)
    assert info.value.reason in ("validation", "too-large") and (
        field in str(info.value) or "exceeds" in str(info.value)
    )


# --- versions only from the trainer, by bounded steps ------------------------------------------


def test_lineage_refuses_another_epoch_and_a_jump():
    assert lineage_problem(None, None, "e0", 0) is None
    assert lineage_problem("e0", 5, "e0", 5 + m.MAX_VERSION_STEP) is None
    assert "trainer_epoch" in lineage_problem("e0", 5, "forger", 6)
    assert "jumps more than" in lineage_problem("e0", 5, "e0", 1_000_000)


def test_a_version_jump_does_not_move_the_head_and_the_run_goes_on():
    """One `adapter.v1000000.ready` (a valid message reusing the head's object) once became the
    head; the registry then dead-lettered every real version as "not above the head" and the
    staleness capacity became unbounded."""
    ledger = p.new_ledger(RUN)
    for v in range(3):
        assert p.on_adapter_ready(ledger, ready(v), CFG).changed
    jump = p.on_adapter_ready(ledger, ready(1_000_000), CFG)
    assert not jump.changed and "jumps more than" in jump.error
    assert ledger.head == 2 and p.capacity(ledger, CFG) <= (2 + 2 + 1) * 2
    assert p.on_adapter_ready(ledger, ready(3), CFG).changed and ledger.head == 3


def test_only_the_first_trainer_epoch_publishes_versions():
    ledger = p.new_ledger(RUN)
    p.on_adapter_ready(ledger, ready(0, epoch="trainer"), CFG)
    forged = p.on_adapter_ready(ledger, ready(1, epoch="forger"), CFG)
    assert not forged.changed and "trainer_epoch" in forged.error and ledger.head == 0
    assert p.on_adapter_ready(ledger, ready(1, epoch="trainer"), CFG).changed and ledger.epoch == "trainer"


# --- grants bound to their sender --------------------------------------------------------------


def _granted(ledger: p.Ledger, replica: str = "r1") -> m.AdmissionGrant:
    req = m.AdmissionRequest(run=RUN, replica=replica, request_id="q", loaded_versions=[ledger.head or 0])
    grant = p.admit(ledger, req, 1.0, CFG, token="Zq3-random_token")
    assert isinstance(grant, m.AdmissionGrant) and grant.grant_id == f"{replica}-0.Zq3-random_token"
    return grant


def _trajectory(grant: m.AdmissionGrant, replica: str, tid: str = "t1") -> m.Trajectory:
    return m.Trajectory(
        run=RUN, trajectory_id=tid, grant_id=grant.grant_id, replica=replica, prompt_id="p", prompt_token_ids=[1],
        completions=[m.Completion(token_ids=[1], logprobs=[-1.0], versions=[grant.version], reward=1.0)],
        started_at=1.0, finished_at=2.0,
    )  # fmt: skip


def test_a_trajectory_counts_only_from_its_own_replicas_subject():
    """40 of 40 forged groups were accepted (the registry checked the payload's replica field,
    not who sent it), and the real groups they displaced were rejected unknown-grant."""
    ledger = p.new_ledger(RUN)
    p.on_adapter_ready(ledger, ready(0), CFG)
    grant = _granted(ledger)
    forged = p.decide(ledger, _trajectory(grant, "r1"), 2.0, CFG, sender="intruder")
    assert forged.verdict == "rejected-invalid" and p.code_of(forged.reason) == "sender"
    # the forged copy used the real trajectory's id: it must not become its answer
    real = p.decide(ledger, _trajectory(grant, "r1"), 2.0, CFG, sender="r1")
    assert real.verdict == "accepted" and ledger.accepted == 1


# --- a bounded ledger ------------------------------------------------------------------------


def test_the_ledger_stays_bounded_however_long_the_run_and_however_many_strangers():
    ledger = p.new_ledger(RUN)
    for v in range(5000):
        p.on_adapter_ready(ledger, ready(v), CFG)
    for i in range(p.MAX_REPLICAS + 50):
        p.on_report(ledger, heartbeat(f"r{i}", list(range(4999 - m.MAX_LOADED + 1, 5000)) + [m.MAX_VERSION]))
    assert len(ledger.versions) <= CFG.max_head_offpolicyness + p.VERSION_HISTORY + 1
    assert len(ledger.replicas) == p.MAX_REPLICAS
    refused = p.on_report(ledger, heartbeat("one-more", [4999]))
    assert not refused.changed and "MAX_REPLICAS" in refused.error
    assert all(max(s.loaded) <= ledger.head + m.MAX_VERSION_STEP for s in ledger.replicas.values())
    size = len(encode_snapshot(Snapshot(ledger=ledger, cfg=CFG, revision=0)))
    assert size < 2 * 1024 * 1024, size  # bounded (and stored in pieces of 256 KiB anyway)
