"""Decisions: accept or reject one finished trajectory, consuming its grant.

Staleness is checked twice, at admission and at decision time. AReaL checks only at admission
and lets the decoupled loss absorb whatever staleness accrues during generation. lorabus does
not stop the world for a version change, and a rollout may hold its grant for its whole lease
while the trainer publishes several versions, so a sample admitted at `H - v = k` can finish at
`H - v = k + 3`. The admission check bounds the *budget* (how much work is in flight); the
decision check bounds what the trainer actually receives, which is the guarantee the loss's
importance-weight cap is tuned for (`H - v <= k` for every accepted sample, always).

Duplicates (same trajectory_id) of a decision that used a grant get the first decision back
and never count twice. The memory of seen ids is bounded (`seen_limit`); beyond it, the grant
numbers decided trajectories used (`decided_grants`, a few ranges) recognise a duplicate for
the whole run: it is answered rejected-invalid ("duplicate") and counted nowhere, and never
accepted twice. A rejection that touched no grant (another run, another sender, an unknown
grant) is not remembered, so a forged copy sent first cannot become the answer for the real
trajectory.
"""

from __future__ import annotations

import math

from msgspec import Struct

from proto.messages import Trajectory, TrajectoryDecision, Verdict
from services.common import ranges
from services.registry import identity
from services.registry.policy.config import PolicyConfig
from services.registry.policy.ledger import Ledger, SeenDecision, code_of, drop_grant

# Reason codes (the part of a reason before ": "); metrics are labelled with these.
REJECT_STALE = "stale"
REJECT_UNKNOWN_GRANT = "unknown-grant"
REJECT_LEASE_EXPIRED = "lease-expired"
REJECT_REPLICA_MISMATCH = "replica-mismatch"
REJECT_OLDER_THAN_GRANT = "older-than-grant"
REJECT_NEWER_THAN_HEAD = "newer-than-head"
REJECT_BAD_VALUES = "bad-values"
REJECT_WRONG_RUN = "wrong-run"
REJECT_SENDER = "sender"
REJECT_DUPLICATE = "duplicate"


def _grant_number(ledger: Ledger, grant_id: str, replica: str) -> int | None:
    """The issue number of a grant this ledger issued to `replica` (`<replica>-<n>[.<token>]`),
    else None."""
    prefix, _, n = grant_id.partition(".")[0].rpartition("-")
    if prefix != replica or not n.isdigit():
        return None
    number = int(n)
    return number if number < ledger.next_grant else None


def duplicate_of_decided(ledger: Ledger, t: DecisionInput, now: float) -> TrajectoryDecision | None:
    """A trajectory whose grant an earlier, already decided trajectory used (a redelivery older
    than the `seen` window): rejected-invalid, and counted nowhere, since its first decision was
    counted. Exact for the whole run, in memory proportional to the grants never used."""
    n = _grant_number(ledger, t.grant_id, t.replica)
    if t.grant_id in ledger.grants or n is None or not ranges.contains(ledger.decided_grants, n):
        return None
    return TrajectoryDecision(
        run=ledger.run,
        trajectory_id=t.trajectory_id,
        grant_id=t.grant_id,
        replica=t.replica,
        verdict="rejected-invalid",
        reason=f"{REJECT_DUPLICATE}: grant {t.grant_id!r} was used by a trajectory decided earlier; "
        "that first decision stands and is the one counted",
        head_version=ledger.head if ledger.head is not None else 0,
        oldest_version=t.oldest,
        decided_at=now,
    )


def _mark_decided(ledger: Ledger, t: DecisionInput) -> None:
    n = _grant_number(ledger, t.grant_id, t.replica)
    if n is not None and t.grant_id not in ledger.grants:  # used now, or expired before it came
        ranges.add(ledger.decided_grants, n)


# --- decisions -------------------------------------------------------------------------------


def seen_decision(ledger: Ledger, trajectory_id: str) -> TrajectoryDecision | None:
    """The first decision about `trajectory_id`, if it is still remembered."""
    s = ledger.seen.get(trajectory_id)
    return None if s is None else _as_decision(ledger.run, trajectory_id, s)


def _as_decision(run: str, trajectory_id: str, s: SeenDecision) -> TrajectoryDecision:
    return TrajectoryDecision(
        run=run,
        trajectory_id=trajectory_id,
        grant_id=s.grant_id,
        replica=s.replica,
        verdict=s.verdict,
        reason=s.reason,
        head_version=s.head_version,
        oldest_version=s.oldest_version,
        decided_at=s.decided_at,
    )


def bad_values(t: Trajectory) -> str | None:
    """Checks the wire schema cannot express (the lengths are checked at decode)."""
    if t.finished_at < t.started_at:
        return f"finished_at: {t.finished_at} is before started_at {t.started_at}"
    for i, c in enumerate(t.completions):
        if not math.isfinite(c.reward):
            return f"completions[{i}].reward: {c.reward} is not finite"
        # C-speed screen first (a NaN or +inf anywhere makes the sum NaN or +inf, a positive
        # value makes the max positive); the per-token loop only runs to name the culprit
        if c.logprobs and (max(c.logprobs) > 0.0 or not sum(c.logprobs) <= 0.0):
            for j, lp in enumerate(c.logprobs):
                if not (lp <= 0.0):  # also catches NaN
                    return f"completions[{i}].logprobs[{j}]: {lp} is not a log-probability (must be <= 0 and not NaN)"
    return None


