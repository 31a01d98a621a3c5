"""A run that fails in a service is stopped with its reason, and only that run: the fleet's
other runs go on in the same processes.

A `RunFault` is a failure that belongs to one run: its config (an adapter the trainer cannot
add, a step its PPO settings cannot take), its reward function, its data. A service that meets
one stops serving the run and asks the fleet's registry to stop it (`report`: the `lorabus run
stop` request, its reason starting `failed in <service>: `), so every process of the fleet
retires the run from the run table, `lorabus run list` shows why, and its versions, ledger and
exports stay as a stopped run's do. A fault that may pass (a reward function calling a service
that is down) is given `STRIKES` consecutive tries first (`Strikes`).

What is not a `RunFault` (the bus, the store, the GPU) hurts every run alike and is raised as
before: the process restarts and every run resumes from its checkpoint. The fleet's own run
keeps the single-run behaviour too: its engine holds the base model the others share.

Invariant: a fault stops the run it names and no other; the report is the registry's ordinary
stop request, so the run table keeps one writer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from services.common.bus import Bus

log = logging.getLogger(__name__)

STRIKES = 3
"""consecutive failed batches before a fault that may pass stops its run"""
PREFIX = "failed in "
"""how a stop reason says the run failed (rather than was stopped by request)"""


class RunFault(Exception):
    """A failure that is one run's own: stop the run, not the service."""


@dataclass
class Strikes:
    """Consecutive failures of one run; `hit` says when they reach the limit (once)."""

    limit: int = STRIKES
    count: int = 0

    def hit(self) -> bool:
        self.count += 1
        return self.count == self.limit

    def clear(self) -> None:
        self.count = 0


def reason(service: str, fault: BaseException | str) -> str:
    """The stop reason the run table keeps: which service, what failed."""
    return f"{PREFIX}{service}: {fault}"


def failed(stop_reason: str) -> bool:
    return stop_reason.startswith(PREFIX)


async def report(bus: Bus, fleet: str, run: str, service: str, fault: BaseException | str, *,
                 timeout_s: float = 5.0) -> bool:  # fmt: skip
    """Ask `fleet`'s registry to stop `run` for `fault`; True once it agreed. Never raises: a
    registry that does not answer leaves the run unserved here, and logged."""
    from services.common.run_table import RunTable

    why = reason(service, fault)
    try:
        reply = await RunTable(bus, fleet).stop(run, why, timeout=timeout_s)
    except Exception as exc:  # no registry, no answer, no rights: the run stays unserved here
        log.error("%s: run %s failed and the registry was not told (%r): %s", service, run, exc, why)
        return False
    if not reply.ok:
        log.error("%s: run %s failed; the registry refused to stop it (%s): %s", service, run, reply.problems, why)
        return False
    log.error("%s: run %s stopped: %s", service, run, why)
    return True
