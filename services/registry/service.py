"""The registry's bus service: feeds events into its policy through the journal, answers.

One rule keeps it crash-safe: nothing leaves the registry (an ack, a grant, a decision, an
accepted trajectory) before the ledger state it was derived from is stored. A kill -9 at any
point therefore loses only work that was never acknowledged, which JetStream redelivers (or
the rollout re-requests, getting its grant back by request_id).

Throughput comes from batching every step around that rule, not from weakening it:

- Persistence (`persistence.Journal`): a group commit writes one small journal entry (the
  policy inputs applied since the last write, ~100 bytes each) instead of the whole ledger,
  and a full snapshot every `SNAPSHOT_EVERY` entries, which also compacts the journal
  (Nats-Rollup). A restart replays at most that many entries. The trade-off: the stored form
  is only meaningful together with this policy code (a replay re-runs the decisions), so a
  policy change that alters decisions for the same inputs must come with a snapshot format
  bump; the snapshot records the config the following entries were decided under.
- Admissions: one direct subscription whose callback (in the connection's read loop) decides
  synchronously and queues the reply on the journal's outbox; the writer sends every queued
  reply right after the write that covers it. Denials promise nothing and leave at once.
- Trajectories: one pull loop keeps a pull request of `PULL_BATCH` open (the server delivers
  as messages arrive, no linger), takes whatever burst has arrived, decides all of it, waits
  for one commit, publishes the decisions and republishes the accepted ones' original bytes
  with async JetStream publishes (one write for both), then, with every PubAck gathered,
  acks each message (a decision whose PubAck did not come is nak'd and sent again: a core
  publish, as decisions were until issue 30, is dropped unseen by a replicated stream that is
  electing its leader).
  The pull request stays open between bursts (`Bus.pull(keep_open=True)`); the delivery
  policy (dead letters, retries) is the bus's, as for every consumer.

Writes are compare-and-set on the stream sequence: a second registry for the same run makes
the first one's next write fail, and it stops instead of interleaving with the other.

Measured (benchmarks/results/registry*.json): ~105-115 us of registry CPU per admission +
decision on 2 shared cores in the round before this one (0.73x the code before it). This round
takes nats-py's per-message path off the small messages (`Bus.subscribe_direct` for the
admissions, pull deliveries and PubAcks; `publish_many` for a burst's grants, decisions and
acks), decodes what `encode` wrote in one pass, and sends the decisions with the accepted
copies instead of a PubAck round trip later: 0.84-0.88x main's registry CPU per decision and
1.10-1.15x its decisions/s in the same command at load 5-7 (24 clients per registry, as on the
16-core host, and 64 on one). The hot path labels its metrics once, counts them per burst,
screens logprobs at C speed and runs on uvloop. Past one process it scales out as one registry
process per run (the ledger, journal, streams and policy are per run, so they share nothing):
6 runs gave 20.8k/s with p99 7.4 ms on the 16-core GPU host (1.05x the previous round's code
in the same command, registry CPU 0.87x), with the host's CPUs the limit. Splitting one run's
capacity across processes is not done: it would strand capacity in idle slices, and one run
needs far less than a process gives.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import secrets
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import msgspec
from nats.aio.subscription import Subscription

from proto import codec, subjects
from proto.messages import (
    AdapterReady,
    AdmissionGrant,
    AdmissionRequest,
    ExportDone,
    RolloutReport,
    Trajectory,
)
from services.common import streams
from services.common.bus import Bus, MsgMeta, Raw, decode
from services.common.pull import Delivery, Puller, ack_all
from services.registry import metrics
from services.registry.persistence import Journal, LedgerConflict
from services.registry.policy import Grant, Ledger, PolicyConfig, code_of
from services.registry.status import RegistryStatus, StatusRequest

__all__ = ["LedgerConflict", "RegistryService"]

log = logging.getLogger(__name__)

SERVICE = "registry"
PULL_BATCH = 256
"""messages one open pull request may deliver; a burst is whatever has arrived of it"""
PUBLISH_TIMEOUT_S = 10.0


GRANT_TOKEN_BYTES = 18
"""random bytes in a grant id's token (144 bits: unguessable; url-safe base64, 24 characters)"""


