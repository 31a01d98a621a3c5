"""The ledger: what the registry knows of a run, as plain msgspec Structs, and its small helpers.

Invariant: every collection here is bounded (versions: the admissible window plus
VERSION_HISTORY; replicas: MAX_REPLICAS; grants: max concurrent; seen ids: seen_limit;
decided grants: a few ranges), and every value comes from an input bounded by
`proto.messages`, so the stored ledger is bounded however long the run. Only the policy's
functions change it; everything else reads it.
"""

from __future__ import annotations

import msgspec
from msgspec import Struct, field

from proto.messages import Verdict

MAX_REPLICAS = 1024
"""replicas the ledger tracks; a report naming one more is refused (with NATS auth a replica
is a user, so this is far above any fleet; without it, it bounds what a stranger can add)"""
VERSION_HISTORY = 64
"""retired versions kept in the ledger below the admissible window (status, late exports);
older records are dropped so the ledger stays bounded however long the run"""


class VersionRecord(Struct, kw_only=True):
    published_at: float
    trainer_step: int
    digest: str
    """sha256 of the AdapterReady event, to tell a replay from a conflicting republish"""
    adapter_sha256: str | None = None
    """sha256 of the adapter bytes the event announced (None: an XCCL event, sent before the
    copy was hashed): what trajectories' token ranges must name (`identity`)"""
    loaded_by: set[str] = field(default_factory=set)
    exported: bool = False
    retired: bool = False
    """outside the admissible window (H - v > k): no new work is granted for it"""


class Grant(Struct, kw_only=True):
    version: int
    replica: str
    request_id: str
    issued_at: float
    expires_at: float
    started_at: float | None = None
    """the requesting process's start, as its admission request named it: which process of
    the replica holds the grant (`new_incarnation`)"""


class ReplicaState(Struct, kw_only=True):
    loaded: set[int] = field(default_factory=set)
    last_seen: float = 0.0
    engine: str = ""
    failures: int = 0
    heard_at: float = 0.0
    """the registry's clock when the replica last spoke (report or admission request)"""
    started_at: float = 0.0
    """the newest process start the replica has sent (0: none yet)"""
    incarnation: str = ""
    """the process its heartbeats come from now ("" : none has named one yet)"""
    replaced: list[str] = field(default_factory=list)
    """incarnations it had before, newest last (at most REPLACED_KEPT): their heartbeats are
    late messages of dead processes"""


class SeenDecision(Struct, array_like=True):
    """A compact first decision (the ledger keeps up to `seen_limit` of these)."""

    verdict: Verdict
    reason: str
    grant_id: str
    replica: str
    head_version: int
    oldest_version: int | None
    decided_at: float


class Ledger(Struct, kw_only=True):
    run: str
    epoch: str | None = None
    """the trainer epoch of the first version recorded: events of any other are refused"""
    head: int | None = None
    versions: dict[int, VersionRecord] = field(default_factory=dict)
    grants: dict[str, Grant] = field(default_factory=dict)
    grant_by_request: dict[str, str] = field(default_factory=dict)
    """`replica/request_id` -> grant_id: a retried request gets its grant back"""
    next_grant: int = 0
    accepted: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    """trajectory rejections by reason code"""
    denied: dict[str, int] = field(default_factory=dict)
    """admission denials by reason code"""
    seen: dict[str, SeenDecision] = field(default_factory=dict)
    replicas: dict[str, ReplicaState] = field(default_factory=dict)
    decided_grants: list[tuple[int, int]] = field(default_factory=list)
    """numbers of the grants a decided trajectory used, as sorted disjoint [lo, hi] ranges: the
    exact memory of duplicates for the life of the run (`duplicate_of_decided`); grants are
    numbered in issue order and used about in order, so only lost grants leave gaps"""

    @property
    def running(self) -> int:
        return len(self.grants)


class Applied(Struct, frozen=True):
    """What an event did to the ledger: `changed` says whether to persist, a non-empty `error`
    says it was refused (the service dead-letters it)."""

    changed: bool
    error: str = ""


UNCHANGED = Applied(False)
CHANGED = Applied(True)

_ledger_encoder = msgspec.json.Encoder()
_ledger_decoder = msgspec.json.Decoder(Ledger)


def encode_ledger(ledger: Ledger) -> bytes:
    return _ledger_encoder.encode(ledger)


def decode_ledger(data: bytes) -> Ledger:
    return _ledger_decoder.decode(data)


def code_of(reason: str) -> str:
    """`"stale: H=5 v=2 k=2"` -> `"stale"`."""
    return reason.partition(":")[0]


def new_ledger(run: str) -> Ledger:
    return Ledger(run=run)


def drop_grant(ledger: Ledger, grant_id: str) -> Grant | None:
    """Forget a grant (used, expired or freed) and the request that got it."""
    grant = ledger.grants.pop(grant_id, None)
    if grant is not None:
        ledger.grant_by_request.pop(f"{grant.replica}/{grant.request_id}", None)
    return grant
