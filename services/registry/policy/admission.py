"""Admission: whether a replica may start one more group now, and on which version.

Invariant (AReaL's staleness capacity, docs/design.md): a grant is issued only while fewer than
`max_concurrent_rollouts` are running and `accepted + running < (k + H + 1) * B`, and only for
an admissible version (`H - v <= k`) the replica has loaded. A retried request gets its live
grant back, so a lost reply never costs a second slot.
"""

from __future__ import annotations

from collections.abc import Collection

from proto.messages import AdmissionDeny, AdmissionGrant, AdmissionRequest
from services.registry.policy.config import PolicyConfig
from services.registry.policy.ledger import Grant, Ledger, code_of, drop_grant

# Reason codes (the part of a reason before ": "); metrics are labelled with these.
DENY_NO_ADAPTER = "no-adapter"
DENY_MAX_CONCURRENT = "max-concurrent"
DENY_STALENESS = "staleness"
DENY_NO_LOADED_VERSION = "no-admissible-version-loaded"
DENY_WRONG_RUN = "wrong-run"


def capacity(ledger: Ledger, cfg: PolicyConfig) -> int:
    """AReaL's staleness capacity, `min(max_concurrent - running, (k + H + 1) * B - (accepted
    + running))`. `accepted` is floored at `H * B`: the trainer consumes B accepted groups per
    version, so in normal operation the floor never binds, and for a ledger that joined a run
    late (no history) it is AReaL's recovery rule `accepted = v * B`.

    H counts the head's trainer steps, not its version number: a trainer restarted after
    announcing a version it had not checkpointed resumes past it, and a version-numbered H would
    then admit a batch more than the trainer consumes for the rest of the run (at k = 0 that
    batch turned stale at every version: 35 groups in a chaos run)."""
    if ledger.head is None:
        return 0
    record = ledger.versions.get(ledger.head)
    h = record.trainer_step if record is not None else ledger.head
    k, b = cfg.max_head_offpolicyness, cfg.consumer_batch_size
    counted = max(ledger.accepted, h * b)
    return min(
        cfg.max_concurrent_rollouts - ledger.running,
        (k + h + 1) * b - (counted + ledger.running),
    )


def choose_version(ledger: Ledger, request: AdmissionRequest, cfg: PolicyConfig) -> int | None:
    """The newest admissible version (`H - v <= k`) the replica has loaded.

    Head when it is loaded there; otherwise an older but still admissible version rather than
    a deny, because a replica that is still loading the head would otherwise sit idle for the
    load time while its older version could produce useful samples (the decision-time check
    still rejects them if they turn stale). The request's own `loaded_versions` is the fresher
    truth; the reports the registry has seen are the fallback for a request that lists none.
    """
    if ledger.head is None:
        return None
    loaded: Collection[int] = request.loaded_versions
    if not loaded:
        state = ledger.replicas.get(request.replica)
        loaded = state.loaded if state is not None else ()
    low = ledger.head - cfg.max_head_offpolicyness
    fit = [v for v in loaded if low <= v <= ledger.head and v in ledger.versions]
    return max(fit) if fit else None


def can_grant(ledger: Ledger, request: AdmissionRequest, cfg: PolicyConfig) -> bool:
    """Whether `admit` would issue `request` a new grant now: a version is out, a slot is free
    under both limits, and the replica holds an admissible version (the fleet asks this of
    every run before its fair share picks one)."""
    return (
        ledger.head is not None
        and ledger.running < cfg.max_concurrent_rollouts
        and capacity(ledger, cfg) > 0
        and choose_version(ledger, request, cfg) is not None
    )


def _deny(ledger: Ledger, request: AdmissionRequest, reason: str, retry: float) -> AdmissionDeny:
    code = code_of(reason)
    ledger.denied[code] = ledger.denied.get(code, 0) + 1
    return AdmissionDeny(request_id=request.request_id, reason=reason, retry_after_s=retry)


def admit(
    ledger: Ledger, request: AdmissionRequest, now: float, cfg: PolicyConfig, token: str = ""
) -> AdmissionGrant | AdmissionDeny:
    """Grant one group of work, or say why not and when to ask again. A retried request
    (same replica and request_id, grant still live) gets the same grant back.

    A new grant's id is `<replica>-<n>.<token>`: `n` its issue number, `token` drawn at random
    by the service (the policy has no randomness of its own, so that a replay reproduces it) and
    journaled; without one (a journal written before grant tokens) the id is `<replica>-<n>`."""
    if request.run != ledger.run:
        return _deny(
            ledger,
            request,
            f"{DENY_WRONG_RUN}: request is for run {request.run!r}, this registry serves {ledger.run!r}",
            cfg.retry_after_s,
        )
    key = f"{request.replica}/{request.request_id}"
    existing = ledger.grant_by_request.get(key)
    if existing is not None:
        grant = ledger.grants[existing]
        if grant.expires_at > now:
            return AdmissionGrant(
                request_id=request.request_id,
                grant_id=existing,
                version=grant.version,
                lease_expires_at=grant.expires_at,
            )
        drop_grant(ledger, existing)
    if ledger.head is None:
        return _deny(
            ledger,
            request,
            f"{DENY_NO_ADAPTER}: no adapter version has been published yet",
            cfg.retry_after_s,
        )
    k, b, h = cfg.max_head_offpolicyness, cfg.consumer_batch_size, ledger.head
    if ledger.running >= cfg.max_concurrent_rollouts:
        return _deny(
            ledger,
            request,
            f"{DENY_MAX_CONCURRENT}: {ledger.running} rollouts running, "
            f"max_concurrent_rollouts={cfg.max_concurrent_rollouts}",
            cfg.retry_after_s,
        )
    if capacity(ledger, cfg) <= 0:
        return _deny(
            ledger,
            request,
            f"{DENY_STALENESS}: accepted {ledger.accepted} + running {ledger.running} reached "
            f"(k + H + 1) * B = ({k} + {h} + 1) * {b}; waiting for the next version",
            cfg.retry_after_s,
        )
    version = choose_version(ledger, request, cfg)
    if version is None:
        return _deny(
            ledger,
            request,
            f"{DENY_NO_LOADED_VERSION}: replica {request.replica!r} has none of "
            f"v{max(0, h - k)}..v{h} loaded; load v{h} and list it in loaded_versions",
            cfg.retry_after_s,
        )
    grant_id = f"{request.replica}-{ledger.next_grant}" + (f".{token}" if token else "")
    ledger.next_grant += 1
    expires_at = now + cfg.lease_seconds
    ledger.grants[grant_id] = Grant(
        version=version,
        replica=request.replica,
        request_id=request.request_id,
        issued_at=now,
        expires_at=expires_at,
        started_at=request.started_at,
    )
    ledger.grant_by_request[key] = grant_id
    return AdmissionGrant(
        request_id=request.request_id,
        grant_id=grant_id,
        version=version,
        lease_expires_at=expires_at,
    )
