"""The registry's ledger on disk: a snapshot plus a journal of policy inputs, in one KV stream.

The policy is deterministic given its inputs (`policy` has no clock and no I/O), so the
durable form of the ledger is the list of inputs it was fed, each with the `now` it was given:
replaying them through the same policy functions rebuilds the same ledger. A journal entry is
one batch of such inputs (an admission request, a trajectory's `DecisionInput`, an adapter
event, a report, an expiry tick), a few hundred bytes where a full snapshot is tens of KB.

Everything lives in two KV buckets of the run (`KV_<bucket>` and `KV_<bucket>_parts`), so the
registry needs no rights beyond the `$KV.*.>` it already has. No stored message can outgrow
a NATS message, however large the ledger: every piece is at most PIECE_BYTES.

- `$KV.<bucket>.journal.<seq>`: the ops of a group commit, split into entries of at most
  PIECE_BYTES (a distinct key each, so the bucket's history=1 keeps them all);
- `$KV.<bucket>_parts.<slot>.<i>`: a `Snapshot` (ledger + the `PolicyConfig` its entries were
  decided under) cut into pieces, in slot `a` or `b`, the one the current snapshot does not use
  (history=1 replaces a key's old piece);
- `$KV.<bucket>.ledger`: a `SnapshotRef` (slot, pieces, sha256) published after its pieces with
  `Nats-Rollup: all`, which makes the server drop every older message of the journal stream:
  each snapshot compacts the journal in the same write that switches to it. A crash while the
  pieces are written leaves the previous snapshot (other slot) and its journal intact.

One writer, one write in flight, every write with `Nats-Expected-Last-Sequence`: the stream is
a strict sequence [snapshot][entry]...[entry][snapshot][entry]..., a second registry for the
same run makes the first one's next write fail (it stops instead of interleaving), and a
retried write whose ack was lost is recognised by its `Nats-Msg-Id`: JetStream answers it as a
duplicate with the first attempt's sequence, or "still in process" (409) while that attempt is
being replicated, which is waited out like a leader election (`nats_client.transient`). A restart reads the last
snapshot and the entries after it and replays them with the snapshot's config, then writes a
fresh snapshot under its own config before anything else, so that entries following a
snapshot were always decided under that snapshot's config.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from collections.abc import Callable
from functools import partial

import msgspec
from msgspec import Struct

from proto.messages import (
    AdapterReady,
    AdmissionDeny,
    AdmissionGrant,
    AdmissionRequest,
    ExportDone,
    ReplicaHeartbeat,
    RolloutReport,
    Trajectory,
    TrajectoryDecision,
)
from services.common import streams
from services.common.bus import Bus, SequenceMismatch
from services.common.nats_client import retrying
from services.registry import metrics, policy
from services.registry.policy import AdapterFacts, DecisionInput, Ledger, PolicyConfig

log = logging.getLogger(__name__)

SNAPSHOT_KEY = "ledger"
JOURNAL_PREFIX = "journal"
PIECE_BYTES = 256 * 1024
"""the largest stored message (a journal entry or a snapshot piece): far under NATS' 1 MiB
max_payload, and every op is far smaller (its inputs are bounded by `proto.messages`)"""
SNAPSHOT_EVERY = 512
"""journal entries between snapshots: bounds the replay after a restart to a few thousand ops
while keeping the snapshot's cost (encode the whole ledger) off almost every commit"""
RETRY_FOR_S = 30.0
"""how long a write keeps retrying while the server is unreachable or its cluster recovers
before the registry stops (its memory then holds changes it cannot persist; a restart rebuilds
from what was stored)"""


class LedgerConflict(RuntimeError):
    """Another writer changed the ledger: a second registry is running for this run."""


# --- what the journal records ---------------------------------------------------------------


class AdmitOp(Struct, tag="admit", array_like=True):
    request: AdmissionRequest
    now: float
    token: str = ""
    """the random part of a new grant's id (drawn by the service, journaled for the replay)"""


class DecideOp(Struct, tag="decide", array_like=True):
    input: DecisionInput
    now: float


class ExpireOp(Struct, tag="expire", array_like=True):
    now: float


class AdapterOp(Struct, tag="adapter", array_like=True):
    event: AdapterFacts


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


class SnapshotRef(Struct, kw_only=True):
    """The `ledger` key: where the current snapshot's pieces are."""

    slot: str
    pieces: int
    sha256: str


def apply(ledger: Ledger, op: Op, cfg: PolicyConfig):
    """Feed one input to the policy; the live path and the replay both go through here."""
    if type(op) is AdmitOp:
        if op.request.run == ledger.run:
            policy.heard_from(ledger, op.request.replica, op.now, op.request.started_at)
        return policy.admit(ledger, op.request, op.now, cfg, op.token)
    if type(op) is DecideOp:
        return policy.decide_input(ledger, op.input, op.now, cfg)
    if type(op) is ExpireOp:
        return policy.expire(ledger, op.now) + policy.release_silent(ledger, op.now, cfg)
    if type(op) is AdapterOp:
        return policy.on_adapter_ready(ledger, op.event, cfg)
    if type(op) is ReportOp:
        if op.now is not None and op.report.run == ledger.run:
            started_at = op.report.started_at if isinstance(op.report, ReplicaHeartbeat) else None
            policy.heard_from(ledger, op.report.replica, op.now, started_at)
        return policy.on_report(ledger, op.report)
    if type(op) is ExportOp:
        return policy.on_export_done(ledger, op.event)
    raise TypeError(f"op: unexpected type {type(op).__name__}")


