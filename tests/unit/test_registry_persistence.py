"""The journal's contract, without a server: a ledger rebuilt from a snapshot plus the encoded
entries after it equals the live ledger, for random interleavings of every kind of input."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proto.messages import (
    AdapterLoaded,
    AdapterReady,
    AdmissionGrant,
    AdmissionRequest,
    Completion,
    ExportDone,
    LoraSpec,
    ObjectPayload,
    ReplicaHeartbeat,
    Trajectory,
)
from services.registry import persistence as j
from services.registry import policy as p

RUN = "run1"
LORA = LoraSpec(rank=4, alpha=8.0, target_modules=["q_proj"], base_model="tiny")
CFG = p.PolicyConfig(
    max_head_offpolicyness=1, consumer_batch_size=2, max_concurrent_rollouts=4,
    lease_seconds=5.0, seen_limit=6,
)  # fmt: skip


def ready(version: int) -> AdapterReady:
    return AdapterReady(
        run=RUN, trainer_epoch="e0", lora_name="lora", version=version, trainer_step=version,
        created_at=1000.0 + version, lora=LORA,
        payloads=[ObjectPayload(uri=f"file:///s/v{version}", bytes=1, sha256="0" * 64)],
    )  # fmt: skip


def trajectory(tid: str, grant_id: str, replica: str, versions: list[int], logprob: float) -> Trajectory:
    return Trajectory(
        run=RUN, trajectory_id=tid, grant_id=grant_id, replica=replica, prompt_id="p",
        prompt_token_ids=[1], started_at=1.0, finished_at=2.0,
        completions=[Completion(token_ids=[3] * len(versions), logprobs=[logprob] * len(versions),
                                versions=versions, reward=1.0)],
    )  # fmt: skip


def test_decide_input_matches_decide_on_the_trajectory():
    live, twin = p.new_ledger(RUN), p.new_ledger(RUN)
    for ledger in (live, twin):
        p.on_adapter_ready(ledger, ready(0), CFG)
    req = AdmissionRequest(run=RUN, replica="r1", request_id="q", loaded_versions=[0])
    g = p.admit(live, req, 1.0, CFG)
    assert p.admit(twin, req, 1.0, CFG) == g and isinstance(g, AdmissionGrant)
    t = trajectory("t", g.grant_id, "r1", [0, 0], logprob=float("nan"))
    op = j.DecideOp(p.decision_input(t), 2.0)
    replayed = j.decode_entry(j.encode_entry([op])).ops[0]
    assert p.decide(live, t, 2.0, CFG) == j.apply(twin, replayed, CFG)
    assert live.rejected == {"bad-values": 1} and live == twin


def test_stored_snapshot_of_another_format_names_the_fix():
    with pytest.raises(ValueError, match="delete the run's ledger bucket"):
        j.decode_snapshot(msgspec.json.encode(p.new_ledger(RUN)))


replicas = st.sampled_from(["r1", "r2"])
op_kinds = st.one_of(
    st.tuples(st.just("publish")),
    st.tuples(st.just("publish")),
    st.tuples(st.just("load"), replicas, st.integers(0, 4)),
    st.tuples(st.just("heartbeat"), replicas, st.lists(st.integers(0, 4), max_size=3)),
    st.tuples(st.just("admit"), replicas, st.integers(0, 5), st.lists(st.integers(0, 3), max_size=2)),
    st.tuples(st.just("finish"), st.integers(0, 30), st.integers(0, 2), st.booleans(), replicas),
    st.tuples(st.just("duplicate"), st.integers(0, 30)),
    st.tuples(st.just("expire")),
    st.tuples(st.just("export"), st.integers(0, 4)),
    st.tuples(st.just("tick"), st.floats(0.1, 4.0)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(op_kinds, max_size=60), st.integers(0, 60), st.integers(1, 7))
def test_snapshot_plus_replayed_entries_rebuild_the_live_ledger(script, cut, entry_size):
    """The live path applies ops in entries of `entry_size`; a snapshot is taken after `cut`
    ops (at an entry boundary, as the writer does); replaying the encoded entries after it,
    through the same `apply`, must give the identical ledger."""
    live = p.new_ledger(RUN)
    now, head, grants, tids = 1.0, -1, [], []
    ops: list[j.Op] = []
    for kind, *args in script:
        if kind == "publish":
            head += 1
            op = j.AdapterOp(p.adapter_facts(ready(head)))
        elif kind == "load":
            op = j.ReportOp(AdapterLoaded(run=RUN, replica=args[0], version=args[1], via="object",
                                          load_seconds=0.1, loaded_at=now))  # fmt: skip
        elif kind == "heartbeat":
            op = j.ReportOp(ReplicaHeartbeat(run=RUN, replica=args[0], engine="embedded",
                                             loaded_versions=args[1], in_flight=0, sent_at=now))  # fmt: skip
        elif kind == "admit":
            replica, rid, lags = args  # loaded versions as lags behind the head
            loaded = [head - lag for lag in lags if head - lag >= 0]
            op = j.AdmitOp(AdmissionRequest(run=RUN, replica=replica, request_id=f"q{rid}",
                                            loaded_versions=loaded), now, f"token-{len(ops)}")  # fmt: skip
        elif kind == "finish":
            which, lag, bad, replica = args
            if not grants:
                continue
            g = grants[which % len(grants)]
            v = max(0, g.version - lag) if lag else g.version
            tid = f"t{len(tids)}"
            tids.append(tid)
            t = trajectory(tid, g.grant_id, replica, [v, g.version], -1.0 if not bad else 0.5)
            op = j.DecideOp(p.decision_input(t, sender=replica), now)
        elif kind == "duplicate":
            if not tids:
                continue
            tid = tids[args[0] % len(tids)]
            op = j.DecideOp(p.DecisionInput(RUN, tid, "gone", "r1", 0, 0), now)
        elif kind == "expire":
            op = j.ExpireOp(now)
        elif kind == "export":
            op = j.ExportOp(ExportDone(run=RUN, lora_name="lora", version=args[0], uri="file:///e",
                                       files=["a"], bytes=1, sha256="0" * 64, exported_at=now))  # fmt: skip
        else:
            now += args[0]
            continue
        result = j.apply(live, op, CFG)
        if isinstance(result, AdmissionGrant):
            grants.append(result)
        ops.append(op)
    entries = [ops[i : i + entry_size] for i in range(0, len(ops), entry_size)]
    n_before = min(len(entries), cut // entry_size)
    rebuilt = p.new_ledger(RUN)
    for entry in entries[:n_before]:
        for op in entry:
            j.apply(rebuilt, op, CFG)
    stored = j.encode_snapshot(j.Snapshot(ledger=rebuilt, cfg=CFG, revision=n_before))
    snap = j.decode_snapshot(stored)
    for entry in entries[n_before:]:
        for piece in j.encode_entries(entry, limit=400):  # small pieces: entries split too
            for op in j.decode_entry(piece).ops:
                j.apply(snap.ledger, op, snap.cfg)
    assert snap.ledger == live


def test_entries_are_cut_into_pieces_under_the_limit_in_order():
    ops = [j.ExpireOp(float(i)) for i in range(1000)]
    pieces = j.encode_entries(ops, limit=300)
    assert len(pieces) > 1 and all(len(piece) <= 300 for piece in pieces)
    assert [op for piece in pieces for op in j.decode_entry(piece).ops] == ops
    with pytest.raises(ValueError, match="over 100"):
        j.encode_entries([j.AdmitOp(AdmissionRequest(run=RUN, replica="r", request_id="x" * 120), 1.0)], limit=100)
