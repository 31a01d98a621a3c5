"""Announcements into the ledger: adapter versions (the trainer), loaded/unloaded/failed/heartbeat
reports (the replicas) and exports (the exporter).

Invariant: the head only rises, by bounded steps, within the run's trainer epoch (`lineage`);
an identical event replayed is a no-op and a conflicting one is refused, so a replay of the
journal and a redelivery by JetStream both leave the ledger as it was. A report changes only
what its replica holds (the versions it serves, the grants on a version it gave up), and only to
versions it may plausibly hold.
"""

from __future__ import annotations

import hashlib

import msgspec
from msgspec import Struct

from proto.messages import (
    MAX_VERSION_STEP,
    AdapterFailed,
    AdapterLoaded,
    AdapterReady,
    AdapterUnloaded,
    ExportDone,
    ReplicaHeartbeat,
    RolloutReport,
)
from services.common.lineage import lineage_problem  # pure: the one rule every receiver applies
from services.registry.policy.config import PolicyConfig
from services.registry.policy.ledger import (
    CHANGED,
    MAX_REPLICAS,
    UNCHANGED,
    VERSION_HISTORY,
    Applied,
    Ledger,
    ReplicaState,
    VersionRecord,
    drop_grant,
)
from services.registry.policy.liveness import new_incarnation


def event_digest(event: AdapterReady) -> str:
    return hashlib.sha256(msgspec.json.encode(event)).hexdigest()


class AdapterFacts(Struct, array_like=True, frozen=True):
    """What the ledger keeps of an AdapterReady (the journal stores this, not the event,
    whose XCCL manifest may be most of a message)."""

    run: str
    epoch: str
    version: int
    trainer_step: int
    created_at: float
    digest: str
    adapter_sha256: str | None = None


def adapter_facts(event: AdapterReady) -> AdapterFacts:
    obj = event.object_payload()
    return AdapterFacts(event.run, event.trainer_epoch, event.version, event.trainer_step, event.created_at,
                        event_digest(event), obj.sha256 if obj is not None else None)  # fmt: skip


def on_adapter_ready(ledger: Ledger, event: AdapterReady | AdapterFacts, cfg: PolicyConfig) -> Applied:
    """A new head. Versions must increase by bounded steps and come from the run's trainer
    epoch; replaying an identical event is a no-op, anything else at or below the head is
    refused (a regression would re-open the staleness window)."""
    facts = adapter_facts(event) if isinstance(event, AdapterReady) else event
    if facts.run != ledger.run:
        return Applied(False, f"run: event is for run {facts.run!r}, this ledger is {ledger.run!r}")
    problem = lineage_problem(ledger.epoch, ledger.head, facts.epoch, facts.version)
    if problem is not None:
        return Applied(False, problem)
    known = ledger.versions.get(facts.version)
    if known is not None:
        if known.digest == facts.digest:
            return UNCHANGED
        return Applied(
            False,
            f"version: v{facts.version} was already published with different content; "
            "a trainer must publish each version once (restart from its checkpoint at v"
            f"{ledger.head} + 1)",
        )
    if ledger.head is not None and facts.version <= ledger.head:
        return Applied(
            False,
            f"version: v{facts.version} is not above the head v{ledger.head}; versions only increase",
        )
    ledger.epoch = facts.epoch
    ledger.head = facts.version
    ledger.versions[facts.version] = VersionRecord(
        published_at=facts.created_at,
        trainer_step=facts.trainer_step,
        digest=facts.digest,
        adapter_sha256=facts.adapter_sha256,
        loaded_by={r for r, s in ledger.replicas.items() if facts.version in s.loaded},
    )
    k = cfg.max_head_offpolicyness
    for v, record in ledger.versions.items():
        record.retired = ledger.head - v > k
    _prune_versions(ledger, k)
    return CHANGED


def _prune_versions(ledger: Ledger, k: int) -> None:
    """Drop version records more than VERSION_HISTORY below the admissible window, and the
    replicas' memory of them."""
    assert ledger.head is not None
    floor = ledger.head - k - VERSION_HISTORY
    for v in [v for v in ledger.versions if v < floor]:
        del ledger.versions[v]
    for state in ledger.replicas.values():
        state.loaded = {v for v in state.loaded if v >= floor}


