"""The registry's ledger on disk: a snapshot plus a journal of policy inputs, in one KV stream.

The policy is deterministic given its inputs (`policy` has no clock and no I/O), so the
durable form of the ledger is the list of inputs it was fed, each with the `now` it was given:
replaying them through the same policy functions rebuilds the same ledger. A journal entry is
one batch of such inputs (an admission request, a trajectory's `DecisionInput`, an adapter
event, a report, an expiry tick), a few hundred bytes where a full snapshot is tens of KB.

Everything lives in the run's KV bucket stream (`KV_<bucket>`), so the registry needs no rights
beyond the `$KV.*.>` it already has:

- `$KV.<bucket>.journal.<seq>`: one entry per group commit (a distinct key each, so the
  bucket's history=1 keeps them all);
- `$KV.<bucket>.ledger`: a `Snapshot` (ledger + the `PolicyConfig` its entries were decided
  under), published with `Nats-Rollup: all`, which makes the server drop every older message
  of the stream: each snapshot compacts the journal in the same write that replaces it.

One writer, one write in flight, every write with `Nats-Expected-Last-Sequence`: the stream is
a strict sequence [snapshot][entry]...[entry][snapshot][entry]..., a second registry for the
same run makes the first one's next write fail (it stops instead of interleaving), and a
retried write whose ack was lost is recognised by its `Nats-Msg-Id`. A restart reads the last
snapshot and the entries after it and replays them with the snapshot's config, then writes a
fresh snapshot under its own config before anything else, so that entries following a
snapshot were always decided under that snapshot's config.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

import msgspec
from msgspec import Struct

from proto.messages import (
    AdapterReady,
    AdmissionRequest,
    ExportDone,
    RolloutReport,
)
from services.common.bus import TRANSIENT_ERRORS, Bus, SequenceMismatch
from services.registry import metrics, policy
from services.registry.policy import DecisionInput, Ledger, PolicyConfig

log = logging.getLogger(__name__)

SNAPSHOT_KEY = "ledger"
JOURNAL_PREFIX = "journal"
SNAPSHOT_EVERY = 512
"""journal entries between snapshots: bounds the replay after a restart to a few thousand ops
while keeping the snapshot's cost (encode the whole ledger) off almost every commit"""
RETRY_FOR_S = 30.0
"""how long a write keeps retrying while the server is unreachable before the registry stops
(its memory then holds changes it cannot persist; a restart rebuilds from what was stored)"""


class LedgerConflict(RuntimeError):
    """Another writer changed the ledger: a second registry is running for this run."""


# --- what the journal records ---------------------------------------------------------------


class AdmitOp(Struct, tag="admit", array_like=True):
    request: AdmissionRequest
    now: float


class DecideOp(Struct, tag="decide", array_like=True):
    input: DecisionInput
    now: float


class ExpireOp(Struct, tag="expire", array_like=True):
    now: float


class AdapterOp(Struct, tag="adapter", array_like=True):
    event: AdapterReady


class ReportOp(Struct, tag="report", array_like=True):
    report: RolloutReport
    now: float | None = None
    """when the registry received it (None in journals written before liveness tracking)"""


class ExportOp(Struct, tag="export", array_like=True):
    event: ExportDone


Op = AdmitOp | DecideOp | ExpireOp | AdapterOp | ReportOp | ExportOp


class Entry(Struct):
    ops: list[Op]


class Snapshot(Struct, kw_only=True):
    ledger: Ledger
    cfg: PolicyConfig
    """the config the entries after this snapshot were decided under (replay uses it)"""
    revision: int
    """journal entries ever committed for this run (the operator-visible ledger revision)"""


def apply(ledger: Ledger, op: Op, cfg: PolicyConfig):
    """Feed one input to the policy; the live path and the replay both go through here."""
    if type(op) is AdmitOp:
        if op.request.run == ledger.run:
            policy.heard_from(ledger, op.request.replica, op.now)
        return policy.admit(ledger, op.request, op.now, cfg)
    if type(op) is DecideOp:
        return policy.decide_input(ledger, op.input, op.now, cfg)
    if type(op) is ExpireOp:
        return policy.expire(ledger, op.now) + policy.release_silent(ledger, op.now, cfg)
    if type(op) is AdapterOp:
        return policy.on_adapter_ready(ledger, op.event, cfg)
    if type(op) is ReportOp:
        if op.now is not None and op.report.run == ledger.run:
            policy.heard_from(ledger, op.report.replica, op.now)
        return policy.on_report(ledger, op.report)
    if type(op) is ExportOp:
        return policy.on_export_done(ledger, op.event)
    raise TypeError(f"op: unexpected type {type(op).__name__}")


