"""Liveness rules of the registry policy: a silent replica loses its grants within a few
heartbeat periods, and a duplicate is recognised for the whole run, beyond the `seen` window."""

from __future__ import annotations

import random

import msgspec

from proto.messages import AdapterFailed, AdmissionGrant, ReplicaHeartbeat
from services.common import ranges
from services.registry import persistence as j
from services.registry import policy as p
from tests.unit.test_registry_policy import RUN, ready, request, traj


def cfg(silent: float | None = 8.0, seen_limit: int = 1, max_concurrent: int = 8) -> p.PolicyConfig:
    return p.PolicyConfig(
        max_head_offpolicyness=0,
        consumer_batch_size=4,
        max_concurrent_rollouts=max_concurrent,
        lease_seconds=60.0,
        seen_limit=seen_limit,
        silent_after_s=silent,
    )


def heartbeat(replica: str, at: float) -> j.ReportOp:
    hb = ReplicaHeartbeat(run=RUN, replica=replica, engine="embedded", loaded_versions=[0], in_flight=1, sent_at=at)
    return j.ReportOp(hb, at)


def ledger_with_grants(c: p.PolicyConfig) -> p.Ledger:
    led = p.new_ledger(RUN)
    j.apply(led, j.AdapterOp(ready(0)), c)
    for i, replica in enumerate(["r1", "r1", "r2", "r2"]):
        grant = j.apply(led, j.AdmitOp(request(replica, f"q{i}"), 100.0), c)
        assert isinstance(grant, AdmissionGrant), grant
    return led


def test_a_replica_that_stops_heartbeating_loses_its_grants_the_others_keep_theirs() -> None:
    c = cfg()
    led = ledger_with_grants(c)
    for t in (102.0, 104.0, 106.0, 108.0, 110.0):
        j.apply(led, heartbeat("r2", t), c)  # r1 went silent at 100 (SIGSTOP)
    assert j.apply(led, j.ExpireOp(107.0), c) == []  # 7 s < 8 s: one late heartbeat is no death
    freed = j.apply(led, j.ExpireOp(108.5), c)
    assert sorted(freed) == ["r1-0", "r1-1"]
    assert sorted(led.grants) == ["r2-2", "r2-3"]
    assert p.capacity(led, c) == 2  # the freed budget is work for the live replica


def test_without_silent_after_s_only_the_lease_frees_grants() -> None:
    c = cfg(silent=None)
    led = ledger_with_grants(c)
    assert j.apply(led, j.ExpireOp(159.0), c) == []
    assert len(j.apply(led, j.ExpireOp(160.0), c)) == 4


def test_a_duplicate_older_than_the_seen_window_is_not_decided_or_counted_twice() -> None:
    c = cfg(seen_limit=1)
    led = ledger_with_grants(c)
    first = p.decide(led, traj("r1-0", [0], tid="a", replica="r1"), 101.0, c)
    assert first.verdict == "accepted"
    p.decide(led, traj("r2-2", [0], tid="b", replica="r2"), 101.0, c)  # pushes "a" out of `seen`
    assert "a" not in led.seen
    again = p.decide(led, traj("r1-0", [0], tid="a", replica="r1"), 102.0, c)
    assert again.verdict == "rejected-invalid" and again.reason.startswith(p.REJECT_DUPLICATE)
    assert led.accepted == 2 and led.rejected == {}


def test_a_late_trajectory_of_an_expired_grant_is_counted_once() -> None:
    c = cfg(silent=None, seen_limit=1)
    led = ledger_with_grants(c)
    j.apply(led, j.ExpireOp(160.0), c)
    late = traj("r1-1", [0], tid="late", replica="r1")
    assert p.decide(led, late, 161.0, c).reason.startswith(p.REJECT_UNKNOWN_GRANT)
    p.decide(led, traj("r2-2", [0], tid="x", replica="r2"), 161.0, c)
    assert p.decide(led, late, 162.0, c).reason.startswith(p.REJECT_DUPLICATE)
    assert led.rejected == {p.REJECT_UNKNOWN_GRANT: 2}  # "late" and "x" (its grant expired too)


