"""The registry's pure policy: every branch by example, then the invariants under random
interleavings of publishes, reports, admissions, finishes, lease expiries and duplicates."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from proto.messages import (
    AdapterFailed,
    AdapterLoaded,
    AdapterReady,
    AdapterUnloaded,
    AdmissionDeny,
    AdmissionGrant,
    AdmissionRequest,
    Completion,
    ExportDone,
    LoraSpec,
    ObjectPayload,
    ReplicaHeartbeat,
    Trajectory,
)
from services.registry import policy as p

RUN = "run1"
LORA = LoraSpec(rank=4, alpha=8.0, target_modules=["q_proj"], base_model="tiny")


def cfg(k=1, b=2, max_concurrent=4, lease=10.0, seen_limit=1024) -> p.PolicyConfig:
    return p.PolicyConfig(
        max_head_offpolicyness=k,
        consumer_batch_size=b,
        max_concurrent_rollouts=max_concurrent,
        lease_seconds=lease,
        seen_limit=seen_limit,
    )


def ready(version: int, run: str = RUN, step: int | None = None) -> AdapterReady:
    return AdapterReady(
        run=run,
        trainer_epoch="e0",
        lora_name="lora",
        version=version,
        trainer_step=version if step is None else step,
        created_at=1000.0 + version,
        lora=LORA,
        payloads=[ObjectPayload(uri=f"file:///s/v{version}", bytes=1, sha256="0" * 64)],
    )


def request(replica="r1", rid="q1", loaded=(0,), run=RUN) -> AdmissionRequest:
    return AdmissionRequest(run=run, replica=replica, request_id=rid, loaded_versions=list(loaded))


def traj(grant: str, versions, tid="t1", replica="r1", run=RUN, logprob=-0.5, **kw) -> Trajectory:
    versions = list(versions)
    fields = dict(
        run=run,
        trajectory_id=tid,
        grant_id=grant,
        replica=replica,
        prompt_id="p",
        prompt_token_ids=[1, 2],
        completions=[
            Completion(
                token_ids=[5] * len(versions),
                logprobs=[logprob] * len(versions),
                versions=versions,
                reward=1.0,
            )
        ],
        started_at=1.0,
        finished_at=2.0,
    )
    fields.update(kw)
    return Trajectory(**fields)


def published(*versions: int, c=None) -> p.Ledger:
    c = c or cfg()
    ledger = p.new_ledger(RUN)
    for v in versions:
        assert p.on_adapter_ready(ledger, ready(v), c) == p.Applied(True)
    return ledger


def granted(ledger, c, **kw) -> AdmissionGrant:
    g = p.admit(ledger, request(**kw), 0.0, c)
    assert isinstance(g, AdmissionGrant), g
    return g


# --- config ------------------------------------------------------------------------------------


def test_config_names_the_bad_field():
    with pytest.raises(ValueError, match="rollout.consumer_batch_size"):
        cfg(b=0)
    with pytest.raises(ValueError, match="rollout.lease_seconds"):
        cfg(lease=0)


# --- adapter versions --------------------------------------------------------------------------


def test_versions_must_increase_and_identical_replay_is_a_noop():
    c = cfg(k=1)
    ledger = published(0, 1, 3, c=c)
    assert ledger.head == 3
    assert p.on_adapter_ready(ledger, ready(3), c) == p.Applied(False)
    assert p.on_adapter_ready(ledger, ready(0), c) == p.Applied(False)  # old replay
    conflicting = p.on_adapter_ready(ledger, ready(3, step=99), c)
    assert not conflicting.changed and "different content" in conflicting.error
    regression = p.on_adapter_ready(ledger, ready(2), c)
    assert not regression.changed and "not above the head v3" in regression.error
    assert ledger.head == 3
    assert [v for v, r in ledger.versions.items() if r.retired] == [0, 1]
    wrong = p.on_adapter_ready(ledger, ready(4, run="other"), c)
    assert not wrong.changed and "run" in wrong.error


def test_reports_track_who_has_what_loaded():
    c = cfg()
    ledger = published(0, c=c)
    loaded = AdapterLoaded(run=RUN, replica="r1", version=0, via="object", load_seconds=0.1, loaded_at=5.0)
    assert p.on_report(ledger, loaded).changed
    assert ledger.versions[0].loaded_by == {"r1"}
    # a version loaded before its event reached the registry is filled in on arrival
    early = AdapterLoaded(run=RUN, replica="r2", version=1, via="object", load_seconds=0.1, loaded_at=6.0)
    p.on_report(ledger, early)
    p.on_adapter_ready(ledger, ready(1), c)
    assert ledger.versions[1].loaded_by == {"r2"}
    p.on_report(ledger, AdapterUnloaded(run=RUN, replica="r1", version=0, reason="keep", unloaded_at=7.0))
    assert ledger.versions[0].loaded_by == set()
    p.on_report(
        ledger,
        AdapterFailed(run=RUN, replica="r1", version=1, reason="x", attempt=1, will_retry=True, failed_at=8.0),
    )
    assert ledger.replicas["r1"].failures == 1
    beat = ReplicaHeartbeat(run=RUN, replica="r1", engine="embedded", loaded_versions=[0, 1], in_flight=0, sent_at=9.0)
    p.on_report(ledger, beat)
    assert ledger.replicas["r1"].loaded == {0, 1} and ledger.versions[1].loaded_by == {"r1", "r2"}
    stale_beat = ReplicaHeartbeat(
        run=RUN, replica="r1", engine="embedded", loaded_versions=[], in_flight=0, sent_at=1.0
    )
    assert p.on_report(ledger, stale_beat) == p.Applied(False)
    assert ledger.replicas["r1"].loaded == {0, 1}
    other = ReplicaHeartbeat(run="x", replica="r1", engine="embedded", loaded_versions=[], in_flight=0, sent_at=10.0)
    assert "run" in p.on_report(ledger, other).error


def test_export_marks_version():
    ledger = published(0)
    done = ExportDone(
        run=RUN, lora_name="lora", version=0, uri="file:///e/v0", files=[], bytes=1, sha256="0" * 64, exported_at=1.0
    )
    assert p.on_export_done(ledger, done).changed and ledger.versions[0].exported
    assert p.on_export_done(ledger, done) == p.Applied(False)
    unknown = ExportDone(
        run=RUN, lora_name="lora", version=7, uri="file:///e/v7", files=[], bytes=1, sha256="0" * 64, exported_at=1.0
    )
    assert "never published" in p.on_export_done(ledger, unknown).error


def test_ledger_round_trips_through_json():
    c = cfg()
    ledger = published(0, 1, c=c)
    g = granted(ledger, c, loaded=[1])
    p.decide(ledger, traj(g.grant_id, [1]), 1.0, c)
    assert p.decode_ledger(p.encode_ledger(ledger)) == ledger


# --- admission ---------------------------------------------------------------------------------


def test_no_adapter_denies():
    d = p.admit(p.new_ledger(RUN), request(), 0.0, cfg())
    assert isinstance(d, AdmissionDeny) and d.reason.startswith("no-adapter")
    assert d.retry_after_s > 0


def test_wrong_run_denies():
    d = p.admit(published(0), request(run="other"), 0.0, cfg())
    assert isinstance(d, AdmissionDeny) and d.reason.startswith("wrong-run")


def test_max_concurrent_then_staleness_capacity():
    # k=0, B=2, H=0: (0+0+1)*2 = 2 accepted-or-running at most.
    c = cfg(k=0, b=2, max_concurrent=2)
    ledger = published(0, c=c)
    g1 = granted(ledger, c, rid="a")
    g2 = granted(ledger, c, rid="b")
    d = p.admit(ledger, request(rid="c"), 0.0, c)
    assert isinstance(d, AdmissionDeny) and d.reason.startswith("max-concurrent"), d
    # finishing frees a concurrency slot but no staleness budget: accepted + running is unchanged
    assert p.decide(ledger, traj(g1.grant_id, [0], tid="1"), 1.0, c).verdict == "accepted"
    d = p.admit(ledger, request(rid="c"), 0.0, c)
    assert isinstance(d, AdmissionDeny) and d.reason.startswith("staleness"), d
    assert ledger.denied == {"max-concurrent": 1, "staleness": 1}
    assert p.decide(ledger, traj(g2.grant_id, [0], tid="2"), 1.0, c).verdict == "accepted"
    # a new version opens B more
    p.on_adapter_ready(ledger, ready(1), c)
    assert p.capacity(ledger, c) == 2
    granted(ledger, c, rid="c", loaded=[1])
    granted(ledger, c, rid="d", loaded=[1])
    assert p.capacity(ledger, c) == 0


def test_recovery_floor_caps_a_fresh_ledger_at_k_plus_one_batches():
    # A ledger that first hears of v5 (no history) must not open (k+5+1)*B slots.
    c = cfg(k=1, b=2, max_concurrent=100)
    ledger = published(5, c=c)
    assert p.capacity(ledger, c) == (1 + 1) * 2
    grants = [p.admit(ledger, request(rid=str(i), loaded=[5]), 0.0, c) for i in range(5)]
    assert [isinstance(g, AdmissionGrant) for g in grants] == [True] * 4 + [False]


def test_version_choice_head_or_newest_admissible_loaded():
    c = cfg(k=2, b=4, max_concurrent=10)
    ledger = published(0, 1, 2, 3, c=c)
    assert granted(ledger, c, rid="a", loaded=[3, 2]).version == 3
    assert granted(ledger, c, rid="b", loaded=[1, 2]).version == 2
    assert granted(ledger, c, rid="c", loaded=[1]).version == 1  # H - v = 2 = k: admissible
    d = p.admit(ledger, request(rid="d", loaded=[0]), 0.0, c)  # H - v = 3 > k: never granted
    assert isinstance(d, AdmissionDeny) and d.reason.startswith("no-admissible-version-loaded")
    d = p.admit(ledger, request(rid="e", loaded=[7]), 0.0, c)  # unknown version
    assert isinstance(d, AdmissionDeny)
    # no loaded_versions in the request: fall back to what the reports said
    p.on_report(ledger, AdapterLoaded(run=RUN, replica="r9", version=3, via="object", load_seconds=0, loaded_at=1.0))
    assert granted(ledger, c, replica="r9", rid="f", loaded=[]).version == 3


def test_retried_request_gets_the_same_grant_until_it_expires():
    c = cfg(lease=10.0)
    ledger = published(0, c=c)
    g = granted(ledger, c, rid="same")
    again = p.admit(ledger, request(rid="same"), 5.0, c)
    assert again == g and ledger.running == 1
    later = p.admit(ledger, request(rid="same"), 11.0, c)
    assert isinstance(later, AdmissionGrant) and later.grant_id != g.grant_id
    assert ledger.running == 1


def test_expire_frees_capacity_and_late_trajectory_is_invalid():
    c = cfg(k=0, b=1, max_concurrent=1, lease=10.0)
    ledger = published(0, c=c)
    g = granted(ledger, c)
    assert isinstance(p.admit(ledger, request(rid="x"), 1.0, c), AdmissionDeny)
    assert p.expire(ledger, 9.0) == []
    assert p.expire(ledger, 10.0) == [g.grant_id]
    assert ledger.running == 0 and ledger.grant_by_request == {}
    d = p.decide(ledger, traj(g.grant_id, [0]), 11.0, c)
    assert d.verdict == "rejected-invalid" and d.reason.startswith("unknown-grant")
    assert isinstance(p.admit(ledger, request(rid="x"), 11.0, c), AdmissionGrant)


# --- decisions ---------------------------------------------------------------------------------


def test_accept_consumes_the_grant_and_counts_once():
    c = cfg()
    ledger = published(0, c=c)
    g = granted(ledger, c)
    d = p.decide(ledger, traj(g.grant_id, [0]), 1.0, c)
    assert (d.verdict, d.head_version, d.oldest_version, d.reason) == ("accepted", 0, 0, "")
    assert ledger.accepted == 1 and ledger.running == 0
    dup = p.decide(ledger, traj(g.grant_id, [0]), 2.0, c)
    assert dup == d and ledger.accepted == 1


def test_stale_at_decision_time():
    c = cfg(k=1, b=4, max_concurrent=8)
    ledger = published(0, c=c)
    g = granted(ledger, c)
    p.on_adapter_ready(ledger, ready(1), c)
    p.on_adapter_ready(ledger, ready(2), c)
    d = p.decide(ledger, traj(g.grant_id, [0, 1]), 1.0, c)
    assert d.verdict == "rejected-stale" and d.oldest_version == 0 and d.head_version == 2
    assert ledger.rejected == {"stale": 1} and ledger.running == 0 and ledger.accepted == 0


@pytest.mark.parametrize(
    "make, code, frees_grant",
    [
        (lambda g: traj(g, [0], run="other"), "wrong-run", False),
        (lambda g: traj("nope", [0]), "unknown-grant", False),
        (lambda g: traj(g, [0], replica="r2"), "replica-mismatch", False),
        (lambda g: traj(g, [0]), "lease-expired", True),
        (lambda g: traj(g, [1, 1]), "newer-than-head", True),
        (lambda g: traj(g, [0], logprob=0.5), "bad-values", True),
        (lambda g: traj(g, [0], logprob=float("nan")), "bad-values", True),
        (lambda g: traj(g, [0], started_at=5.0, finished_at=4.0), "bad-values", True),
    ],
)
def test_invalid_trajectories(make, code, frees_grant):
    c = cfg(lease=10.0)
    ledger = published(0, c=c)
    g = granted(ledger, c)
    now = 20.0 if code == "lease-expired" else 1.0
    d = p.decide(ledger, make(g.grant_id), now, c)
    assert d.verdict == "rejected-invalid" and d.reason.startswith(code + ":"), d.reason
    assert ledger.rejected == {code: 1} and ledger.accepted == 0
    assert (g.grant_id not in ledger.grants) == frees_grant


def test_older_than_grant_is_invalid_but_newer_than_grant_is_fine():
    c = cfg(k=2, b=4, max_concurrent=8)
    ledger = published(0, 1, c=c)
    g = granted(ledger, c, rid="a", loaded=[1])
    d = p.decide(ledger, traj(g.grant_id, [0, 1], tid="a"), 1.0, c)
    assert d.reason.startswith("older-than-grant")
    g = granted(ledger, c, rid="b", loaded=[0])
    p.on_adapter_ready(ledger, ready(2), c)
    assert p.decide(ledger, traj(g.grant_id, [1, 2], tid="b"), 1.0, c).verdict == "accepted"


def test_seen_is_bounded_and_forgotten_duplicate_still_cannot_count_twice():
    c = cfg(k=0, b=10, max_concurrent=10, seen_limit=2)
    ledger = published(0, c=c)
    grants = [granted(ledger, c, rid=str(i)) for i in range(3)]
    for i, g in enumerate(grants):
        p.decide(ledger, traj(g.grant_id, [0], tid=f"t{i}"), 1.0, c)
    assert list(ledger.seen) == ["t1", "t2"] and ledger.accepted == 3
    again = p.decide(ledger, traj(grants[0].grant_id, [0], tid="t0"), 2.0, c)
    assert again.verdict == "rejected-invalid" and ledger.accepted == 3


# --- invariants under random interleavings ------------------------------------------------------

REPLICAS = ["r1", "r2", "r3"]


class RegistryMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.c = None
        self.ledger = None
        self.now = 0.0
        self.outstanding: dict[str, AdmissionGrant] = {}
        self.grant_replica: dict[str, str] = {}
        self.sent: list[Trajectory] = []
        self.first: dict[str, object] = {}
        self.accepted_ids: set[str] = set()
        self.n = 0

    @precondition(lambda self: self.ledger is None)
    @rule(
        k=st.integers(0, 3),
        b=st.integers(1, 4),
        max_concurrent=st.integers(1, 8),
        seen_limit=st.sampled_from([3, 1000]),
    )
    def setup(self, k, b, max_concurrent, seen_limit):
        self.c = cfg(k=k, b=b, max_concurrent=max_concurrent, lease=5.0, seen_limit=seen_limit)
        self.ledger = p.new_ledger(RUN)
        p.on_adapter_ready(self.ledger, ready(0), self.c)

    @precondition(lambda self: self.ledger is not None)
    @rule(skip=st.integers(1, 2))
    def publish(self, skip):
        assert p.on_adapter_ready(self.ledger, ready(self.ledger.head + skip), self.c).changed

    @precondition(lambda self: self.ledger is not None)
    @rule(back=st.integers(0, 3))
    def publish_regression(self, back):
        before = p.encode_ledger(self.ledger)
        v = max(0, self.ledger.head - back)
        result = p.on_adapter_ready(self.ledger, ready(v, step=10_000), self.c)
        assert not result.changed and result.error
        assert p.encode_ledger(self.ledger) == before

    @precondition(lambda self: self.ledger is not None)
    @rule(replica=st.sampled_from(REPLICAS), lag=st.integers(0, 5))
    def admit(self, replica, lag):
        self.n += 1
        head = self.ledger.head
        loaded = [max(0, head - lag)]
        running, accepted = self.ledger.running, self.ledger.accepted
        reply = p.admit(self.ledger, request(replica=replica, rid=f"q{self.n}", loaded=loaded), self.now, self.c)
        if isinstance(reply, AdmissionGrant):
            assert head - reply.version <= self.c.max_head_offpolicyness
            assert reply.version in loaded
            self.outstanding[reply.grant_id] = reply
            self.grant_replica[reply.grant_id] = replica
        else:
            assert self.ledger.running == running and self.ledger.accepted == accepted

    @precondition(lambda self: self.ledger is not None and self.outstanding)
    @rule(data=st.data(), newer=st.integers(0, 2), bad=st.booleans())
    def finish(self, data, newer, bad):
        gid = data.draw(st.sampled_from(sorted(self.outstanding)))
        grant = self.outstanding.pop(gid)
        version = min(grant.version + newer, self.ledger.head)
        self.n += 1
        t = traj(
            gid,
            [grant.version, version],
            tid=f"t{self.n}",
            replica=self.grant_replica[gid],
            logprob=0.1 if bad else -0.1,
        )
        self._send(t)

    @precondition(lambda self: self.ledger is not None)
    @rule()
    def finish_unknown_grant(self):
        self.n += 1
        self._send(traj(f"ghost-{self.n}", [self.ledger.head], tid=f"t{self.n}"))

    @precondition(lambda self: self.sent)
    @rule(data=st.data())
    def duplicate(self, data):
        self._send(data.draw(st.sampled_from(self.sent)))

    @precondition(lambda self: self.ledger is not None)
    @rule(dt=st.floats(0.0, 4.0))
    def tick_and_expire(self, dt):
        self.now += dt
        for gid in p.expire(self.ledger, self.now):
            self.outstanding.pop(gid, None)  # the rollout died

    def _send(self, t: Trajectory):
        head = self.ledger.head
        remembered = t.trajectory_id in self.ledger.seen
        accepted_before = self.ledger.accepted
        d = p.decide(self.ledger, t, self.now, self.c)
        if remembered:
            assert d == self.first[t.trajectory_id]
            assert self.ledger.accepted == accepted_before
        else:
            # first time, or forgotten (seen is bounded): what the ledger remembers from now on
            if t.trajectory_id not in self.first:
                self.sent.append(t)
            self.first[t.trajectory_id] = d
        if d.verdict == "accepted" and not remembered:
            assert t.trajectory_id not in self.accepted_ids, "accepted twice"
            assert head - t.oldest_version() <= self.c.max_head_offpolicyness
            assert d.head_version == head
            self.accepted_ids.add(t.trajectory_id)

    @invariant()
    def budgets_hold(self):
        if self.ledger is None:
            return
        c, led = self.c, self.ledger
        assert led.accepted + led.running <= (c.max_head_offpolicyness + led.head + 1) * c.consumer_batch_size
        assert led.running <= c.max_concurrent_rollouts
        assert led.accepted == len(self.accepted_ids)
        assert len(led.seen) <= c.seen_limit
        assert set(led.grant_by_request.values()) == set(led.grants)
        for g in led.grants.values():
            assert led.head - g.version <= c.max_head_offpolicyness or g.version in led.versions


TestRegistryMachine = RegistryMachine.TestCase
TestRegistryMachine.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@pytest.mark.parametrize(
    "logprobs,culprit",
    [
        ([-0.5] * 50 + [float("nan")] + [-0.5] * 5, "logprobs[50]: nan"),
        ([-0.5, float("-inf"), 0.0, float("inf")], "logprobs[3]: inf"),
        ([float("-inf"), float("inf"), -1.0], "logprobs[1]: inf"),
        ([-1.0] * 9 + [1e-9], "logprobs[9]: 1e-09"),
        ([float("-inf"), 0.0, -3.0], None),  # -inf and 0 are log-probabilities
    ],
)
def test_bad_values_names_the_first_bad_token_of_a_long_completion(logprobs, culprit):
    t = traj("g", [0] * len(logprobs))
    c = t.completions[0]
    t.completions[0] = Completion(token_ids=c.token_ids, logprobs=logprobs, versions=c.versions, reward=1.0)
    found = p.bad_values(t)
    assert (found is None) if culprit is None else (culprit in found)
