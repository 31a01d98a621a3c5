"""Verifiable policy identity: does a trajectory come from the adapter its versions name? Pure.

Every token range of a completion names the version that generated it and the sha256 of the
adapter bytes the replica's loader handed its engine (`proto.messages.TokenRange`). The ledger
records, for each version, the sha256 its AdapterReady announced. A trajectory is admitted only
when every (version, sha256) it names is one the ledger published; a stale copy served under a
new name, a corrupted or swapped object, or bytes of another run all name another digest.

Invariant: `problem` returns None only when each claimed version is in the ledger and its
claimed digest equals the ledger's, or the ledger has no digest to compare (an XCCL event, sent
before its durable copy was hashed: only the replica's canary checks those). A trajectory that
names no ranges at all (`claims` -> None) comes from a sender that predates them and is judged
by the other rules alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from proto.messages import Trajectory

REJECT_IDENTITY = "identity"

Claims = tuple[tuple[int, str | None], ...]
"""the distinct (version, adapter sha256) pairs a trajectory's ranges name, sorted"""


class Published(Protocol):
    """What the ledger keeps of a version that this check reads (`policy.VersionRecord`)."""

    @property
    def adapter_sha256(self) -> str | None: ...


def claims(trajectory: Trajectory) -> Claims | None:
    """What `trajectory` claims to come from; None when no completion carries ranges."""
    pairs = {(r.version, r.adapter_sha256) for c in trajectory.completions for r in c.ranges}
    if not pairs:
        return None
    return tuple(sorted(pairs, key=lambda p: (p[0], p[1] or "")))


def problem(claimed: Claims | None, versions: Mapping[int, Published]) -> str | None:
    """Why the claimed policies are not the ones the ledger published, or None."""
    for version, sha256 in claimed or ():
        record = versions.get(version)
        if record is None:
            return f"{REJECT_IDENTITY}: tokens name v{version}, which this run's ledger does not hold"
        if record.adapter_sha256 is None:
            continue  # nothing announced to compare against (docstring)
        if sha256 is None:
            return (
                f"{REJECT_IDENTITY}: tokens of v{version} name no adapter digest, but v{version} was published "
                f"with sha256 {record.adapter_sha256}; the replica cannot say what it served"
            )
        if sha256 != record.adapter_sha256:
            return (
                f"{REJECT_IDENTITY}: tokens of v{version} came from adapter bytes with sha256 {sha256}, but "
                f"v{version} was published with sha256 {record.adapter_sha256}; the replica served other "
                "weights under its name"
            )
    return None