def test_decided_grants_stay_a_few_ranges_when_grants_are_used_out_of_order() -> None:
    c = cfg(silent=None, seen_limit=1, max_concurrent=1000)
    led = p.new_ledger(RUN)
    j.apply(led, j.AdapterOp(ready(0)), c)
    c = p.PolicyConfig(**{**{f: getattr(c, f) for f in c.__struct_fields__}, "consumer_batch_size": 1000})
    grants = [j.apply(led, j.AdmitOp(request("r1", f"q{i}"), 1.0), c) for i in range(500)]
    rng = random.Random(0)
    order = list(range(500))
    rng.shuffle(order)
    lost = set(order[:5])  # their replica died: never decided
    for i in order[5:]:
        p.decide(led, traj(grants[i].grant_id, [0], tid=f"t{i}", replica="r1"), 2.0, c)
    assert len(led.decided_grants) <= len(lost) + 1
    for i in range(500):
        assert ranges.contains(led.decided_grants, i) == (i not in lost)


def started(replica: str, at: float, started_at: float) -> j.ReportOp:
    hb = ReplicaHeartbeat(
        run=RUN, replica=replica, engine="embedded", loaded_versions=[0], in_flight=0, sent_at=at, started_at=started_at
    )
    return j.ReportOp(hb, at)


def test_a_replica_restarted_within_the_silence_window_loses_its_old_grants_at_once() -> None:
    """r1 is killed and back within 8 s (silent_after_s): its first heartbeat names a later
    process start, so the dead process's grants are freed then, not after the 60 s lease; an
    older process's late heartbeat changes nothing; the journal replays to the same ledger."""
    c = cfg()
    led = p.new_ledger(RUN)
    ops: list[j.Op] = [j.AdapterOp(ready(0)), started("r1", 99.0, 50.0), started("r2", 99.0, 40.0)]
    for i, replica in enumerate(["r1", "r1", "r2"]):
        ops.append(j.AdmitOp(request(replica, f"q{i}"), 100.0))
    for op in ops:
        j.apply(led, op, c)
    assert sorted(led.grants) == ["r1-0", "r1-1", "r2-2"]
    assert j.apply(led, j.ExpireOp(103.0), c) == []  # 3 s: nothing is silent yet
    late = started("r1", 103.5, 50.0)  # the old process, same start: nothing changes
    j.apply(led, late, c)
    assert sorted(led.grants) == ["r1-0", "r1-1", "r2-2"]
    back = started("r1", 104.0, 103.8)  # restarted
    j.apply(led, back, c)
    assert sorted(led.grants) == ["r2-2"] and led.running == 1
    again = j.AdmitOp(request("r1", "q9"), 104.5)
    assert isinstance(j.apply(led, again, c), AdmissionGrant)
    stale = started("r1", 105.0, 50.0)  # the old process's heartbeat, reordered: ignored
    j.apply(led, stale, c)
    assert "r1-3" in led.grants
    # a late trajectory for a freed grant is rejected, as after a lease expiry
    decision = j.apply(led, j.DecideOp(p.decision_input(traj("r1-0", [0])), 106.0), c)
    assert decision.verdict == "rejected-invalid", decision
    # replay: the same inputs give the same ledger
    replayed = p.new_ledger(RUN)
    for op in [*ops, j.ExpireOp(103.0), late, back, again, stale]:
        j.apply(replayed, op, c)
    assert sorted(replayed.grants) == sorted(led.grants) == ["r1-3", "r2-2"]
    assert replayed.replicas["r1"].started_at == led.replicas["r1"].started_at == 103.8


def test_an_admission_request_from_a_restarted_process_frees_the_old_grants_too() -> None:
    c = cfg(silent=None)
    led = p.new_ledger(RUN)
    j.apply(led, j.AdapterOp(ready(0)), c)
    first = msgspec.structs.replace(request("r1", "a"), started_at=10.0)
    assert isinstance(j.apply(led, j.AdmitOp(first, 100.0), c), AdmissionGrant)
    second = msgspec.structs.replace(request("r1", "b"), started_at=20.0)
    grant = j.apply(led, j.AdmitOp(second, 101.0), c)
    assert isinstance(grant, AdmissionGrant)
    assert list(led.grants) == [grant.grant_id]  # only the new process's grant is held