_entry_encoder = msgspec.json.Encoder()
_entry_decoder = msgspec.json.Decoder(Entry)
_snapshot_decoder = msgspec.json.Decoder(Snapshot)
_ref_decoder = msgspec.json.Decoder(SnapshotRef)


def encode_entry(ops: list[Op]) -> bytes:
    return _entry_encoder.encode(Entry(ops))


def encode_entries(ops: list[Op], limit: int = PIECE_BYTES) -> list[bytes]:
    """`ops` as journal entries of at most `limit` bytes each, in order."""
    entries: list[bytes] = []
    chunk: list[bytes] = []
    size = 0
    for op in ops:
        data = _entry_encoder.encode(op)
        if len(data) + 16 > limit:
            raise ValueError(f"journal: one {type(op).__name__} encodes to {len(data)} bytes, over {limit}")
        if chunk and size + len(data) + 16 > limit:
            entries.append(b'{"ops":[' + b",".join(chunk) + b"]}")
            chunk, size = [], 0
        chunk.append(data)
        size += len(data) + 1
    if chunk:
        entries.append(b'{"ops":[' + b",".join(chunk) + b"]}")
    return entries


def pieces(data: bytes, limit: int = PIECE_BYTES) -> list[bytes]:
    return [data[i : i + limit] for i in range(0, len(data), limit)] or [b""]


def decode_entry(data: bytes) -> Entry:
    return _entry_decoder.decode(data)


def encode_snapshot(snapshot: Snapshot) -> bytes:
    return _entry_encoder.encode(snapshot)


def parts_bucket(bucket: str) -> str:
    """The bucket holding the snapshot pieces of ledger bucket `bucket`."""
    return f"{bucket}_parts"


def decode_ref(data: bytes) -> SnapshotRef:
    try:
        return _ref_decoder.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ValueError(
            f"ledger: the stored snapshot reference is not in this registry's format ({exc}); it "
            "was written by an older registry: delete the run's ledger buckets to start afresh"
        ) from exc


async def read_snapshot(bus: Bus, bucket: str) -> tuple[Snapshot, int, str] | None:
    """The stored snapshot, the journal sequence of its reference and its slot; None if none."""
    raw = await bus.last_raw(streams.kv_stream(bucket), streams.kv_subject(bucket, SNAPSHOT_KEY))
    if raw is None:
        return None
    ref = decode_ref(raw.data)
    return decode_snapshot(await _read_pieces(bus, bucket, ref)), raw.seq, ref.slot


async def _read_pieces(bus: Bus, bucket: str, ref: SnapshotRef) -> bytes:
    stream, prefix = streams.kv_stream(parts_bucket(bucket)), streams.kv_subject(parts_bucket(bucket))
    chunks = []
    for i in range(ref.pieces):
        raw = await bus.last_raw(stream, f"{prefix}{ref.slot}.{i}")
        if raw is None:
            raise ValueError(f"ledger: snapshot piece {ref.slot}.{i} of {ref.pieces} is missing from {stream}")
        chunks.append(raw.data)
    data = b"".join(chunks)
    if hashlib.sha256(data).hexdigest() != ref.sha256:
        raise ValueError(f"ledger: the snapshot pieces in slot {ref.slot} do not match their sha256 {ref.sha256}")
    return data


