"""Who may announce adapter versions: the run's trainer lineage, as every receiver checks it.

A version comes only from the run's trainer and moves forward by bounded steps. Every
AdapterReady carries the trainer epoch (drawn once per run by the trainer, kept across its
restarts); a receiver follows the epoch of the first event of the run's ADAPTERS stream and
refuses events of any other, and refuses a version more than MAX_VERSION_STEP past the newest
it has followed. `lineage_problem` is the pure rule (the registry's policy uses it too);
`first_epoch` and `newest_trusted` read the stream for a receiver that (re)starts.
"""

from __future__ import annotations

from typing import Any

from proto import codec, subjects
from proto.messages import MAX_VERSION_STEP, AdapterReady

LOOK_BACK = 32
"""stream messages a (re)starting receiver looks back through for the newest trusted event"""


def lineage_problem(epoch: str | None, newest: int | None, event_epoch: str, version: int) -> str | None:
    """Why an event of `event_epoch` announcing `version` cannot follow the lineage `epoch`
    whose newest version is `newest` (None: nothing followed yet), or None."""
    if epoch is not None and event_epoch != epoch:
        return (
            f"trainer_epoch: {event_epoch!r} is not the run's trainer epoch {epoch!r}; only the run's "
            "trainer may publish versions (another trainer, or a forger, announced this one)"
        )
    if newest is not None and version > newest + MAX_VERSION_STEP:
        return (
            f"version: v{version} jumps more than {MAX_VERSION_STEP} versions past v{newest}; the "
            "trainer steps by one, so this event is not the trainer's"
        )
    return None


def _decoded(raw: Any) -> AdapterReady | None:
    if raw is None:
        return None
    try:
        return codec.decode(raw.data, AdapterReady)
    except codec.DecodeError:
        return None


async def first_epoch(bus: Any, stream: str) -> str | None:
    """The epoch of the first decodable event of the ADAPTERS stream (the trainer's v0)."""
    seq = 1
    for _ in range(LOOK_BACK):
        raw = await bus.message(stream, seq, subjects.adapter_ready_all(bus.run))
        if raw is None:
            return None
        event = _decoded(raw)
        if event is not None:
            return event.trainer_epoch
        seq = raw.seq + 1
    return None


async def newest_trusted(bus: Any, stream: str, epoch: str | None) -> AdapterReady | None:
    """The newest event of the stream that is of `epoch` and whose parent version is in the
    stream with the same epoch, at most a bounded step below it (a forged jump has no such
    parent); None when none of the last LOOK_BACK messages is."""
    last = await bus.last_seq(stream)
    for seq in range(last, max(0, last - LOOK_BACK), -1):
        event = _decoded(await bus.message(stream, seq))
        if event is None or (epoch is not None and event.trainer_epoch != epoch):
            continue
        if event.parent_version is None:
            return event
        parent = _decoded(await bus.last_raw(stream, subjects.adapter_ready(bus.run, event.parent_version)))
        if parent is not None and lineage_problem(epoch, parent.version, event.trainer_epoch, event.version) is None:
            return event
    return None