class DecisionInput(Struct, array_like=True, frozen=True):
    """Everything `decide` needs from a trajectory: a few ids and versions instead of the
    token lists, so the service can journal it (and replay it after a crash) cheaply."""

    run: str
    trajectory_id: str
    grant_id: str
    replica: str
    oldest: int
    newest: int
    bad_values: str | None = None
    sender: str | None = None
    """the replica whose subject the trajectory arrived on (who sent it); None in entries
    journaled before the check"""
    claims: identity.Claims | None = None
    """the (version, adapter sha256) pairs its token ranges name (`identity.claims`)"""


def decision_input(trajectory: Trajectory, sender: str | None = None) -> DecisionInput:
    return DecisionInput(
        trajectory.run,
        trajectory.trajectory_id,
        trajectory.grant_id,
        trajectory.replica,
        trajectory.oldest_version(),
        max(max(c.versions) for c in trajectory.completions if c.versions),
        bad_values(trajectory),
        sender,
        identity.claims(trajectory),
    )


def decide(
    ledger: Ledger, trajectory: Trajectory, now: float, cfg: PolicyConfig, sender: str | None = None
) -> TrajectoryDecision:
    """Accept or reject one finished trajectory, consuming its grant.

    Invalid: another run, sent from another replica's subject, unknown or expired grant, a
    replica using another's grant, tokens older than the granted version or newer than the
    head, values no sampler produces.
    Stale: `H - oldest_version > k`. A duplicate trajectory_id gets its first decision.
    """
    first = seen_decision(ledger, trajectory.trajectory_id)
    if first is not None:
        return first
    return decide_input(ledger, decision_input(trajectory, sender), now, cfg)


def decide_input(ledger: Ledger, t: DecisionInput, now: float, cfg: PolicyConfig) -> TrajectoryDecision:
    """`decide` on the extracted `DecisionInput` (same rules, same result)."""
    first = seen_decision(ledger, t.trajectory_id)
    if first is not None:
        return first
    if (again := duplicate_of_decided(ledger, t, now)) is not None:
        return again
    head = ledger.head if ledger.head is not None else 0
    oldest, newest = t.oldest, t.newest
    grant = ledger.grants.get(t.grant_id)
    k = cfg.max_head_offpolicyness
    consume = True
    if t.run != ledger.run:
        reason = f"{REJECT_WRONG_RUN}: trajectory is for run {t.run!r}"
        consume = False
    elif t.sender is not None and t.sender != t.replica:
        reason = f"{REJECT_SENDER}: trajectory names replica {t.replica!r} but was sent by {t.sender!r}"
        consume = False
    elif grant is None:
        reason = (
            f"{REJECT_UNKNOWN_GRANT}: grant {t.grant_id!r} was never issued, was already used, or its lease expired"
        )
        consume = False
    elif grant.replica != t.replica:
        reason = (
            f"{REJECT_REPLICA_MISMATCH}: grant {t.grant_id!r} belongs to replica {grant.replica!r}, not {t.replica!r}"
        )
        consume = False
    elif grant.expires_at <= now:
        reason = f"{REJECT_LEASE_EXPIRED}: grant {t.grant_id!r} expired at {grant.expires_at}"
    elif oldest < grant.version:
        reason = f"{REJECT_OLDER_THAN_GRANT}: tokens from v{oldest}, but the grant was for v{grant.version}"
    elif newest > head:
        reason = f"{REJECT_NEWER_THAN_HEAD}: tokens from v{newest}, but the head is v{head}"
    elif t.bad_values is not None:
        reason = f"{REJECT_BAD_VALUES}: {t.bad_values}"
    elif head - oldest > k:
        reason = f"{REJECT_STALE}: head v{head} - oldest v{oldest} = {head - oldest} > k = {k}"
    elif (mismatch := identity.problem(t.claims, ledger.versions)) is not None:
        reason = mismatch
    else:
        reason = ""
    if consume:
        drop_grant(ledger, t.grant_id)
    if t.run == ledger.run and t.sender in (None, t.replica) and (grant is None or consume):
        _mark_decided(ledger, t)
    if not reason:
        verdict: Verdict = "accepted"
        ledger.accepted += 1
    else:
        code = code_of(reason)
        verdict = "rejected-stale" if code == REJECT_STALE else "rejected-invalid"
        ledger.rejected[code] = ledger.rejected.get(code, 0) + 1
    decided = SeenDecision(verdict, reason, t.grant_id, t.replica, head, oldest, now)
    if consume:
        # A rejection that touched no grant is not remembered: deciding a copy again gives the
        # same answer, and a forged copy sent first must not become the real trajectory's.
        ledger.seen[t.trajectory_id] = decided
        while len(ledger.seen) > cfg.seen_limit:
            del ledger.seen[next(iter(ledger.seen))]
    return _as_decision(ledger.run, t.trajectory_id, decided)
