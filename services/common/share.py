"""The weighted fair share of a fleet's rollout concurrency between its runs: pure, no I/O.

A replica that asks the fleet for work (`FleetAdmissionRequest`) gets one group from one run.
Which run, is `pick`:

1. Candidates are the runs that can grant now: active, and their own off-policyness policy
   would admit this replica (head published, staleness capacity left, under the run's
   max_concurrent_rollouts, an admissible version of theirs loaded on the replica). A run with
   nothing to do is no candidate, so its share goes to the others (work-conserving).
2. When the fleet's groups in flight reach `fleet.max_concurrent_rollouts`, nobody.
3. Among candidates, the one with the least in flight per unit of share (`running / share`);
   ties go to the run granted longest ago, then by name: round-robin among equals.

Fairness: under contention each busy run holds concurrency in proportion to its share. A run
below its share is always picked before one above it; grants are short (one group), so a run
that becomes busy reaches its share as the others' grants finish, without preempting any.
No run starves: while a candidate waits its `running / share` can only fall, and the
tie-break rotates, so it is picked within one round of grants.

Per-run off-policyness is untouched: the pick only chooses whose policy decides next, and
that run's ledger then admits (or denies) exactly as on the run's own admission subject.
"""

from __future__ import annotations

from collections.abc import Sequence

from msgspec import Struct


class RunLoad(Struct, frozen=True, kw_only=True):
    """One run as the share sees it at the moment of a request."""

    run: str
    share: float
    """the run's weight (`fleet.share`), > 0"""
    running: int
    """its grants issued and not yet finished or expired"""
    ready: bool
    """its own policy would grant this replica a group now"""
    last_grant: int = -1
    """the fleet's grant counter at this run's latest fleet grant (-1: never)"""


def in_flight(loads: Sequence[RunLoad]) -> int:
    return sum(load.running for load in loads)


def pick(loads: Sequence[RunLoad], *, limit: int | None = None) -> str | None:
    """The run to grant the asking replica a group of, or None (see the module docstring)."""
    if limit is not None and in_flight(loads) >= limit:
        return None
    ready = [load for load in loads if load.ready]
    if not ready:
        return None
    best = min(ready, key=lambda load: (load.running / load.share, load.last_grant, load.run))
    return best.run


def targets(loads: Sequence[RunLoad], capacity: int) -> dict[str, float]:
    """Each ready run's fair concurrency out of `capacity` (share over the ready runs' shares);
    what `pick` converges to under contention, for status and metrics."""
    ready = [load for load in loads if load.ready]
    total = sum(load.share for load in ready)
    return {load.run: capacity * load.share / total for load in ready} if total else {}
