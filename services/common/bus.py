"""The bus client every service uses: nats-py core NATS + JetStream, typed with `proto`.

What it adds over nats-py: messages are encoded/decoded with `proto.codec`; anything a
service cannot decode, or keeps failing on, goes to the run's dead-letter stream instead of
blocking the consumer or being dropped silently (`services.common.pull`); JetStream publishes
carry a `Nats-Msg-Id` so retries are deduplicated; and every message is counted for Prometheus.

Every JetStream call it makes (publishes, stream/KV/consumer management, reads by sequence) is
retried while the server or cluster recovers (`nats_client.retrying`, for `RECOVER_S`): a
restarted server or a node lost from a cluster is a pause of a few seconds to a service, not an
error; an outage longer than that is a `BusError` naming the bus URL. `publish_expect` alone
makes one attempt: its caller (the registry's journal) retries it, recognising its own write.

The bus modules are the only ones that talk to nats-py, split as nats.py splits its client:
`nats_client` (the connection, raw messages, errors), `inbox` (replies), `pull` (durable
consumers), this module (the `Bus` a service holds), `stream_reads` (streams read back) and
`run_table` (a fleet's KV run table).
Services call their methods, never `nc`/`js` (the attributes stay for tests and tools).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, Literal, TypeVar, get_args, overload

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    KeyValueConfig,
    StorageType,
)
from nats.js.kv import KeyValue
from prometheus_client import Counter

from proto import codec, subjects
from proto.messages import DeadLetter, DeadLetterReason
from services.common import nats_client, stream_reads, streams
from services.common.inbox import Inbox
from services.common.nats_client import (
    DEAD_LETTER_ERRORS,
    MSG_ID_HEADER,
    RECOVER_S,
    BusError,
    Client,
    Handler,
    MsgMeta,
    OnRaw,
    Raw,
    SequenceMismatch,
    StoredMsg,
    decode,
    retrying,
    stored_seq,
    transient,
)
from services.common.nats_client import (
    Refused as Refused,  # re-exported: handlers raise it (`dispatch`)
)
from services.common.pull import Puller, handle_all
from services.config.schema import BusConfig

log = logging.getLogger(__name__)

T = TypeVar("T")

DEAD_LETTER_RAW_BYTES = 64 * 1024
DEAD_LETTER_REASONS: tuple[str, ...] = get_args(DeadLetterReason)
DEAD_LETTER_ERROR_CHARS = 2000
PUBLISH_TIMEOUT_S = RECOVER_S
"""total time `publish` keeps retrying while the server is unreachable or recovering"""
PUBACK_WAIT_S = 2.0
"""how long one attempt of a publish waits for its PubAck before it is sent again"""
CLOSE_TIMEOUT_S = 5.0
"""how long close() waits for consumers to stop and the connection to drain"""
WAIT_POLL_S = (0.02, 1.0)
"""`wait_last`'s re-read of the stream while no message wakes it: first and longest interval"""
_WRONG_LAST_SEQUENCE = 10071  # JetStream API error code for Nats-Expected-Last-Sequence

# by run: a fleet's process serves each run through a Bus of its own (`for_run`), so a run's
# traffic and dead letters are told apart; reconnections (nats_client) belong to the connection
MESSAGES = Counter(
    "lorabus_bus_messages_total",
    "Messages this process published, and deliveries it received (redeliveries count again)",
    ["run", "service", "direction"],
)
DEAD_LETTERS = Counter(
    "lorabus_bus_dead_letters_total",
    "Messages sent to the dead-letter stream, by reason",
    ["run", "service", "reason"],
)

_DELIVER = {
    "all": DeliverPolicy.ALL,
    "new": DeliverPolicy.NEW,
    "last_per_subject": DeliverPolicy.LAST_PER_SUBJECT,
}