def new_grant_token() -> str:
    return secrets.token_urlsafe(GRANT_TOKEN_BYTES)


def hidden_grants(ledger: Ledger) -> dict[str, Grant]:
    """The grants as `registry status` shows them: keyed by a digest, never by the id that
    would let its reader send trajectories under them."""
    return {f"#{hashlib.sha256(gid.encode()).hexdigest()[:12]}": g for gid, g in ledger.grants.items()}


def sender_problem(report: RolloutReport, subject: str) -> str | None:
    """A report counts only on its own replica's subject and kind: with NATS auth only that
    replica may publish there, which the payload cannot prove."""
    try:
        _, replica, kind = subjects.parse_rollout_report(subject)
    except subjects.SubjectError as exc:
        return f"subject: {exc}"
    tag = type(report).__struct_config__.tag
    if replica != report.replica or kind != tag:
        return (
            f"sender: a {tag} report of replica {report.replica!r} arrived on {subject!r}; a replica "
            "reports only on lorabus.<run>.rollout.<its id>.<kind>"
        )
    return None


async def stop_serving(subs: Sequence[Subscription], tasks: Sequence[asyncio.Task]) -> None:
    """Unsubscribe `subs` and cancel `tasks`, waiting until every task has ended; a closed
    connection is not an error here (the service is stopping either way)."""
    for sub in subs:
        with contextlib.suppress(Exception):  # connection already closed
            await sub.unsubscribe()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class RegistryService:
    def __init__(self, bus: Bus, cfg: PolicyConfig, *, clock: Callable[[], float] = time.time,
                 snapshot_every: int | None = None):  # fmt: skip
        self.bus = bus
        self.run = bus.run
        self.cfg = cfg
        self.clock = clock
        self.snapshot_every = snapshot_every
        self._journal: Journal | None = None
        self.failed: asyncio.Future = asyncio.get_running_loop().create_future()
        self._tasks: list[asyncio.Task] = []
        self._sending: set[asyncio.Task] = set()
        self._subs: list[Subscription] = []
        self._puller: Puller[Trajectory] | None = None
        self._accepted = subjects.accepted(self.run)
        self._encode = msgspec.json.Encoder().encode

    @property
    def journal(self) -> Journal:
        if self._journal is None:
            raise RuntimeError("registry: the journal opens in start(); call it first")
        return self._journal

    @property
    def ledger(self) -> Ledger:
        return self.journal.ledger

    async def start(self) -> None:
        kw = {} if self.snapshot_every is None else {"snapshot_every": self.snapshot_every}
        self._journal = await Journal.open(self.bus, streams.ledger_bucket(self.run), self.run, self.cfg,
                                           on_fatal=self._fail, **kw)  # fmt: skip
        led = self.ledger
        log.info(
            "registry: ledger loaded (revision %d, %d journal entries replayed): head %s, "
            "accepted %d, running %d, k=%d B=%d",
            self.journal.revision, self.journal.replayed, led.head, led.accepted, led.running,
            self.cfg.max_head_offpolicyness, self.cfg.consumer_batch_size,
        )  # fmt: skip
        metrics.observe_ledger(self.run, led)
        bus, run = self.bus, self.run
        self._tasks += [
            bus.dispatch(await bus.pull(streams.consumer(run, "registry-adapters"), AdapterReady, batch=16),
                         self._on_adapter),
            bus.dispatch(await bus.pull(streams.consumer(run, "registry-reports"), RolloutReport, batch=64),
                         self._on_report),
            bus.dispatch(await bus.pull(streams.consumer(run, "registry-exports"), ExportDone, batch=16),
                         self._on_export),
        ]  # fmt: skip
        puller: Puller[Trajectory] = await bus.pull(streams.consumer(run, "registry-trajectories"), Trajectory,
                                                    batch=PULL_BATCH, keep_open=True)  # fmt: skip
        self._puller = puller
        self._tasks.append(asyncio.create_task(self._trajectory_loop(puller), name="registry-trajectories"))
        self._subs.append(await bus.subscribe_direct(subjects.admission(run), self._on_admission, queue="registry"))
        self._subs.append(await self.bus.serve(subjects.registry_status(self.run), StatusRequest, self._on_status))
        self._tasks.append(asyncio.create_task(self._expire_loop(), name="registry-expiry"))

    async def stop(self) -> None:
        await stop_serving(self._subs, self._tasks)
        if self._puller is not None:
            await self._puller.stop()

    def _fail(self, exc: BaseException) -> None:
        if not self.failed.done():
            self.failed.set_exception(exc)

    async def _commit(self) -> None:
        try:
            await self.journal.commit()
        except Exception as exc:
            # The journal stops on a conflict or a write it could not make: its memory may
            # hold changes that are not stored, so the process must restart from the store.
            self._fail(exc)
            raise

    # --- rare events (one at a time through Bus.consume) ------------------------------------

    async def _refuse(self, meta: MsgMeta, error: str, msg: msgspec.Struct) -> None:
        await self.bus.dead_letter(
            meta.subject, "validation", error, codec.encode(msg),
            msg_id=f"{meta.subject}:{meta.stream_seq}:{SERVICE}:policy",
        )  # fmt: skip

    async def _on_adapter(self, event: AdapterReady, meta: MsgMeta) -> None:
        applied = self.journal.adapter_ready(event)
        if applied.changed:
            await self._commit()
            metrics.observe_ledger(self.run, self.ledger)
            log.info("registry: head is now v%d", self.ledger.head)
        if applied.error:
            await self._refuse(meta, applied.error, event)

    async def _on_report(self, report: RolloutReport, meta: MsgMeta) -> None:
        if (problem := sender_problem(report, meta.subject)) is not None:
            await self._refuse(meta, problem, report)
            return
        applied = self.journal.report(report, self.clock())
        if applied.changed:
            await self._commit()
            metrics.observe_ledger(self.run, self.ledger)
        if applied.error:
            await self._refuse(meta, applied.error, report)

    async def _on_export(self, event: ExportDone, meta: MsgMeta) -> None:
        applied = self.journal.export_done(event)
        if applied is None:  # the bus retries it with backoff
            raise RuntimeError(f"export of v{event.version}: its adapter event is not recorded yet")
        if applied.changed:
            await self._commit()
        if applied.error:
            await self._refuse(meta, applied.error, event)

    # --- admissions -------------------------------------------------------------------------

    def _on_admission(self, msg: Raw) -> None:
        """Runs in the connection's read loop (`Bus.subscribe_direct`): decides at once, and
        leaves what must wait (a denial's send, a dead letter) to a task."""
        try:
            request = decode(msg.data, AdmissionRequest)
        except codec.DecodeError as exc:
            self._later(self.bus.dead_letter_quietly(msg.subject, exc.reason, str(exc), msg.data))
            return
        if self.journal.fatal is not None:
            return  # stopping: the service's `failed` says why
        try:
            reply = self.journal.admit(request, self.clock(), new_grant_token())
        except Exception as exc:
            log.exception("registry: admission failed")
            self._later(self.bus.dead_letter_quietly(msg.subject, "handler", repr(exc), msg.data))
            return
        if not msg.reply:
            return
        if isinstance(reply, AdmissionGrant):
            metrics.GRANTS.labels(self.run).inc()  # a retried request's grant counts again: it is sent again
            # also covers a retried request whose grant is still in flight to the store
            self.journal.send_after_commit(msg.reply, self._encode(reply))
        else:
            metrics.DENIALS.labels(self.run, code_of(reply.reason)).inc()
            self._later(self.bus.send_raw(msg.reply, self._encode(reply)))

    def _later(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._sending.add(task)  # held until done: the loop keeps only a weak reference
        task.add_done_callback(self._sending.discard)

    # --- trajectories -----------------------------------------------------------------------

    async def _trajectory_loop(self, puller: Puller[Trajectory]) -> None:
        while True:
            deliveries = await puller.burst()
            try:
                await self._decide_burst(deliveries)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # not acked: JetStream redelivers after ack_wait
                log.warning("registry: burst of %d trajectories not finished: %r", len(deliveries), exc)
                if self.journal.fatal is not None:
                    return

    async def _decide_burst(self, deliveries: list[Delivery[Trajectory]]) -> None:
        started = time.perf_counter()
        decided = []  # (delivery, decision, republish?)
        verdicts: dict[str, int] = {}
        now = self.clock()
        for d in deliveries:
            trajectory = d.msg
            try:
                sender = subjects.parse_trajectory(d.meta.subject)[1]
                decision, new = self.journal.decide(trajectory, sender, now)
                if new:
                    verdicts[decision.verdict] = verdicts.get(decision.verdict, 0) + 1
                    if decision.verdict != "accepted":
                        metrics.REJECTIONS.labels(self.run, code_of(decision.reason)).inc()
                    if decision.oldest_version is not None:
                        metrics.STALENESS.labels(self.run).observe(decision.head_version - decision.oldest_version)
            except Exception as exc:
                log.exception("registry: deciding %s failed", d.meta.subject)
                await d.retry(repr(exc))
                continue
            # A redelivery may come from a crash between the commit and the republish, so it
            # is sent again; the msg_id makes JetStream drop it if the first one got through.
            again = decision.verdict == "accepted" and (new or d.meta.num_delivered > 1)
            decided.append((d, decision, again))
        for verdict, n in verdicts.items():
            metrics.verdict_count(self.run, verdict).inc(n)
        if not decided:
            return
        await self._commit()
        # The decisions (the DECISIONS stream's record; their source of truth is the ledger,
        # just stored) and the accepted copies leave together, and their PubAcks are gathered
        # together: one round trip a burst. A decision is stored, not only sent: a core publish
        # that meets a stream electing its leader (a cluster's node lost) is dropped unseen.
        # What was not stored is nak'd: the redelivery sends the same decision and copy again,
        # and the trajectory's id as msg id makes JetStream keep one of each.
        resend = [d for d, _, again in decided if again]
        sent = [(subjects.decision(self.run, d.msg.replica), self._encode(decision), d.msg.trajectory_id)
                for d, decision, _ in decided]  # fmt: skip
        sent += [(self._accepted, d.data, d.msg.trajectory_id) for d in resend]
        acks = await self.bus.publish_all(sent, timeout=PUBLISH_TIMEOUT_S)
        failed = set()
        for d, (subject, _, _), ack in zip([d for d, _, _ in decided] + resend, sent, acks):
            if isinstance(ack, BaseException):
                log.warning("registry: %s for %s not stored: %r", subject, d.meta.subject, ack)
                failed.add(id(d))
        for d, _, _ in decided:
            if id(d) in failed:
                await d.nak(delay=1.0)
        await ack_all([d for d, _, _ in decided])
        metrics.IN_FLIGHT.labels(self.run).set(self.ledger.running)
        elapsed = time.perf_counter() - started
        for _ in decided:
            metrics.DECISION_SECONDS.labels(self.run).observe(elapsed)

    # --- status and expiry ------------------------------------------------------------------

    async def _on_status(self, request: StatusRequest) -> RegistryStatus:
        led = self.ledger
        return RegistryStatus(
            run=self.run,
            ledger=msgspec.structs.replace(led, seen={}, grants=hidden_grants(led), grant_by_request={}),
            seen_count=len(led.seen),
            capacity=max(0, self.journal.capacity()),
            max_head_offpolicyness=self.cfg.max_head_offpolicyness,
            consumer_batch_size=self.cfg.consumer_batch_size,
            max_concurrent_rollouts=self.cfg.max_concurrent_rollouts,
            ledger_revision=self.journal.revision,
            sent_at=self.clock(),
        )

    async def _expire_loop(self) -> None:
        period = min(1.0, self.cfg.lease_seconds / 4)
        while True:
            await asyncio.sleep(period)
            gone = self.journal.expire(self.clock())
            if not gone:
                continue  # nothing was due: nothing journaled (the common case)
            log.info("registry: %d grant(s) expired or held by silent replicas: %s", len(gone), ", ".join(gone[:5]))
            try:
                await self._commit()
            except Exception:
                return
            metrics.IN_FLIGHT.labels(self.run).set(self.ledger.running)