def _plausible(ledger: Ledger, versions: set[int]) -> set[int]:
    """The reported versions a replica may hold: not below the kept history, not beyond the
    next steps of the head (a report may precede the event it loaded)."""
    if ledger.head is None:
        return {v for v in versions if v <= MAX_VERSION_STEP}
    low, high = ledger.head - VERSION_HISTORY, ledger.head + MAX_VERSION_STEP
    return {v for v in versions if low <= v <= high}


def export_ahead(ledger: Ledger, event: ExportDone) -> bool:
    """An export of a version the ledger may not have seen yet (its adapter event is on another
    consumer, possibly behind): to be retried, not refused."""
    head = ledger.head if ledger.head is not None else -1
    return event.run == ledger.run and head < event.version <= head + MAX_VERSION_STEP


def on_export_done(ledger: Ledger, event: ExportDone) -> Applied:
    record = ledger.versions.get(event.version)
    if event.run != ledger.run:
        return Applied(False, f"run: export is for run {event.run!r}, this ledger is {ledger.run!r}")
    if record is None:
        return Applied(False, f"version: export of v{event.version}, which was never published")
    if record.exported:
        return UNCHANGED
    record.exported = True
    return CHANGED


def _set_loaded(ledger: Ledger, replica: str, loaded: set[int]) -> None:
    state = ledger.replicas.setdefault(replica, ReplicaState())
    for v in state.loaded - loaded:
        if v in ledger.versions:
            ledger.versions[v].loaded_by.discard(replica)
    for v in loaded - state.loaded:
        if v in ledger.versions:
            ledger.versions[v].loaded_by.add(replica)
    state.loaded = loaded


def on_report(ledger: Ledger, report: RolloutReport) -> Applied:
    """A rollout's loaded/unloaded/failed/heartbeat report: who holds which version."""
    if report.run != ledger.run:
        return Applied(False, f"run: report is for run {report.run!r}, this ledger is {ledger.run!r}")
    if report.replica not in ledger.replicas and len(ledger.replicas) >= MAX_REPLICAS:
        return Applied(
            False,
            f"replica: {report.replica!r} would be replica number {MAX_REPLICAS + 1}; the ledger "
            f"tracks at most {MAX_REPLICAS} (MAX_REPLICAS)",
        )
    state = ledger.replicas.setdefault(report.replica, ReplicaState())
    if isinstance(report, AdapterLoaded):
        _set_loaded(ledger, report.replica, state.loaded | _plausible(ledger, {report.version}))
        state.last_seen = max(state.last_seen, report.loaded_at)
    elif isinstance(report, AdapterUnloaded):
        _set_loaded(ledger, report.replica, state.loaded - {report.version})
        state.last_seen = max(state.last_seen, report.unloaded_at)
    elif isinstance(report, AdapterFailed):
        state.failures += 1
        state.last_seen = max(state.last_seen, report.failed_at)
        if not report.will_retry:
            # given up (a failed canary, or a load that never worked): nothing the replica
            # generated on the version is ever published (rollout.canary's invariant), so its
            # grants there are free now, not when their leases pass (a late trajectory for one
            # is rejected-invalid)
            for gid, g in list(ledger.grants.items()):
                if g.replica == report.replica and g.version == report.version:
                    drop_grant(ledger, gid)
    elif isinstance(report, ReplicaHeartbeat):
        if report.incarnation is not None and report.incarnation != state.incarnation:
            if report.incarnation in state.replaced:
                return UNCHANGED  # a dead process's late heartbeat
            new_incarnation(ledger, report.replica, report.incarnation, report.started_at)
            state.last_seen = report.sent_at  # its clock, not the dead process's, orders it now
        # A heartbeat is the replica's full truth; an older one (reordered) must not undo a
        # newer loaded/unloaded report.
        if report.sent_at < state.last_seen:
            return UNCHANGED
        _set_loaded(ledger, report.replica, _plausible(ledger, set(report.loaded_versions)))
        state.engine = report.engine
        state.last_seen = report.sent_at
    else:  # pragma: no cover - RolloutReport is a closed union
        raise TypeError(f"report: unexpected type {type(report).__name__}")
    return CHANGED
