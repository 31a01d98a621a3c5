"""The fleet side of the registry: the run table, run requests, and admission for any run.

Each live run has its own `RegistryService` (its ledger, journal, consumers and off-policyness
policy, exactly as a single-run registry), all over one connection: the fleet's own run (the
`run` of the config the registry was started with) on the process's Bus, every other run on
`bus.for_run(run)`. Around them:

- `lorabus.<fleet>.fleet.run.{submit,list,stop,resume}`: validate (`runconfig`, `runs`), write
  the run table (KV `lorabus_<fleet>_runs`), start the run's RegistryService (again, on
  resume: its ledger is where it stopped), reply.
- `lorabus.<fleet>.fleet.admission`: pick a run by weighted fair share (`share.pick`), then
  admit through that run's journal (the one door into a run's policy), so the grant (named
  with its run) leaves only after that run's ledger has stored it, the registry's rule for
  everything it sends.
- a settle loop: a stopping run with no grant left becomes stopped (its RegistryService
  ends), an active run whose head reached total_train_steps becomes finished.

Invariant: the run table is written only here, and a run's record is stored before anyone is
told about the run (the submit reply, a grant for it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
from nats.aio.msg import Msg

from proto import codec, subjects
from proto.messages import (
    AdmissionDeny,
    AdmissionGrant,
    AdmissionRequest,
    FleetAdmissionRequest,
    RunInfo,
    RunList,
    RunRecord,
    RunReply,
    RunResume,
    RunStop,
    RunSubmit,
)
from services.common import adapter_memory, base_config, capacity, share
from services.common.bus import Bus, decode
from services.common.run_table import RunTable
from services.config import runconfig
from services.config.loader import ConfigError
from services.config.schema import LorabusConfig
from services.registry import metrics, runs
from services.registry.policy import SILENT_HEARTBEATS, PolicyConfig, code_of, seen_limit_for
from services.registry.service import RegistryService, new_grant_token, stop_serving

log = logging.getLogger(__name__)

SETTLE_EVERY_S = 0.5
ROUTES_KEPT = 4096
"""fleet requests remembered (replica/request_id -> run), so a retried request is routed to the
run that granted it and gets the same grant back"""
DENY_FLEET_IDLE = "fleet-idle"
DENY_FLEET_MAX_CONCURRENT = "fleet-max-concurrent"


def policy_config(cfg: LorabusConfig) -> PolicyConfig:
    """The registry's door for configuration: a run's `LorabusConfig` narrowed to the few
    values its policy decides by (its `rollout` section); the policy never sees the rest."""
    r = cfg.rollout
    return PolicyConfig(
        max_head_offpolicyness=r.max_head_offpolicyness,
        consumer_batch_size=r.consumer_batch_size,
        max_concurrent_rollouts=r.max_concurrent,
        lease_seconds=r.lease_seconds,
        seen_limit=seen_limit_for(r.max_concurrent),
        silent_after_s=SILENT_HEARTBEATS * r.heartbeat_s,
    )


class FleetRegistry:
    def __init__(self, bus: Bus, cfg: LorabusConfig, raw: dict[str, Any], *, clock: Callable[[], float] = time.time):
        self.bus, self.cfg, self.raw, self.clock = bus, cfg, raw, clock
        self.fleet = cfg.run
        self.table = RunTable(bus, self.fleet)
        self.records: dict[str, RunRecord] = {}
        self.configs: dict[str, LorabusConfig] = {}
        self.services: dict[str, RegistryService] = {}
        self.failed: asyncio.Future = asyncio.get_running_loop().create_future()
        self._views: dict[str, Bus] = {}
        self._grants = 0
        self._last_grant: dict[str, int] = {}
        self._routes: OrderedDict[str, str] = OrderedDict()
        self._writing = asyncio.Lock()
        self._tasks: list[asyncio.Task] = []
        self._subs: list[Any] = []
        self._encode = msgspec.json.Encoder().encode
        self._base_shape: adapter_memory.BaseShape | None = None
        """the base model's layers, read once when a memory budget first needs them"""

    # --- start and stop -----------------------------------------------------------------------

    async def start(self) -> None:
        self.records = await self.table.records()
        for run, record in self.records.items():
            if run != self.fleet:
                self.configs[run] = runconfig.restore(record.config, self.cfg)
        # the fleet's own run always serves its current config: `lorabus up` with the same
        # run name again resumes it (a stop lasts until the fleet restarts)
        own = runs.new_record(self.fleet, self.cfg, runconfig.stored(self.cfg), self.clock())
        await self._write(own)
        self.configs[self.fleet] = self.cfg
        for run, record in self.records.items():
            if record.state in runs.LIVE:
                await self._open(run)
        bus, fleet = self.bus, self.fleet
        self._subs += [
            await bus.serve(subjects.run_control(fleet, "submit"), RunSubmit, self._on_submit, queue="registry"),
            await bus.serve(subjects.run_control(fleet, "stop"), RunStop, self._on_stop, queue="registry"),
            await bus.serve(subjects.run_control(fleet, "list"), RunList, self._on_list, queue="registry"),
            await bus.serve(subjects.run_control(fleet, "resume"), RunResume, self._on_resume, queue="registry"),
            await bus.subscribe_raw(subjects.fleet_admission(fleet), self._on_admission, queue="registry"),
        ]
        self._tasks.append(asyncio.create_task(self._settle_loop(), name="fleet-settle"))
        log.info("fleet %s: serving %d run(s): %s", fleet, len(self.services), ", ".join(sorted(self.services)))

    async def stop(self) -> None:
        await stop_serving(self._subs, self._tasks)
        for run in list(self.services):
            await self._close(run)

    async def _open(self, run: str) -> None:
        cfg = self.configs[run]
        if run == self.fleet:
            view = self.bus
        else:
            view = self._views[run] = self.bus.for_run(run)
            await view.ensure_streams()
        service = RegistryService(view, policy_config(cfg), clock=self.clock)
        await service.start()
        service.failed.add_done_callback(self._service_failed)
        self.services[run] = service
        metrics.FLEET_SHARE.labels(run).set(self.records[run].share)
        self._observe_memory(run)

    async def _close(self, run: str) -> None:
        service = self.services.pop(run, None)
        if service is not None:
            await service.stop()
        view = self._views.pop(run, None)
        if view is not None:
            await view.close()
        metrics.FLEET_SHARE.labels(run).set(0)
        if self.cfg.fleet.max_adapter_memory_gib is not None:
            metrics.FLEET_ADAPTER_MEMORY.labels(run).set(0)

    def _service_failed(self, failed: asyncio.Future) -> None:
        exc = None if failed.cancelled() else failed.exception()
        if exc is not None and not self.failed.done():
            self.failed.set_exception(exc)

    async def _write(self, record: RunRecord) -> None:
        await self.table.put(record)
        self.records[record.run] = record

    # --- run requests -------------------------------------------------------------------------

    def _reply(self, ok: bool, problems: Sequence[str] = (), names: Sequence[str] = ()) -> RunReply:
        infos = [self.info(run) for run in names if run in self.records]
        return RunReply(fleet=self.fleet, ok=ok, problems=list(problems), runs=infos)

    def info(self, run: str) -> RunInfo:
        service = self.services.get(run)
        return runs.info(self.records[run], self.configs[run], service.ledger if service else None, self._memory(run))

    def _wrong_fleet(self, fleet: str) -> RunReply | None:
        if fleet == self.fleet:
            return None
        return self._reply(False, [f"fleet: {fleet!r} is not this fleet ({self.fleet!r}); use the fleet's config"])

    def _unknown_run(self, run: str) -> RunReply:
        known = ", ".join(sorted(self.records)) or "none"
        return self._reply(False, [f"run: {run!r} is not a run of this fleet (runs: {known}); `lorabus run list`"])

    async def _on_submit(self, request: RunSubmit) -> RunReply:
        if (wrong := self._wrong_fleet(request.fleet)) is not None:
            return wrong
        async with self._writing:
            try:
                cfg = runconfig.run_config(self.cfg, self.raw, request.config, source=f"run {request.run}")
            except ConfigError as exc:
                return self._reply(False, exc.problems)
            problems = []
            if cfg.run != request.run:
                problems.append(
                    f"run: the config names {cfg.run!r} but the request names {request.run!r}; send the "
                    "run name the config resolves to"
                )
            problems += runs.admit_problems(cfg, self.records, self.cfg.fleet.max_runs)
            if cfg.run not in self.records:
                problems += runconfig.conflicts(cfg, [self.configs[r] for r in self.records])
                live = [self.configs[r] for r, rec in self.records.items() if rec.state in runs.LIVE]
                problems += capacity.problems(self.cfg, cfg, live)
                problems += self._memory_problems(cfg, live)
            if problems:
                return self._reply(False, problems)
            record = runs.new_record(self.fleet, cfg, runconfig.stored(cfg), self.clock())
            self.configs[cfg.run] = cfg
            await self._write(record)
            await self._open(cfg.run)
        log.info("fleet %s: run %s submitted (share %g, rank %d)", self.fleet, cfg.run, cfg.fleet.share,
                 cfg.actor.lora_rank)  # fmt: skip
        return self._reply(True, names=[cfg.run])

    def _shape(self) -> adapter_memory.BaseShape:
        """The base model's layers, for the memory budget; its config.json is read once, on first
        need (raises BaseConfigError or AdapterMemoryError, the field named)."""
        if self._base_shape is None:
            self._base_shape = adapter_memory.base_shape(base_config.read(self.cfg.actor.path))
        return self._base_shape

    def _memory_problems(self, cfg: LorabusConfig, live: list[LorabusConfig]) -> list[str]:
        """Why the trainer's adapter budget (fleet.max_adapter_memory_gib) cannot take `cfg`'s run
        beside `live`; empty without a budget."""
        if self.cfg.fleet.max_adapter_memory_gib is None:
            return []
        try:
            shape = self._shape()
        except (base_config.BaseConfigError, adapter_memory.AdapterMemoryError) as exc:
            return [str(exc)]
        return adapter_memory.problems(self.cfg, cfg, live, shape)

    def _memory(self, run: str) -> int | None:
        """The run's adapter bytes, under a budget only (without one the base config is never
        read: a registry needs no model files unless it enforces memory); None: no budget, or
        not computable (logged)."""
        if self.cfg.fleet.max_adapter_memory_gib is None:
            return None
        try:
            return adapter_memory.run_memory(self.configs[run], self._shape()).total
        except (base_config.BaseConfigError, adapter_memory.AdapterMemoryError) as exc:
            log.warning("fleet %s: run %s's adapter memory is not known: %s", self.fleet, run, exc)
            return None

    def _observe_memory(self, run: str) -> None:
        """The run's adapter bytes and the budget on /metrics (under a budget only)."""
        budget = self.cfg.fleet.max_adapter_memory_gib
        if budget is None:
            return
        metrics.FLEET_ADAPTER_MEMORY_BUDGET.set(int(budget * adapter_memory.GIB))
        if (memory := self._memory(run)) is not None:
            metrics.FLEET_ADAPTER_MEMORY.labels(run).set(memory)

    async def _on_stop(self, request: RunStop) -> RunReply:
        if (wrong := self._wrong_fleet(request.fleet)) is not None:
            return wrong
        async with self._writing:
            record = self.records.get(request.run)
            if record is None:
                return self._unknown_run(request.run)
            stopped = runs.stop(record, request.reason, self.clock())
            if stopped is not None:
                await self._write(stopped)
                log.info("fleet %s: run %s stopping (%s)", self.fleet, request.run, stopped.reason)
        return self._reply(True, names=[request.run])

    async def _on_resume(self, request: RunResume) -> RunReply:
        if (wrong := self._wrong_fleet(request.fleet)) is not None:
            return wrong
        async with self._writing:
            record = self.records.get(request.run)
            if record is None:
                return self._unknown_run(request.run)
            live = [self.configs[r] for r, rec in self.records.items() if rec.state in runs.LIVE]
            problems = runs.resume_problems(record, len(live), self.cfg.fleet.max_runs)
            if record.state == "stopped" and not problems:
                problems = capacity.problems(self.cfg, self.configs[request.run], live)
                problems += self._memory_problems(self.configs[request.run], live)
            if problems:
                return self._reply(False, problems)
            resumed = runs.resume(record, self.clock())
            if resumed is not None:
                await self._write(resumed)
                await self._open(request.run)
                log.info("fleet %s: run %s resumed", self.fleet, request.run)
        return self._reply(True, names=[request.run])

    async def _on_list(self, request: RunList) -> RunReply:
        if (wrong := self._wrong_fleet(request.fleet)) is not None:
            return wrong
        return self._reply(True, names=sorted(self.records))

    # --- admission for any run ----------------------------------------------------------------

    def _per_run(self, run: str, request: FleetAdmissionRequest) -> AdmissionRequest:
        return AdmissionRequest(
            run=run,
            replica=request.replica,
            request_id=request.request_id,
            loaded_versions=request.loaded.get(run, []),
            started_at=request.started_at,
        )

    def loads(self, request: FleetAdmissionRequest) -> list[share.RunLoad]:
        """Every live run as the fair share sees it for this replica."""
        out = []
        for run, service in self.services.items():
            ready = (
                self.records[run].state == "active"
                and run in request.loaded
                and service.journal.can_grant(self._per_run(run, request))
            )
            out.append(
                share.RunLoad(
                    run=run,
                    share=self.records[run].share,
                    running=service.ledger.running,
                    ready=ready,
                    last_grant=self._last_grant.get(run, -1),
                )
            )
        return out

    async def _on_admission(self, msg: Msg) -> None:
        try:
            request: FleetAdmissionRequest = decode(msg.data, FleetAdmissionRequest)
        except codec.DecodeError as exc:
            await self.bus.dead_letter_quietly(msg.subject, exc.reason, str(exc), msg.data)
            return
        if not msg.reply:
            return
        key = f"{request.replica}/{request.request_id}"
        run = self._routes.get(key)
        if run not in self.services:
            loads = self.loads(request)
            limit = self.cfg.fleet.max_concurrent_rollouts
            run = share.pick(loads, limit=limit)
            if run is None:
                full = limit is not None and share.in_flight(loads) >= limit
                reason = (
                    f"{DENY_FLEET_MAX_CONCURRENT}: {share.in_flight(loads)} groups in flight, "
                    f"fleet.max_concurrent_rollouts={limit}"
                    if full
                    else f"{DENY_FLEET_IDLE}: no active run can grant replica {request.replica!r} a group now "
                    f"(runs it has loaded: {sorted(request.loaded) or 'none'})"
                )
                metrics.FLEET_DENIALS.labels(code_of(reason)).inc()
                deny = AdmissionDeny(request_id=request.request_id, reason=reason, retry_after_s=0.25)
                await self.bus.send_raw(msg.reply, self._encode(deny))
                return
        journal = self.services[run].journal  # services are opened (started) before they are listed
        try:
            reply = journal.admit(self._per_run(run, request), self.clock(), new_grant_token())
        except Exception as exc:
            log.exception("fleet: admission for run %s failed", run)
            await self.bus.dead_letter_quietly(msg.subject, "handler", repr(exc), msg.data)
            return
        if isinstance(reply, AdmissionGrant):
            self._routes[key] = run
            while len(self._routes) > ROUTES_KEPT:
                self._routes.popitem(last=False)
            self._grants += 1
            self._last_grant[run] = self._grants
            metrics.FLEET_GRANTS.labels(run).inc()
            journal.send_after_commit(msg.reply, self._encode(msgspec.structs.replace(reply, run=run)))
        else:
            metrics.FLEET_DENIALS.labels(code_of(reply.reason)).inc()
            await self.bus.send_raw(msg.reply, self._encode(reply))

    # --- run states ---------------------------------------------------------------------------

    async def settle(self) -> None:
        """Move runs along (`runs.settle`) and refresh the per-run gauges."""
        now = self.clock()
        async with self._writing:
            for run in list(self.services):
                service = self.services[run]
                record = self.records[run]
                moved = runs.settle(record, service.ledger, self.configs[run].total_train_steps, now)
                if moved is not None:
                    await self._write(moved)
                    log.info("fleet %s: run %s is %s", self.fleet, run, moved.state)
                    if moved.state == "stopped":
                        await self._close(run)
                        continue
                ledger = service.ledger
                metrics.FLEET_RUNNING.labels(run).set(ledger.running)
                metrics.FLEET_ACCEPTED.labels(run).set(ledger.accepted)
                if ledger.head is not None:
                    metrics.FLEET_HEAD_VERSION.labels(run).set(ledger.head)
        for state in ("active", "stopping", "stopped", "finished"):
            metrics.FLEET_RUNS.labels(state).set(sum(r.state == state for r in self.records.values()))

    async def _settle_loop(self) -> None:
        while True:
            await asyncio.sleep(SETTLE_EVERY_S)
            try:
                await self.settle()
            except Exception as exc:  # the run table is unreachable for now: try again
                log.warning("fleet %s: settling runs failed: %r", self.fleet, exc)
