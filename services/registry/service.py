"""The registry's bus service: feeds events into `policy`, persists the ledger, answers.

One rule keeps it crash-safe: nothing leaves the registry (an ack, a grant, a decision, an
accepted trajectory) before the ledger state it was derived from is in the KV bucket. A kill -9
at any point therefore loses only work that was never acknowledged, which JetStream redelivers
(or the rollout re-requests, getting its grant back by request_id).

Throughput comes from group commit, not from weakening that rule: several workers handle
admissions and trajectories concurrently on one event loop, the policy mutates the in-memory
ledger synchronously, and one KV write carries every change made while the previous write was
in flight. Each waiter is released once a snapshot containing its change is stored. The cost is
that one snapshot (the whole ledger) is written per group, so the ledger is kept small (bounded
seen-ids, grants bounded by max_concurrent_rollouts).

Writes are compare-and-set on the KV revision: a second registry for the same run (split brain)
makes the first one's next write fail, and it stops instead of overwriting the other.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import nats.js.errors
from nats.js.kv import KeyValue

from proto import codec, subjects
from proto.messages import (
    AdapterReady,
    AdmissionGrant,
    AdmissionReply,
    AdmissionRequest,
    ExportDone,
    RolloutReport,
    Trajectory,
)
from services.common import streams
from services.registry import metrics, policy
from services.registry.policy import Ledger, PolicyConfig
from services.registry.status import RegistryStatus, StatusRequest

log = logging.getLogger(__name__)

LEDGER_KEY = "ledger"
WORKERS = 8
"""concurrent admission servers and trajectory consumers (what group commit can coalesce)"""
PULL_BATCH = 1
"""nats-py's `fetch(n)` in its long-poll path waits for all n messages until its timeout (1 s
in the bus), so any n > 1 adds up to a second of latency to a trickle of messages; workers
give the concurrency instead"""
SERVICE = "registry"


class LedgerConflict(RuntimeError):
    """Another writer changed the ledger: a second registry is running for this run."""


class LedgerStore:
    """The in-memory ledger plus its KV copy, written by group commit."""

    def __init__(self, kv: KeyValue, ledger: Ledger, revision: int):
        self.kv = kv
        self.ledger = ledger
        self.revision = revision
        self._changed = 0  # generation of the in-memory ledger
        self._saved = 0  # generation of the last stored snapshot
        self._writer: asyncio.Task | None = None
        self._done = asyncio.Condition()
        self._error: BaseException | None = None
        self.fatal: BaseException | None = None
        self._unconfirmed: bytes | None = None

    @classmethod
    async def open(cls, kv: KeyValue, run: str) -> LedgerStore:
        try:
            entry = await kv.get(LEDGER_KEY)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return cls(kv, policy.new_ledger(run), 0)
        ledger = policy.decode_ledger(entry.value)
        if ledger.run != run:
            raise ValueError(
                f"ledger: bucket holds the ledger of run {ledger.run!r}, not {run!r}; "
                "each run needs its own bucket (streams.ledger_bucket)"
            )
        return cls(kv, ledger, entry.revision)

    def touch(self) -> None:
        """Mark the in-memory ledger changed (call right after a policy function changed it)."""
        self._changed += 1

    async def commit(self) -> None:
        """Return once every change made before this call is stored."""
        target = self._changed
        if self._saved >= target:
            return
        if self.fatal is not None:
            raise self.fatal
        if self._writer is None:
            self._error = None
            self._writer = asyncio.create_task(self._write_pending(), name="ledger-writer")
        async with self._done:
            await self._done.wait_for(lambda: self._saved >= target or self._writer is None)
        if self._saved < target:
            raise self._error or RuntimeError("ledger: write stopped")

    async def _write_pending(self) -> None:
        try:
            while self._saved < self._changed:
                generation = self._changed
                data = policy.encode_ledger(self.ledger)  # a consistent snapshot: no await yet
                self.revision = await self._put(data)
                self._saved = generation
                metrics.LEDGER_WRITES.inc()
                async with self._done:
                    self._done.notify_all()
        except Exception as exc:  # handed to the waiters; nobody awaits this task
            self._error = exc
            if isinstance(exc, LedgerConflict):
                self.fatal = exc
            else:
                log.warning("registry: ledger write failed: %r", exc)
        finally:
            self._writer = None
            async with self._done:
                self._done.notify_all()

    async def _put(self, data: bytes) -> int:
        previous = self._unconfirmed  # set when the last write failed without an answer
        try:
            return await self._cas(data)
        except nats.js.errors.KeyWrongLastSequenceError as exc:
            # A previous write may have been stored with its reply lost: then the stored value
            # is that attempt and we adopt its revision; anything else is another writer.
            entry = await self.kv.get(LEDGER_KEY)
            if previous is None or entry.value != previous:
                raise LedgerConflict(
                    f"ledger: revision {entry.revision} was written by someone else (expected "
                    f"{self.revision}); is a second registry running for this run? Stopping."
                ) from exc
            self.revision = entry.revision
            return await self._cas(data)

    async def _cas(self, data: bytes) -> int:
        self._unconfirmed = data
        if self.revision == 0:
            revision = await self.kv.create(LEDGER_KEY, data)
        else:
            revision = await self.kv.update(LEDGER_KEY, data, last=self.revision)
        self._unconfirmed = None
        return revision


class RegistryService:
    def __init__(
        self,
        bus,
        cfg: PolicyConfig,
        *,
        clock: Callable[[], float] = time.time,
        workers: int = WORKERS,
    ):
        self.bus = bus
        self.run = bus.run
        self.cfg = cfg
        self.clock = clock
        self.workers = workers
        self.store: LedgerStore | None = None
        self.failed: asyncio.Future = asyncio.get_running_loop().create_future()
        self._tasks: list[asyncio.Task] = []
        self._subs = []

    @property
    def ledger(self) -> Ledger:
        return self.store.ledger

    async def start(self) -> None:
        kv = await self.bus.key_value(streams.ledger_bucket(self.run))
        self.store = await LedgerStore.open(kv, self.run)
        led = self.ledger
        log.info(
            "registry: ledger loaded (revision %d): head %s, accepted %d, running %d, k=%d B=%d",
            self.store.revision, led.head, led.accepted, led.running,
            self.cfg.max_head_offpolicyness, self.cfg.consumer_batch_size,
        )  # fmt: skip
        metrics.observe_ledger(led)
        consume = self.bus.consume
        self._tasks += [
            await consume(streams.ADAPTERS(self.run), "registry-adapters", AdapterReady,
                          self._on_adapter, batch=PULL_BATCH),
            await consume(streams.REPORTS(self.run), "registry-reports", RolloutReport,
                          self._on_report, batch=PULL_BATCH),
            await consume(streams.EXPORTS(self.run), "registry-exports", ExportDone,
                          self._on_export, batch=PULL_BATCH),
        ]  # fmt: skip
        for _ in range(self.workers):
            self._tasks.append(
                await consume(
                    streams.TRAJECTORIES(self.run), "registry-trajectories", Trajectory,
                    self._on_trajectory, batch=PULL_BATCH,
                )  # fmt: skip
            )
            self._subs.append(
                await self.bus.serve(
                    subjects.admission(self.run), AdmissionRequest, self._on_admission,
                    queue="registry",
                )  # fmt: skip
            )
        self._subs.append(
            await self.bus.serve(subjects.registry_status(self.run), StatusRequest, self._on_status)
        )
        self._tasks.append(asyncio.create_task(self._expire_loop(), name="registry-expiry"))

    async def stop(self) -> None:
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:  # connection already closed
                pass
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _commit(self) -> None:
        try:
            await self.store.commit()
        except LedgerConflict as exc:
            if not self.failed.done():
                self.failed.set_exception(exc)
            raise

    # --- handlers ----------------------------------------------------------------------

    async def _refuse(self, meta, error: str, msg) -> None:
        await self.bus.dead_letter(
            meta.subject, "validation", error, codec.encode(msg),
            msg_id=f"{meta.subject}:{meta.stream_seq}:{SERVICE}:policy",
        )  # fmt: skip

    async def _on_adapter(self, event: AdapterReady, meta) -> None:
        applied = policy.on_adapter_ready(self.ledger, event, self.cfg)
        if applied.changed:
            self.store.touch()
            await self._commit()
            metrics.observe_ledger(self.ledger)
            log.info("registry: head is now v%d", self.ledger.head)
        if applied.error:
            await self._refuse(meta, applied.error, event)

    async def _on_report(self, report: RolloutReport, meta) -> None:
        applied = policy.on_report(self.ledger, report)
        if applied.changed:
            self.store.touch()
            await self._commit()
            metrics.observe_ledger(self.ledger)
        if applied.error:
            await self._refuse(meta, applied.error, report)

    async def _on_export(self, event: ExportDone, meta) -> None:
        applied = policy.on_export_done(self.ledger, event)
        if applied.changed:
            self.store.touch()
            await self._commit()
        if applied.error:
            await self._refuse(meta, applied.error, event)

    async def _on_admission(self, request: AdmissionRequest) -> AdmissionReply:
        issued_before = self.ledger.next_grant
        reply = policy.admit(self.ledger, request, self.clock(), self.cfg)
        if isinstance(reply, AdmissionGrant):
            if self.ledger.next_grant != issued_before:
                self.store.touch()
                metrics.GRANTS.inc()
            # also covers a retried request whose grant is not stored yet
            await self._commit()
            metrics.IN_FLIGHT.set(self.ledger.running)
        else:
            # Denial counters ride along with the next write: a deny promises nothing.
            metrics.DENIALS.labels(policy.code_of(reply.reason)).inc()
        return reply

    async def _on_trajectory(self, trajectory: Trajectory, meta) -> None:
        started = time.perf_counter()
        first = policy.seen_decision(self.ledger, trajectory.trajectory_id)
        if first is None:
            decision = policy.decide(self.ledger, trajectory, self.clock(), self.cfg)
            self.store.touch()
            metrics.TRAJECTORIES.labels(decision.verdict).inc()
            if decision.oldest_version is not None:
                metrics.STALENESS.observe(decision.head_version - decision.oldest_version)
        else:
            decision = first
        await self._commit()
        # A redelivery may come from a crash between the commit and this publish, so it is
        # sent again; the msg_id makes JetStream drop it if the first one did get through.
        if decision.verdict == "accepted" and (first is None or meta.num_delivered > 1):
            await self.bus.publish(
                subjects.accepted(self.run), trajectory, msg_id=trajectory.trajectory_id
            )
        # The decision is a notification (the DECISIONS stream records it); its source of
        # truth is the ledger, and a resent trajectory gets it again.
        await self.bus.publish_core(subjects.decision(self.run, trajectory.replica), decision)
        metrics.IN_FLIGHT.set(self.ledger.running)
        metrics.DECISION_SECONDS.observe(time.perf_counter() - started)

    async def _on_status(self, request: StatusRequest) -> RegistryStatus:
        import msgspec

        led = self.ledger
        return RegistryStatus(
            run=self.run,
            ledger=msgspec.structs.replace(led, seen={}),
            seen_count=len(led.seen),
            capacity=max(0, policy.capacity(led, self.cfg)),
            max_head_offpolicyness=self.cfg.max_head_offpolicyness,
            consumer_batch_size=self.cfg.consumer_batch_size,
            max_concurrent_rollouts=self.cfg.max_concurrent_rollouts,
            ledger_revision=self.store.revision,
            sent_at=self.clock(),
        )

    async def _expire_loop(self) -> None:
        period = min(1.0, self.cfg.lease_seconds / 4)
        while True:
            await asyncio.sleep(period)
            gone = policy.expire(self.ledger, self.clock())
            if gone:
                log.info("registry: %d grant(s) expired: %s", len(gone), ", ".join(gone[:5]))
                self.store.touch()
                try:
                    await self._commit()
                except LedgerConflict:
                    return
                except Exception as exc:  # transient: the next change retries the write
                    log.warning("registry: ledger write after expiry failed: %r", exc)
                metrics.IN_FLIGHT.set(self.ledger.running)
