"""One run is the unit, the fleet its only host: a process serves its fleet's runs, one
`RunWorker` each, and the fleet's own run is simply the first of them.

The host opens the own run (the `run` of the config the process was started with, on the
process's Bus), then follows the fleet's run table (`RunTable.watch`): a run it is not serving
yet, in a state the service `opens`, gets its config restored (`runconfig.restore`), its view of
the connection (`Bus.for_run`, its streams ensured) and a worker; a served run whose record
reaches a state the service `ends` is drained and closed; it is opened again only by a newer
record that opens it (`lorabus run resume`: the registry's `stopped -> active`).
When the table cannot be read (a bus user without rights on it), the own run is the only run,
on the same code path. A service that ends a run itself (the trainer, at its last step) calls
`retire`, as the table would.

    worker: start -> (serving) -> drain -> close

- start: begin serving the run (consumers, loops); what raises leaves the run unserved (closed).
  A `RunFault` (the run's own: its config, its reward function) is also reported to the
  registry (`run_faults.report`), which stops the run with the reason in every process.
- drain: take no new work, and return once the work in hand is done.
- close: release what the run holds (an adapter on a shared model, versions on an engine).

Invariant: each run has at most one worker in a process, a run is served on its own view of the
connection only, and a retired run is served again only after the table resumed it (a record
newer than the one that retired it; its streams and ledger are where it stopped).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Awaitable, Callable, Collection
from typing import Generic, Protocol, TypeVar

from proto.messages import RunRecord, RunStateName
from services.common import run_faults
from services.common.bus import Bus
from services.common.run_table import RunTable
from services.config import runconfig
from services.config.schema import LorabusConfig

log = logging.getLogger(__name__)

ALL_STATES: tuple[RunStateName, ...] = ("active", "stopping", "stopped", "finished")
ACTIVE: tuple[RunStateName, ...] = ("active",)
ENDED: tuple[RunStateName, ...] = ("stopped", "finished")


class RunWorker(Protocol):
    """One run served by one process."""

    async def start(self) -> None: ...

    async def drain(self) -> None: ...

    async def close(self) -> None: ...


W = TypeVar("W", bound=RunWorker)

MakeWorker = Callable[[LorabusConfig, Bus], Awaitable[W]]
"""(a run's config, its bus: the process's for the own run, else a view) -> the run's worker"""
Report = Callable[[Bus, str, str, str, BaseException], Awaitable[bool]]
"""(bus, fleet, run, service, fault) -> whether the registry agreed to stop the run"""


class RunHost(Generic[W]):
    """The runs a process serves, following its fleet's run table."""

    def __init__(
        self,
        cfg: LorabusConfig,
        bus: Bus,
        make: MakeWorker[W],
        *,
        name: str,
        opens: Collection[RunStateName] = ACTIVE,
        ends: Collection[RunStateName] = ENDED,
        ready: asyncio.Event | None = None,
        changed: asyncio.Event | None = None,
        report: Report = run_faults.report,
    ):
        self.cfg, self.bus, self.make, self.name = cfg, bus, make, name
        self.fleet = cfg.run
        self.opens, self.ends = frozenset(opens), frozenset(ends)
        if self.opens & self.ends:
            raise ValueError(f"opens/ends: {sorted(self.opens & self.ends)} in both; a state opens a run or ends it")
        self.report = report
        self.ready = ready
        """set once other runs may join (the rollout: when the own run has shaped the slots)"""
        self.workers: dict[str, W] = {}
        """served runs, the own run first"""
        self.ended: dict[str, float] = {}
        """retired runs -> the table's changed_at when they were: only a newer record opens them again"""
        self._seen: dict[str, float] = {}
        """run -> changed_at of its newest record seen"""
        self.changed = changed or asyncio.Event()
        """set whenever a run joins or is retired (a scheduler's wake-up; its workers may set it too)"""
        self._views: dict[str, Bus] = {}
        self._retiring: dict[str, asyncio.Task] = {}
        self._watch: asyncio.Task | None = None
        self.following = False
        """whether the run table is followed (False: the own run is the only run)"""

    @property
    def own(self) -> W:
        return self.workers[self.fleet]

    async def start(self) -> W:
        """Open the own run, then follow the run table; returns the own run's worker."""
        await self._open(self.cfg, self.bus)
        try:
            self._watch = await RunTable(self.bus, self.fleet).watch(self.on_record)
            self.following = True
        except Exception as exc:  # e.g. a bus user without rights on the run table
            log.warning("%s: cannot follow fleet %s's run table (%r); serving run %s alone",
                        self.name, self.fleet, exc, self.fleet)  # fmt: skip
        return self.own

    async def _open(self, cfg: LorabusConfig, bus: Bus) -> None:
        worker = await self.make(cfg, bus)
        try:
            await worker.start()
        except BaseException:
            with contextlib.suppress(Exception):  # what it took so far (an adapter on a shared model)
                await worker.close()
            raise
        self.workers[cfg.run] = worker
        self.changed.set()

    async def on_record(self, record: RunRecord) -> None:
        try:
            await self._on_record(record)
        except run_faults.RunFault as fault:  # the run's own: not opened again here unless resumed
            self.ended[record.run] = record.changed_at
            await self.report(self.bus, self.fleet, record.run, self.name, fault)
        except Exception:  # one run that cannot be served must not stop the others
            log.exception("%s: cannot follow run %s (%s)", self.name, record.run, record.state)

    async def _on_record(self, record: RunRecord) -> None:
        run = record.run
        if run == self.fleet:
            return
        self._seen[run] = record.changed_at
        if run in self.ended:
            if record.state not in self.opens or record.changed_at <= self.ended[run]:
                return
            del self.ended[run]  # resumed: served again from where it stopped
        if record.state in self.ends and run in self.workers:
            await self.retire(run)
            return
        if record.state not in self.opens or run in self.workers:
            return
        if self.ready is not None:
            await self.ready.wait()
        cfg = runconfig.restore(record.config, self.cfg)
        view = self._views[run] = self.bus.for_run(run)
        try:
            await view.ensure_streams()
            await self._open(cfg, view)
        except BaseException:
            del self._views[run]
            await view.close()
            raise
        log.info("%s: serving run %s (%s, rank %d)", self.name, run, record.state, cfg.actor.lora_rank)

    async def retire(self, run: str) -> None:
        """Drain and close `run`'s worker, once, however many ask (its record, its owner)."""
        task = self._retiring.get(run)
        if task is None:
            task = self._retiring[run] = asyncio.create_task(self._retire(run), name=f"retire:{run}")
        await asyncio.shield(task)

    async def _retire(self, run: str) -> None:
        worker = self.workers[run]
        try:
            await worker.drain()
            await worker.close()
        finally:
            del self.workers[run]
            self.ended[run] = self._seen.get(run, math.inf)
            self._retiring.pop(run, None)  # a resumed run retires anew
            view = self._views.pop(run, None)
            if view is not None:
                await view.close()
            self.changed.set()
        log.info("%s: run %s retired", self.name, run)

    async def close(self) -> None:
        """Stop following the table, then drain and close every run, the own run last."""
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        others = [run for run in self.workers if run != self.fleet]
        results = await asyncio.gather(*(self.retire(run) for run in others), return_exceptions=True)
        for run, result in zip(others, results):
            if isinstance(result, Exception):
                log.error("%s: run %s did not close cleanly: %r", self.name, run, result)
        if self.fleet in self.workers:
            await self.retire(self.fleet)