def decode_snapshot(data: bytes) -> Snapshot:
    try:
        return _snapshot_decoder.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
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

    It is the registry's one door into its policy: the service and the fleet ask (`capacity`,
    `can_grant`) and change (`admit`, `decide`, `adapter_ready`, `report`, `export_done`,
    `expire`) only through it, so every change is a journaled op that a replay makes again, and
    what skips the journal (a remembered decision, a tick with nothing due) is decided here.
    `apply(op)` changes the ledger at once (so the next request sees it); `commit()` returns
    once every op applied before the call is stored; `send_after_commit(subject, data)` queues
    a core publish (an admission reply) that leaves right after that store. One write is in
    flight at a time and carries every op applied while the previous one was in flight.
    """

    def __init__(self, bus: Bus, bucket: str, ledger: Ledger, cfg: PolicyConfig, *, seq: int,
                 revision: int, snapshot_every: int = SNAPSHOT_EVERY, slot: str = "b",
                 on_fatal: Callable[[BaseException], None] | None = None):  # fmt: skip
        self.bus = bus
        self.stream = streams.kv_stream(bucket)
        self.prefix = streams.kv_subject(bucket)
        self.parts_prefix = streams.kv_subject(parts_bucket(bucket))
        self.slot = slot
        """the slot of the current snapshot's pieces (the next snapshot uses the other)"""
        self.on_fatal = on_fatal
        """called once when a write fails for good: the service must stop (loudly)"""
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
        await bus.key_value(parts_bucket(bucket))
        stream, prefix = streams.kv_stream(bucket), streams.kv_subject(bucket)
        last = await bus.last_seq(stream)
        stored = await read_snapshot(bus, bucket)
        slot = "b"
        if stored is not None:
            snap, seq, slot = stored
            start = seq + 1
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
        journal = cls(bus, bucket, ledger, cfg, seq=last, revision=revision, slot=slot, **kw)
        journal.replayed = replayed
        # From here on, entries are decided under `cfg`: record that before writing any.
        await journal._snapshot()
        return journal

    # --- the live path ----------------------------------------------------------------------

    def apply(self, op: Op):
        if self.fatal is not None:
            raise self.fatal
        result = apply(self.ledger, op, self.cfg)
        self._batch.ops.append(op)
        return result

    # --- the door: the registry asks and changes its policy only through these ------------

    def admit(self, request: AdmissionRequest, now: float, token: str) -> AdmissionGrant | AdmissionDeny:
        return self.apply(AdmitOp(request, now, token))

    def decide(self, trajectory: Trajectory, sender: str, now: float) -> tuple[TrajectoryDecision, bool]:
        """The decision about `trajectory`, and whether it is new: one still remembered is
        given back without an entry (it changes nothing, so there is nothing to replay)."""
        first = policy.seen_decision(self.ledger, trajectory.trajectory_id)
        if first is not None:
            return first, False
        return self.apply(DecideOp(policy.decision_input(trajectory, sender), now)), True

    def adapter_ready(self, event: AdapterReady) -> policy.Applied:
        return self.apply(AdapterOp(policy.adapter_facts(event)))

    def report(self, report: RolloutReport, now: float) -> policy.Applied:
        return self.apply(ReportOp(report, now))

    def export_done(self, event: ExportDone) -> policy.Applied | None:
        """None: an export of a version not recorded yet (its adapter event is on another
        consumer, possibly behind), to be retried rather than refused."""
        if policy.export_ahead(self.ledger, event):
            return None
        return self.apply(ExportOp(event))

    def expire(self, now: float) -> list[str]:
        """Free the grants whose lease passed or whose replica went silent; the freed ids. No
        entry when none is due (most ticks)."""
        if not policy.expiry_due(self.ledger, now, self.cfg):
            return []
        return self.apply(ExpireOp(now))

    def capacity(self) -> int:
        return policy.capacity(self.ledger, self.cfg)

    def can_grant(self, request: AdmissionRequest) -> bool:
        return policy.can_grant(self.ledger, request, self.cfg)

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
                    if self.on_fatal is not None:
                        self.on_fatal(fatal)
                    if not isinstance(exc, Exception):
                        raise
                    return
                await self.bus.send_all(batch.outbox)
                if batch.done is not None and not batch.done.done():
                    batch.done.set_result(None)
        finally:
            self._writer = None

    def _fail_pending(self, fatal: BaseException) -> None:
        batch, self._batch = self._batch, _Batch()
        if batch.done is not None and not batch.done.done():
            batch.done.set_exception(fatal)

    async def _store(self, ops: list[Op]) -> None:
        entries = encode_entries(ops)
        for i, entry in enumerate(entries):
            self.revision += 1
            if i == len(entries) - 1 and self.entries_since_snapshot + 1 >= self.snapshot_every:
                # ledger == stored state + the rest of `ops` right now (one write in flight)
                await self._snapshot()
            else:
                await self._write(entry, f"{JOURNAL_PREFIX}.{self.seq + 1}")
                self.entries_since_snapshot += 1

    async def _snapshot(self) -> None:
        """The ledger's pieces into the free slot, then the reference to them (rollup)."""
        data = encode_snapshot(Snapshot(ledger=self.ledger, cfg=self.cfg, revision=self.revision))
        slot = "a" if self.slot == "b" else "b"
        chunks = pieces(data)
        for i, chunk in enumerate(chunks):
            subject, msg_id = f"{self.parts_prefix}{slot}.{i}", f"{self._token}:{self.seq}:{slot}.{i}"
            await self.bus.publish_raw(subject, chunk, msg_id=msg_id, timeout=RETRY_FOR_S)
        ref = SnapshotRef(slot=slot, pieces=len(chunks), sha256=hashlib.sha256(data).hexdigest())
        await self._write(msgspec.json.encode(ref), SNAPSHOT_KEY, rollup=True)
        self.slot = slot

    async def _write(self, data: bytes, key: str, *, rollup: bool = False) -> None:
        msg_id = f"{self._token}:{self.seq + 1}"
        subject = self.prefix + key
        write = partial(self._publish_once, subject, data, msg_id, rollup)
        self.seq = await retrying(write, f"ledger write to {subject}", self.bus.url, RETRY_FOR_S)
        if rollup:
            self.entries_since_snapshot = 0
            self.snapshots += 1
        metrics.LEDGER_WRITES.labels(self.bus.run).inc()

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