class Bus:
    """One connection of one service of one run. Create with `await Bus.connect(...)`."""

    def __init__(self, nc: Client, run: str, service: str, replicas: int = 1, *, url: str):
        self.nc = nc
        self.url = url
        """`bus.url`: the server, or a cluster's nodes, named when JetStream stays unavailable"""
        self.replicas = replicas
        """copies of each stream and KV bucket this Bus creates (`bus.stream_replicas`)"""
        self.js = nc.jetstream()
        self.run = subjects.token(run, "run")
        self.service = subjects.token(service, "service")
        self._consumers: set[asyncio.Task] = set()
        self._subs: list[Subscription] = []
        # labelled once: `labels()` takes a lock and builds a key, per message on hot paths
        self.published = MESSAGES.labels(self.run, self.service, "published")
        self.consumed = MESSAGES.labels(self.run, self.service, "consumed")
        self._view = False
        """a view of another Bus's connection (`for_run`): closing it leaves the connection open"""
        self.inbox = Inbox(nc, self.subscribe_direct)

    # --- connection ---------------------------------------------------------------------

    @classmethod
    async def connect(cls, cfg: BusConfig, *, run: str, service: str) -> Bus:
        """Connect (`nats_client.connect`: retried for up to `cfg.connect_timeout_s`)."""
        subjects.token(run, "run")
        subjects.token(service, "service")
        nc = await nats_client.connect(cfg, run=run, service=service)
        return cls(nc, run, service, cfg.stream_replicas, url=cfg.url)

    @property
    def is_connected(self) -> bool:
        return self.nc.is_connected

    @property
    def is_closed(self) -> bool:
        return self.nc.is_closed

    def for_run(self, run: str) -> Bus:
        """This connection as seen by another run of the fleet: that run's subjects, streams
        and dead letters, consumers and subscriptions of its own. Closing the view stops
        those only; the connection belongs to the Bus it came from."""
        view = Bus(self.nc, run, self.service, self.replicas, url=self.url)
        view._view = True
        return view

    async def close(self) -> None:
        """Stop consumers (un-acked messages are redelivered to the next owner of the
        durable), then drain: pending publishes are flushed, subscriptions finish."""
        tasks = list(self._consumers)
        for task in tasks:
            task.cancel()
        # a consumer's last unsubscribe needs the server: never let a lost server hold close()
        await asyncio.wait(tasks, timeout=CLOSE_TIMEOUT_S) if tasks else None
        if self._view:
            for sub in self._subs:
                with contextlib.suppress(nats.errors.Error):
                    await sub.unsubscribe()
            self._subs = []
            return
        if self.nc.is_closed:
            return
        if not self.nc.is_connected:  # draining needs the server; don't wait for a reconnect
            await self.nc.close()
            return
        try:
            await asyncio.wait_for(self.nc.drain(), CLOSE_TIMEOUT_S)
        except (
            TimeoutError,
            nats.errors.ConnectionClosedError,
            nats.errors.FlushTimeoutError,
            nats.errors.DrainTimeoutError,
        ):
            await self.nc.close()

    # --- streams and KV -----------------------------------------------------------------

    async def ensure_streams(self) -> None:
        """Make every stream of the run exist with its current definition: create what is
        missing, update what differs. With NATS auth only the registry (the run's first
        service) may create streams and only the operator may update them (deploy/nats); every
        other service finds them in place, which needs nothing but STREAM.INFO."""
        for config in streams.stream_configs(self.run, self.replicas):
            assert config.name is not None  # stream_configs names every stream
            try:
                existing = (await self.jetstream(f"stream info {config.name}", self.js.stream_info, config.name)).config
            except nats.js.errors.NotFoundError:
                # a request this user may not make goes unanswered, as one to a cluster electing
                # its leader does: the error after the bound names both causes
                create = partial(self.js.add_stream, config)
                fix = "start the registry first (only it may create a run's streams); is nats-server up?"
                try:
                    await retrying(create, f"create stream {config.name}", self.url, fix=fix)
                except nats.js.errors.APIError as exc:
                    raise BusError(
                        f"stream {config.name}: missing, and this user cannot create it "
                        f"({type(exc).__name__}); start the registry first (it creates the run's streams)"
                    ) from exc
                continue
            if not streams.differs(existing, config):
                continue
            update = partial(self.js.update_stream, config)
            fix = "only the operator may update a stream: run `lorabus streams --config FILE` as the operator"
            try:
                await retrying(update, f"update stream {config.name}", self.url, fix=fix)
            except nats.js.errors.BadRequestError as exc:
                raise BusError(
                    f"stream {config.name}: existing stream cannot be changed to the current "
                    f"definition ({exc.description}); delete it (`nats stream rm`) or keep the "
                    "old settings"
                ) from exc
            except nats.js.errors.APIError as exc:
                raise BusError(
                    f"stream {config.name}: differs from the current definition and this user may not "
                    f"update it ({type(exc).__name__}); run `lorabus streams --config FILE` as the operator"
                ) from exc

    async def key_value(self, bucket: str, *, history: int = 1) -> KeyValue:
        """Open a KV bucket, creating it (file storage) if it does not exist."""
        if not 1 <= history <= 64:
            raise BusError(f"history: {history} must be within 1..64 (JetStream's limit)")
        try:
            return await self.jetstream(f"open KV bucket {bucket}", self.js.key_value, bucket)
        except nats.js.errors.BucketNotFoundError:
            config = KeyValueConfig(bucket=bucket, history=history, storage=StorageType.FILE, replicas=self.replicas)
            return await self.jetstream(f"create KV bucket {bucket}", self.js.create_key_value, config)

    async def jetstream(self, what: str, call: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
        """`await call(*args, **kwargs)`, a JetStream API call that may be repeated (a read, an
        idempotent create), retried while the server or cluster recovers (`retrying`); `what`
        names it in the error when the bound runs out."""
        return await retrying(partial(call, *args, **kwargs), what, self.url)

    # --- publishing ---------------------------------------------------------------------

    async def publish(
        self,
        subject: str,
        msg: msgspec.Struct,
        *,
        msg_id: str | None = None,
        timeout: float = PUBLISH_TIMEOUT_S,
    ) -> int:
        """JetStream publish; waits for the stream's ack and returns the stream sequence.

        While the server is unreachable it retries until `timeout`. With `msg_id` the retry
        is exactly-once (JetStream drops duplicates within the stream's duplicate window and
        acks them with the original sequence); without it a retry may store a second copy.
        """
        return await self._publish_raw(subject, codec.encode(msg), msg_id=msg_id, timeout=timeout)

    async def publish_raw(self, subject: str, data: bytes, *, msg_id: str | None = None,
                          timeout: float = PUBLISH_TIMEOUT_S) -> int:  # fmt: skip
        """`publish` of bytes already encoded (a stored piece that is not a message)."""
        return await self._publish_raw(subject, data, msg_id=msg_id, timeout=timeout)

    async def _publish_raw(self, subject: str, data: bytes, *, msg_id: str | None, timeout: float) -> int:
        headers = {MSG_ID_HEADER: msg_id} if msg_id else None
        deadline = time.monotonic() + timeout

        async def attempt() -> int:
            wait = max(0.1, min(deadline - time.monotonic(), PUBACK_WAIT_S))
            return await self._js_publish(subject, data, headers, wait)

        fix = f"is a stream capturing {subject} (ensure_streams), and nats-server up (in a cluster, most nodes)?"
        seq = await retrying(attempt, f"publish {subject}", self.url, timeout, fix=fix)
        self.published.inc()
        return seq

    async def _js_publish(self, subject: str, data: bytes, headers: dict[str, str] | None, timeout: float) -> int:
        """One JetStream publish (a request the stream answers with a PubAck): its sequence."""
        try:
            reply = await self.inbox.request(subject, data, headers, timeout)
        except nats.errors.NoRespondersError:
            raise nats.js.errors.NoStreamResponseError from None
        return stored_seq(reply)

    async def publish_core(self, subject: str, msg: msgspec.Struct) -> None:
        """Core NATS publish: fire and forget, not persisted."""
        await self.nc.publish(subject, codec.encode(msg))
        self.published.inc()

    async def send_raw(self, subject: str, data: bytes) -> None:
        """Core NATS publish of bytes already encoded (a reply prepared ahead of time)."""
        await self.nc.publish(subject, data)
        self.published.inc()

    async def send_all(self, msgs: list[tuple[str, bytes]]) -> None:
        """`send_raw` of each `(subject, data)`, as one pending command (`publish_many`),
        counted once (a burst's decisions or replies)."""
        await self.nc.publish_many([(subject, "", data) for subject, data in msgs])
        self.published.inc(len(msgs))

    async def dead_letter(
        self, subject: str, reason: DeadLetterReason, error: str, raw: bytes, *, msg_id: str | None = None
    ) -> int:
        """Record a message this service could not use on `deadletter.<service>`."""
        if reason not in DEAD_LETTER_REASONS:
            raise BusError(f"dead_letter reason: {reason!r} is not one of {DEAD_LETTER_REASONS}")
        letter = DeadLetter(
            run=self.run,
            service=self.service,
            subject=subject,
            reason=reason,
            error=error[:DEAD_LETTER_ERROR_CHARS],
            raw=bytes(raw[:DEAD_LETTER_RAW_BYTES]),
            received_at=time.time(),
        )
        seq = await self.publish(subjects.dead_letter(self.run, self.service), letter, msg_id=msg_id)
        DEAD_LETTERS.labels(self.run, self.service, reason).inc()
        log.warning("bus: dead-lettered a message on %s (%s): %s", subject, reason, error[:200])
        return seq

    # --- request/reply ------------------------------------------------------------------

    async def request(self, subject: str, msg: msgspec.Struct, reply_type: type[T] | Any, *, timeout: float = 2.0) -> T:
        """Core request/reply; raises `nats.errors.TimeoutError` when nobody answers in time
        and `proto.codec.DecodeError` when the reply is not a `reply_type`."""
        reply = await self.inbox.request(subject, codec.encode(msg), None, timeout)
        self.published.inc()
        self.consumed.inc()
        return decode(reply.data, reply_type)

    async def serve(
        self,
        subject: str,
        request_type: type[T] | Any,
        handler: Callable[[T], Awaitable[msgspec.Struct]],
        *,
        queue: str = "",
    ) -> Subscription:
        """Answer requests on `subject` with `await handler(request)`. A request that does
        not decode, or whose handler raises, is dead-lettered and left unanswered: the
        requester times out, which is the only signal a typed reply can carry."""

        async def on_request(nats_msg: Msg) -> None:
            self.consumed.inc()
            try:
                request = decode(nats_msg.data, request_type)
            except codec.DecodeError as exc:
                await self.dead_letter_quietly(nats_msg.subject, exc.reason, str(exc), nats_msg.data)
                return
            try:
                reply = await handler(request)
            except Exception as exc:
                log.exception("bus: handler for %s failed", subject)
                await self.dead_letter_quietly(nats_msg.subject, "handler", repr(exc), nats_msg.data)
                return
            if nats_msg.reply:
                await nats_msg.respond(codec.encode(reply))
                self.published.inc()

        sub = await self.nc.subscribe(subject, queue=queue, cb=on_request)
        self._subs.append(sub)
        return sub

    # --- subscriptions ------------------------------------------------------------------

    async def subscribe_raw(
        self, subject: str, cb: Callable[[Msg], Awaitable[None]], *, queue: str = ""
    ) -> Subscription:
        """Core subscription handing over the undecoded `Msg` (a reply deferred past the
        callback, or a tool that shows what it cannot decode). Prefer `subscribe`/`serve`."""
        sub = await self.nc.subscribe(subject, queue=queue, cb=cb)
        self._subs.append(sub)
        return sub

    async def subscribe_direct(self, subject: str, on_raw: OnRaw, *, queue: str = "") -> Subscription:
        """Core subscription whose messages go to `on_raw(raw)` as they are read, in the
        connection's read loop (`nats_client.Client`): a plain function that must neither block nor
        await (it schedules what must wait); what it raises is logged. For hot paths: reply
        inboxes, pull deliveries, the registry's admissions."""
        nc = self.nc

        async def fallback(msg: Msg) -> None:
            nc.fallbacks += 1
            on_raw(Raw(msg.subject, msg.reply, msg.data, msg.headers))

        sub = await nc.subscribe(subject, queue=queue, cb=fallback)
        nc.direct[sub._id] = on_raw  # a message that came before this line took `fallback`
        self._subs.append(sub)
        return sub

    async def subscribe(self, subject: str, msg_type: type[T] | Any, handler: Handler) -> Subscription:
        """Ephemeral core subscription (live events only, no replay, no acks).
        `handler(msg, meta)`; undecodable messages are dead-lettered, handler errors logged."""

        async def on_msg(nats_msg: Msg) -> None:
            self.consumed.inc()
            try:
                msg = decode(nats_msg.data, msg_type)
            except codec.DecodeError as exc:
                await self.dead_letter_quietly(nats_msg.subject, exc.reason, str(exc), nats_msg.data)
                return
            headers = nats_msg.headers or {}
            meta = MsgMeta(nats_msg.subject, 0, 1, headers.get(MSG_ID_HEADER))
            try:
                await handler(msg, meta)
            except Exception:
                log.exception("bus: handler for %s failed", nats_msg.subject)

        sub = await self.nc.subscribe(subject, cb=on_msg)
        self._subs.append(sub)
        return sub

    async def pull(
        self,
        consumer: streams.Consumer,
        msg_type: type[T] | Any,
        *,
        batch: int = 64,
        deliver: Literal["all", "new", "last_per_subject"] = "all",
        retry_delay_s: float = 0.5,
        keep_open: bool = False,
    ) -> Puller[T]:
        """Create (or bind to) the durable `consumer` and return its burst reader: decoded
        deliveries, undecodable ones dead-lettered already (see `services.common.pull`)."""
        if deliver not in _DELIVER:
            raise BusError(f"deliver: {deliver!r} is not one of {sorted(_DELIVER)}")
        c = consumer
        if batch < 1 or c.max_deliver == 0 or c.max_deliver < -1 or c.ack_wait_s <= 0:
            raise BusError(
                f"consume {c.durable}: batch ({batch}) and max_deliver ({c.max_deliver}) must be "
                f">= 1 (max_deliver -1: unlimited) and ack_wait_s ({c.ack_wait_s}) > 0"
            )
        config = ConsumerConfig(
            durable_name=c.durable,
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=_DELIVER[deliver],
            ack_wait=c.ack_wait_s,
            max_deliver=c.max_deliver,
            filter_subject=c.filter_subject,
            max_ack_pending=c.max_ack_pending,
        )
        try:
            await self.jetstream(f"create consumer {c.stream}/{c.durable}", self.js.add_consumer, c.stream, config)
        except nats.js.errors.NotFoundError as exc:
            raise BusError(
                f"consume {c.durable}: stream {c.stream!r} does not exist; call ensure_streams() "
                "first, with stream names from services.common.streams"
            ) from exc
        except nats.js.errors.BadRequestError as exc:
            raise BusError(
                f"consume {c.durable}: existing durable on {c.stream} has an incompatible config "
                f"({exc.description}); pick a new durable name or delete the old one"
            ) from exc
        reader = Puller(self, c.stream, c.durable, msg_type, batch=batch, max_deliver=c.max_deliver,
                        retry_delay_s=retry_delay_s, keep_open=keep_open, ack_wait_s=c.ack_wait_s)  # fmt: skip
        await reader.start()
        return reader

    async def consume(
        self,
        stream: str,
        durable: str,
        msg_type: type[T] | Any,
        handler: Handler,
        *,
        filter_subject: str | None = None,
        deliver: Literal["all", "new", "last_per_subject"] = "all",
        batch: int = 64,
        ack_wait_s: float = 30.0,
        max_deliver: int = 5,
        retry_delay_s: float = 0.5,
    ) -> asyncio.Task:
        """`dispatch` over a durable made from these arguments (a consumer outside
        `streams`' table: evaluators, tools, tests)."""
        consumer = streams.Consumer(
            durable=durable, stream=stream, filter_subject=filter_subject, ack_wait_s=ack_wait_s,
            max_deliver=max_deliver, max_ack_pending=max(batch, 1000),
        )  # fmt: skip
        reader = await self.pull(consumer, msg_type, batch=batch, deliver=deliver, retry_delay_s=retry_delay_s)
        return self.dispatch(reader, handler)

    def dispatch(self, reader: Puller, handler: Handler) -> asyncio.Task:
        """`pull.handle_all(reader, handler)` (ack, retry with backoff or dead-letter each
        delivery) in a background task of this Bus; returns the task (cancel it to stop)."""
        name = f"consume:{reader.stream}/{reader.durable}"
        return self.adopt(asyncio.create_task(handle_all(reader, handler), name=name))

    def adopt(self, task: asyncio.Task) -> asyncio.Task:
        """Make `task` one of this Bus's background readers: `close()` cancels it, and its
        failure is logged. Returns it."""
        self._consumers.add(task)
        task.add_done_callback(self._consumer_done)
        return task

    def _consumer_done(self, task: asyncio.Task) -> None:
        self._consumers.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("bus: consumer %s stopped", task.get_name(), exc_info=task.exception())

    async def consumer_backlog(self, stream: str, durable: str) -> int | None:
        """Messages of the durable not yet acked (pending + delivered un-acked); None when the
        durable does not exist."""
        try:
            info = await self.jetstream(f"consumer info {stream}/{durable}", self.js.consumer_info, stream, durable)
        except nats.js.errors.NotFoundError:
            return None
        return info.num_pending + info.num_ack_pending

    # --- reading streams back -------------------------------------------------------------

    async def last_seq(self, stream: str) -> int:
        """The stream's last sequence (0 when it never held a message)."""
        return (await self.jetstream(f"stream info {stream}", self.js.stream_info, stream)).state.last_seq

    async def message(self, stream: str, seq: int, subject: str | None = None) -> StoredMsg | None:
        """The message at `seq`; with `subject`, the first one at or after `seq` on it; None
        if there is none."""
        return await stream_reads.message(self, stream, seq, subject)

    async def last_raw(self, stream: str, subject: str | None = None) -> StoredMsg | None:
        """The newest message of the stream (on `subject`, if given); None if there is none."""
        return await stream_reads.last_raw(self, stream, subject)

    async def read_all(self, stream: str, msg_type: type[T] | Any, *, batch: int = 256) -> list[T]:
        """Every message of `stream` that decodes as `msg_type`, in stream order ([] when the
        stream does not exist): `stream_reads.read_all`."""
        return await stream_reads.read_all(self, stream, msg_type, batch=batch)

    @overload
    async def last(self, stream: str, msg_type: type[T], subject: str | None = None) -> T | None: ...
    @overload
    async def last(self, stream: str, msg_type: Any, subject: str | None = None) -> Any: ...
    async def last(self, stream: str, msg_type: type[T] | Any, subject: str | None = None) -> T | None:
        """The newest message of the stream (on `subject`, if given), decoded; None if there is
        none; `codec.DecodeError` if it does not decode as `msg_type`."""
        raw = await self.last_raw(stream, subject)
        return None if raw is None else decode(raw.data, msg_type)

    @overload
    async def wait_last(self, stream: str, msg_type: type[T], subject: str, *, timeout: float) -> T | None: ...
    @overload
    async def wait_last(self, stream: str, msg_type: Any, subject: str, *, timeout: float) -> Any: ...
    async def wait_last(self, stream: str, msg_type: type[T] | Any, subject: str, *, timeout: float) -> T | None:
        """`last(stream, msg_type, subject)`, waiting up to `timeout` s for a first message to be
        stored there; None if none was. A core subscription to `subject` only wakes the wait
        early: what it returns is read back from the stream (a message the stream refused never
        counts), and a short poll covers a wake that came before the store (or a subscription
        the user may not hold). `codec.DecodeError` if what is stored does not decode."""
        woken = asyncio.Event()

        async def wake(_msg: Msg) -> None:
            woken.set()

        sub = await self.nc.subscribe(subject, cb=wake)
        deadline, poll = time.monotonic() + timeout, WAIT_POLL_S[0]
        try:
            while True:
                woken.clear()
                found = await self.last(stream, msg_type, subject)
                left = deadline - time.monotonic()
                if found is not None or left <= 0:
                    return found
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(woken.wait(), min(left, poll))
                poll = WAIT_POLL_S[0] if woken.is_set() else min(2 * poll, WAIT_POLL_S[1])
        finally:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()

    async def publish_expect(
        self,
        subject: str,
        data: bytes,
        *,
        expected_last_seq: int,
        msg_id: str,
        rollup: bool = False,
        timeout: float = 2.0,
    ) -> int:
        """One JetStream publish that is stored only if the stream's last sequence is still
        `expected_last_seq` (compare-and-set); `rollup` makes the server drop every older
        message. Raises `SequenceMismatch` when someone else wrote first; no retries."""
        headers = {MSG_ID_HEADER: msg_id, "Nats-Expected-Last-Sequence": str(expected_last_seq)}
        if rollup:
            headers["Nats-Rollup"] = "all"
        try:
            return await self._js_publish(subject, data, headers, timeout)
        except nats.js.errors.APIError as exc:
            if exc.err_code == _WRONG_LAST_SEQUENCE:
                raise SequenceMismatch(f"publish {subject}: stream is past sequence {expected_last_seq}") from exc
            raise

    async def publish_all(self, msgs: list[tuple[str, bytes, str]], *, timeout: float) -> list[int | BaseException]:
        """JetStream-publish `(subject, data, msg_id)`s without waiting for each ack in turn,
        then gather every PubAck: a sequence, or the error, per message (a PubAck that did not
        come: nats.errors.TimeoutError). A message whose error is `transient` (a stream electing
        its leader) is sent again with its msg id, so stored once, until `timeout`."""
        deadline = time.monotonic() + timeout
        results: list[int | BaseException] = [nats.errors.TimeoutError()] * len(msgs)
        todo = list(range(len(msgs)))
        delay = 0.05
        while True:
            wait = max(0.1, min(deadline - time.monotonic(), PUBACK_WAIT_S))
            acks = await self.inbox.publish_all([msgs[i] for i in todo], wait, self.published.inc)
            for i, ack in zip(todo, acks):
                results[i] = ack
            todo = [i for i, ack in zip(todo, acks) if isinstance(ack, BaseException) and transient(ack)]
            if not todo or time.monotonic() + delay >= deadline:
                return results
            await asyncio.sleep(delay)
            delay = min(2 * delay, 1.0)

    async def dead_letter_quietly(self, subject: str, reason: DeadLetterReason, error: str, raw: bytes) -> None:
        """`dead_letter` for messages nothing redelivers (core requests): log what fails."""
        try:
            await self.dead_letter(subject, reason, error, raw)
        except DEAD_LETTER_ERRORS as exc:
            log.error("bus: could not dead-letter %s (%r)", subject, exc)