def beat(replica: str, at: float, incarnation: str | None, started_at: float | None = None) -> j.ReportOp:
    hb = ReplicaHeartbeat(run=RUN, replica=replica, engine="embedded", loaded_versions=[0], in_flight=0, sent_at=at,
                          started_at=started_at, incarnation=incarnation)  # fmt: skip
    return j.ReportOp(hb, at)


def admit_from(replica: str, rid: str, started_at: float, at: float) -> j.AdmitOp:
    return j.AdmitOp(msgspec.structs.replace(request(replica, rid), started_at=started_at), at)


def test_a_new_incarnation_frees_its_old_selfs_grants_at_once_whatever_the_clocks_say() -> None:
    """Issue 30: r1 is killed and back within the silence window on a host whose clock is 40 s
    behind (its start is *earlier* than the dead process's, which the start-time rule alone
    reads as a late message of an old process). Its new incarnation frees the dead process's
    grants at its first heartbeat, not after the 60 s lease; the grant the new process got
    before that heartbeat was processed stays; the dead process's late heartbeat changes
    neither grants nor the loaded set; r2 keeps its grant; the journal replays the same."""
    c = cfg()
    ops: list[j.Op] = [
        j.AdapterOp(ready(0)),
        beat("r1", 99.0, "old-self-aaaa", started_at=50.0),
        beat("r2", 99.0, "r2-self-bbbb", started_at=40.0),
        admit_from("r1", "q0", 50.0, 100.0),
        admit_from("r1", "q1", 50.0, 100.0),
        admit_from("r2", "q2", 40.0, 100.0),
        admit_from("r1", "q3", 10.0, 102.0),  # the new process asks before its first heartbeat lands
    ]
    led = p.new_ledger(RUN)
    for op in ops:
        j.apply(led, op, c)
    assert sorted(led.grants) == ["r1-0", "r1-1", "r1-3", "r2-2"]  # 10 < 50: the start rule freed nothing
    back = beat("r1", 103.0, "new-self-cccc", started_at=10.0)
    j.apply(led, back, c)
    assert sorted(led.grants) == ["r1-3", "r2-2"]  # at once: 3 s after the kill, silence is 8 s
    assert led.replicas["r1"].incarnation == "new-self-cccc"
    assert led.replicas["r1"].replaced == ["old-self-aaaa"]
    late = beat("r1", 104.0, "old-self-aaaa", started_at=50.0)
    late.report.loaded_versions.clear()
    assert j.apply(led, late, c) == p.Applied(False)  # changes nothing, so nothing to persist
    assert sorted(led.grants) == ["r1-3", "r2-2"] and led.replicas["r1"].loaded == {0}
    assert led.replicas["r1"].incarnation == "new-self-cccc"
    # the freed grants' late trajectories are rejected, as after a lease expiry
    decision = j.apply(led, j.DecideOp(p.decision_input(traj("r1-0", [0])), 105.0), c)
    assert decision.verdict == "rejected-invalid", decision
    again = j.apply(led, j.DecideOp(p.decision_input(traj("r1-3", [0], tid="t2")), 105.0), c)
    assert again.verdict == "accepted", again
    replayed = p.new_ledger(RUN)
    for op in [*ops, back, late]:
        j.apply(replayed, op, c)
    assert sorted(replayed.grants) == ["r1-3", "r2-2"]
    assert replayed.replicas["r1"] == msgspec.structs.replace(
        led.replicas["r1"], heard_at=replayed.replicas["r1"].heard_at
    )


def test_the_same_incarnation_and_heartbeats_without_one_free_nothing() -> None:
    c = cfg()
    led = p.new_ledger(RUN)
    for op in [j.AdapterOp(ready(0)), beat("r1", 99.0, "self-aaaa", 50.0), admit_from("r1", "q0", 50.0, 100.0)]:
        j.apply(led, op, c)
    for op in [beat("r1", 101.0, "self-aaaa", 50.0), beat("r1", 102.0, None, 50.0), beat("r1", 103.0, None)]:
        j.apply(led, op, c)
    assert list(led.grants) == ["r1-0"] and led.replicas["r1"].incarnation == "self-aaaa"