_entry_encoder = msgspec.json.Encoder()
_entry_decoder = msgspec.json.Decoder(Entry)
_snapshot_decoder = msgspec.json.Decoder(Snapshot)


def encode_entry(ops: list[Op]) -> bytes:
    return _entry_encoder.encode(Entry(ops))


def decode_entry(data: bytes) -> Entry:
    return _entry_decoder.decode(data)


def encode_snapshot(snapshot: Snapshot) -> bytes:
    return _entry_encoder.encode(snapshot)


def decode_snapshot(data: bytes) -> Snapshot:
    try:
        return _snapshot_decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise ValueError(
            f"ledger: the stored snapshot is not in this registry's format ({exc}); it was "
            "written by an older registry: delete the run's ledger bucket to start afresh"
        ) from exc


# --- the journal ----------------------------------------------------------------------------


class _Batch:
    """Ops applied since the last write was taken, and what may leave once they are stored."""

    __slots__ = ("ops", "outbox", "done")

    def __init__(self) -> None:
        self.ops: list[Op] = []
        self.outbox: list[tuple[str, bytes]] = []
        self.done: asyncio.Future | None = None


class Journal:
    """The in-memory ledger and its durable journal, written by group commit.

    `apply(op)` changes the ledger at once (so the next request sees it); `commit()` returns
    once every op applied before the call is stored; `send_after_commit(subject, data)` queues
    a core publish (an admission reply) that leaves right after that store. One write is in
    flight at a time and carries every op applied while the previous one was in flight.
    """

    def __init__(self, bus: Bus, bucket: str, ledger: Ledger, cfg: PolicyConfig, *, seq: int,
                 revision: int, snapshot_every: int = SNAPSHOT_EVERY):  # fmt: skip
        self.bus = bus
        self.stream = f"KV_{bucket}"
        self.prefix = f"$KV.{bucket}."
        self.ledger = ledger
        self.cfg = cfg
        self.seq = seq
        """the stream's last sequence, as of our last write (the compare-and-set base)"""
        self.revision = revision
        self.snapshot_every = snapshot_every
        self.entries_since_snapshot = 0
        self.fatal: BaseException | None = None
        self.replayed = 0
        """journal entries replayed at open"""
        self.snapshots = 0
        self._token = os.urandom(6).hex()  # makes our Nats-Msg-Ids distinct from a predecessor's
        self._batch = _Batch()
        self._writer: asyncio.Task | None = None

    # --- opening: snapshot + replay ---------------------------------------------------------

    @classmethod
    async def open(cls, bus: Bus, bucket: str, run: str, cfg: PolicyConfig, **kw) -> Journal:
        await bus.key_value(bucket)  # creates the bucket (and its stream) if missing
        stream, prefix = f"KV_{bucket}", f"$KV.{bucket}."
        last = await bus.last_seq(stream)
        raw = await bus.last_raw(stream, prefix + SNAPSHOT_KEY)
        if raw is not None:
            snap = decode_snapshot(raw.data)
            start = raw.seq + 1
        else:
            snap = Snapshot(ledger=policy.new_ledger(run), cfg=cfg, revision=0)
            start = 1
        if snap.ledger.run != run:
            raise ValueError(
                f"ledger: bucket holds the ledger of run {snap.ledger.run!r}, not {run!r}; "
                "each run needs its own bucket (streams.ledger_bucket)"
            )
        ledger, revision, replayed = snap.ledger, snap.revision, 0
        seq = start
        while seq <= last:
            raw = await bus.message(stream, seq, prefix + JOURNAL_PREFIX + ".>")
            if raw is None:
                break
            for op in decode_entry(raw.data).ops:
                apply(ledger, op, snap.cfg)
            revision += 1
            replayed += 1
            seq = raw.seq + 1
        journal = cls(bus, bucket, ledger, cfg, seq=last, revision=revision, **kw)
        journal.replayed = replayed
        # From here on, entries are decided under `cfg`: record that before writing any.
        await journal._write(journal._snapshot_bytes(), SNAPSHOT_KEY, rollup=True)
        return journal

    # --- the live path ----------------------------------------------------------------------

    def apply(self, op: Op):
        if self.fatal is not None:
            raise self.fatal
        result = apply(self.ledger, op, self.cfg)
        self._batch.ops.append(op)
        return result

    def send_after_commit(self, subject: str, data: bytes) -> None:
        self._batch.outbox.append((subject, data))
        self._kick()

    async def commit(self) -> None:
        if self.fatal is not None:
            raise self.fatal
        batch = self._batch
        if not batch.ops and self._writer is None:
            return  # nothing applied and nothing in flight: all is stored
        if batch.done is None:
            batch.done = asyncio.get_running_loop().create_future()
        self._kick()
        await asyncio.shield(batch.done)

    def _kick(self) -> None:
        if self._writer is None and self.fatal is None:
            self._writer = asyncio.create_task(self._write_loop(), name="ledger-writer")

    async def _write_loop(self) -> None:
        try:
            while True:
                batch = self._batch
                if not (batch.ops or batch.outbox or batch.done):
                    return
                self._batch = _Batch()
                try:
                    if batch.ops:
                        await self._store(batch.ops)
                except BaseException as exc:
                    fatal = self.fatal = exc if isinstance(exc, Exception) else RuntimeError(repr(exc))
                    if batch.done is not None and not batch.done.done():
                        batch.done.set_exception(fatal)
                    self._fail_pending(fatal)
                    if not isinstance(exc, Exception):
                        raise
                    return
                for subject, data in batch.outbox:
                    await self.bus.send_raw(subject, data)
                if batch.done is not None and not batch.done.done():
                    batch.done.set_result(None)
        finally:
            self._writer = None

    def _fail_pending(self, fatal: BaseException) -> None:
        batch, self._batch = self._batch, _Batch()
        if batch.done is not None and not batch.done.done():
            batch.done.set_exception(fatal)

    async def _store(self, ops: list[Op]) -> None:
        self.revision += 1
        if self.entries_since_snapshot + 1 >= self.snapshot_every:
            # ledger == stored state + `ops` right now (one write in flight, and it is done)
            await self._write(self._snapshot_bytes(), SNAPSHOT_KEY, rollup=True)
        else:
            await self._write(encode_entry(ops), f"{JOURNAL_PREFIX}.{self.seq + 1}")
            self.entries_since_snapshot += 1

    def _snapshot_bytes(self) -> bytes:
        return encode_snapshot(Snapshot(ledger=self.ledger, cfg=self.cfg, revision=self.revision))

    async def _write(self, data: bytes, key: str, *, rollup: bool = False) -> None:
        msg_id = f"{self._token}:{self.seq + 1}"
        deadline = time.monotonic() + RETRY_FOR_S
        delay = 0.05
        while True:
            try:
                self.seq = await self._publish_once(self.prefix + key, data, msg_id, rollup)
                break
            except TRANSIENT_ERRORS as exc:
                if time.monotonic() + delay >= deadline:
                    raise
                log.warning("registry: ledger write failed (%r); retrying", exc)
                await asyncio.sleep(delay)
                delay = min(2 * delay, 1.0)
        if rollup:
            self.entries_since_snapshot = 0
            self.snapshots += 1
        metrics.LEDGER_WRITES.inc()

    async def _publish_once(self, subject: str, data: bytes, msg_id: str, rollup: bool) -> int:
        try:
            return await self.bus.publish_expect(subject, data, expected_last_seq=self.seq,
                                                 msg_id=msg_id, rollup=rollup)  # fmt: skip
        except SequenceMismatch as exc:
            # Our previous attempt may have been stored with its ack lost: then the message
            # after our last known sequence is ours and we adopt it; else another writer.
            last = await self.bus.message(self.stream, self.seq + 1)
            if last is None or (last.headers or {}).get("Nats-Msg-Id") != msg_id:
                raise LedgerConflict(
                    f"ledger: stream {self.stream} was written by someone else after "
                    f"sequence {self.seq}; is a second registry running for this run? Stopping."
                ) from exc
            return last.seq
