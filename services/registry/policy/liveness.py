"""Liveness: which grants belong to a replica that is gone, and freeing them.

A grant is freed when its lease passes (`expire`), when its replica has been silent for
`silent_after_s` (`release_silent`), or when the replica's process is replaced
(`heard_from`'s restart, `new_incarnation`). Invariant: liveness rests only on the registry's
own clock and on comparing one replica's values with its own earlier ones, never on a
replica's clock against the registry's; a freed grant's late trajectory is rejected-invalid.
"""

from __future__ import annotations

from services.registry.policy.config import PolicyConfig
from services.registry.policy.ledger import MAX_REPLICAS, Ledger, ReplicaState, drop_grant


def expire(ledger: Ledger, now: float) -> list[str]:
    """Free the grants whose lease has passed (the rollout is presumed dead); their late
    trajectories will be rejected-invalid. Returns the freed grant ids."""
    gone = [gid for gid, g in ledger.grants.items() if g.expires_at <= now]
    for gid in gone:
        drop_grant(ledger, gid)
    return gone


def heard_from(ledger: Ledger, replica: str, now: float, started_at: float | None = None) -> list[str]:
    """`replica` spoke at `now` (the registry's clock, so no liveness rests on a replica's
    clock). A replica beyond MAX_REPLICAS is not added (admission requests name any replica).

    `started_at` is the speaking process's start: later than the one the ledger knows means the
    replica restarted, and every grant it holds belongs to the dead process (a restart within
    `silent_after_s` would otherwise keep them until their leases pass, holding capacity that
    no one will use). Those grants are freed, as a lease expiry frees them (a late trajectory
    for one is rejected-invalid); returns their ids. An earlier start is an older process's
    late message and changes nothing. The value is only compared with the same replica's
    earlier ones, so a skewed clock on its host does not matter."""
    if replica not in ledger.replicas and len(ledger.replicas) >= MAX_REPLICAS:
        return []
    state = ledger.replicas.setdefault(replica, ReplicaState())
    state.heard_at = max(state.heard_at, now)
    if started_at is None or started_at <= state.started_at:
        return []
    before, state.started_at = state.started_at, started_at
    if not before:  # the first process this ledger hears of
        return []
    gone = [gid for gid, g in ledger.grants.items() if g.replica == replica]
    for gid in gone:
        drop_grant(ledger, gid)
    return gone


REPLACED_KEPT = 8
"""incarnations of one replica remembered as replaced: a late heartbeat comes from the process
just before, so a few are plenty, and the list stays small in every snapshot"""


def new_incarnation(ledger: Ledger, replica: str, incarnation: str, started_at: float | None) -> None:
    """`replica`'s heartbeats now come from a process not heard of before: the one before it is
    gone (killed, crashed, restarted at once), so every grant not issued to the new process is
    freed now, as a lease expiry frees it (a late trajectory for one is rejected-invalid),
    instead of holding capacity until `silent_after_s` or the lease. A grant is the new
    process's when its admission request named the heartbeat's `started_at`; the clocks are
    never compared, so a process started on a host whose clock is behind is still new. A grant
    whose request named no start (an older sender) is kept while this is the first incarnation
    the ledger hears of, since it may be the new process's own."""
    state = ledger.replicas[replica]
    before = state.incarnation
    if before:
        state.replaced = [*state.replaced, before][-REPLACED_KEPT:]
    state.incarnation = incarnation
    for gid, g in list(ledger.grants.items()):
        if g.replica == replica and g.started_at != started_at and (before or g.started_at is not None):
            drop_grant(ledger, gid)


def silent_grants(ledger: Ledger, now: float, cfg: PolicyConfig) -> list[str]:
    """Grants held by replicas silent for `silent_after_s`: a stopped or dead replica. A grant
    counts as hearing from its replica, so one issued to a replica that never reported yet is
    not freed at once."""
    if cfg.silent_after_s is None:
        return []
    silent = []
    for gid, g in ledger.grants.items():
        state = ledger.replicas.get(g.replica)
        heard = max(g.issued_at, state.heard_at if state is not None else 0.0)
        if now - heard > cfg.silent_after_s:
            silent.append(gid)
    return silent


def expiry_due(ledger: Ledger, now: float, cfg: PolicyConfig) -> bool:
    """Whether `expire` or `release_silent` would free a grant now (most ticks they would not,
    and then there is nothing to journal)."""
    return any(g.expires_at <= now for g in ledger.grants.values()) or bool(silent_grants(ledger, now, cfg))


def release_silent(ledger: Ledger, now: float, cfg: PolicyConfig) -> list[str]:
    """Free the grants of silent replicas, as if their leases had passed (their late
    trajectories are rejected-invalid); returns the freed grant ids."""
    gone = silent_grants(ledger, now, cfg)
    for gid in gone:
        drop_grant(ledger, gid)
    return gone