def test_the_first_incarnation_heard_of_keeps_grants_that_named_no_start() -> None:
    """A ledger that hears of r1's first incarnation cannot tell whose an un-stamped grant is
    (an older sender's request), so it keeps it; a grant stamped with another start is another
    process's (here an older process's late request), and goes. The next incarnation keeps
    only its own."""
    c = cfg()
    led = p.new_ledger(RUN)
    j.apply(led, j.AdapterOp(ready(0)), c)
    j.apply(led, j.AdmitOp(request("r1", "q0"), 100.0), c)  # no start named
    j.apply(led, admit_from("r1", "q1", 20.0, 100.0), c)
    j.apply(led, admit_from("r1", "q2", 5.0, 100.5), c)  # an older process's late request
    assert sorted(led.grants) == ["r1-0", "r1-1", "r1-2"]
    j.apply(led, beat("r1", 101.0, "self-aaaa", started_at=20.0), c)
    assert sorted(led.grants) == ["r1-0", "r1-1"]
    j.apply(led, beat("r1", 103.0, "self-bbbb", started_at=15.0), c)  # restarted, its clock behind
    assert list(led.grants) == []


def test_a_replica_remembers_a_bounded_number_of_replaced_incarnations() -> None:
    c = cfg()
    led = p.new_ledger(RUN)
    for i in range(p.REPLACED_KEPT + 3):
        j.apply(led, beat("r1", 100.0 + i, f"self-{i:04d}", started_at=float(i)), c)
    state = led.replicas["r1"]
    assert state.incarnation == f"self-{p.REPLACED_KEPT + 2:04d}"
    assert state.replaced == [f"self-{i:04d}" for i in range(2, p.REPLACED_KEPT + 2)]


def test_capacity_follows_the_trainers_steps_when_a_restart_skipped_a_version() -> None:
    """A trainer killed after announcing v2 but before checkpointing it resumes from step 1 and
    announces v3: at k = 0 the budget is one batch past the 2 steps trained, as before the
    restart, not one past the version number (which kept a batch too many in flight, turned
    stale at every later version)."""
    c = cfg(silent=None)  # k = 0, B = 4
    led = p.new_ledger(RUN)
    for op in [j.AdapterOp(ready(0)), j.AdapterOp(ready(1)), j.AdapterOp(ready(2)), j.AdapterOp(ready(3, step=1))]:
        j.apply(led, op, c)
    led.accepted = 8
    assert led.head == 3 and p.capacity(led, c) == (0 + 1 + 1) * 4 - 8 == 0
    j.apply(led, j.AdapterOp(ready(4, step=2)), c)  # the redelivered batch trained again
    assert p.capacity(led, c) == (0 + 2 + 1) * 4 - 8 == 4


def failed(replica: str, version: int, will_retry: bool) -> j.ReportOp:
    report = AdapterFailed(run=RUN, replica=replica, version=version, reason="canary: gap 3.2 beyond 0.002", attempt=1,
                           will_retry=will_retry, failed_at=101.0)  # fmt: skip
    return j.ReportOp(report, 101.0)


def test_a_version_given_up_frees_that_replicas_grants_on_it_at_once() -> None:
    """Nothing a replica generated on a version it gave up is published (its canary failed, or
    never came): the grants it holds there are freed when it says so, not 60 s later at their
    leases' end; its grants on other versions, and the other replicas', stay."""
    c = p.PolicyConfig(max_head_offpolicyness=1, consumer_batch_size=4, max_concurrent_rollouts=8, lease_seconds=60.0)
    led = p.new_ledger(RUN)
    j.apply(led, j.AdapterOp(ready(0)), c)
    j.apply(led, j.AdapterOp(ready(1)), c)
    on = {}
    for rid, replica, loaded in (("a", "r1", (0,)), ("b", "r1", (1,)), ("c", "r1", (1,)), ("d", "r2", (1,))):
        grant = j.apply(led, j.AdmitOp(request(replica, rid, loaded=loaded), 100.0), c)
        assert isinstance(grant, AdmissionGrant), grant
        on[rid] = grant.grant_id
    j.apply(led, failed("r1", 1, will_retry=True), c)  # to be loaded again: its grants stay
    assert len(led.grants) == 4
    j.apply(led, failed("r1", 1, will_retry=False), c)
    assert sorted(led.grants) == sorted([on["a"], on["d"]])
    assert led.running == 2
