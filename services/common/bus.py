"""The bus client every service uses: nats-py core NATS + JetStream, typed with `proto`.

What it adds over nats-py: messages are encoded/decoded with `proto.codec`; anything a
service cannot decode, or keeps failing on, goes to the run's dead-letter stream instead of
blocking the consumer or being dropped silently (`services.common.pull`); JetStream publishes
carry a `Nats-Msg-Id` so retries are deduplicated; and every message is counted for Prometheus.

It is the only module that talks to nats-py: services call its methods, never `nc`/`js`
(the attributes stay for tests and tools). What it reaches of nats-py's internals is in
`_Client` alone (direct subscriptions and batched publishes, each tested against nats-py's
own path).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import ssl
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Literal, TypeVar, get_args, overload

import msgspec
import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
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
from proto.messages import DeadLetter, DeadLetterReason, RunList, RunRecord, RunReply, RunStop, RunSubmit
from services.common import streams
from services.common.config_schema import BusConfig

if TYPE_CHECKING:
    from services.common.pull import Puller

log = logging.getLogger(__name__)

T = TypeVar("T")

MSG_ID_HEADER = "Nats-Msg-Id"
DEAD_LETTER_RAW_BYTES = 64 * 1024
DEAD_LETTER_REASONS: tuple[str, ...] = get_args(DeadLetterReason)
DEAD_LETTER_ERROR_CHARS = 2000
RECONNECT_WAIT_S = 0.5
PUBLISH_TIMEOUT_S = 10.0
"""total time `publish` keeps retrying while the server is unreachable or recovering"""
CONSUMER_PAUSE_S = 0.5
"""pause of a consumer whose pull failed with an unexpected error, before it pulls again"""
CLOSE_TIMEOUT_S = 5.0
"""how long close() waits for consumers to stop and the connection to drain"""
_WRONG_LAST_SEQUENCE = 10071  # JetStream API error code for Nats-Expected-Last-Sequence
_NO_RESPONDERS = "503"  # the status of a request nobody (no stream) answers

MESSAGES = Counter(
    "lorabus_bus_messages_total",
    "Messages this process published, and deliveries it received (redeliveries count again)",
    ["service", "direction"],
)
DEAD_LETTERS = Counter(
    "lorabus_bus_dead_letters_total",
    "Messages sent to the dead-letter stream, by reason",
    ["service", "reason"],
)
RECONNECTS = Counter(
    "lorabus_bus_reconnects_total",
    "Reconnections to the NATS server after a lost connection",
    ["service"],
)

_DELIVER = {
    "all": DeliverPolicy.ALL,
    "new": DeliverPolicy.NEW,
    "last_per_subject": DeliverPolicy.LAST_PER_SUBJECT,
}

# Errors that mean "the server is not reachable right now": worth retrying, not a bug.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.OutboundBufferLimitError,
    nats.js.errors.NoStreamResponseError,
    nats.js.errors.ServiceUnavailableError,
    asyncio.TimeoutError,
)


class BusError(RuntimeError):
    pass


class Refused(ValueError):
    """Raised by a handler: the message is wrong for good (a forged or out-of-order event), so
    it is dead-lettered at once as "validation" with this message, not retried."""


class SequenceMismatch(BusError):
    """A `publish_expect` found the stream past the expected sequence: someone else wrote."""


DEAD_LETTER_ERRORS: tuple[type[BaseException], ...] = (BusError, *TRANSIENT_ERRORS)
"""what `dead_letter` raises when it could not record the message"""


class StoredMsg(msgspec.Struct, frozen=True):
    """A message read back from a stream by sequence or subject."""

    subject: str
    seq: int
    data: bytes
    headers: dict[str, str] | None


class MsgMeta(msgspec.Struct, frozen=True):
    """Delivery facts a handler may need (idempotency, logging, retry decisions)."""

    subject: str
    stream_seq: int
    """0 for core NATS messages"""
    num_delivered: int
    msg_id: str | None = None


Handler = Callable[[Any, MsgMeta], Awaitable[None]]


class _PubAck(msgspec.Struct):
    """A JetStream publish's answer: where it was stored, or why not."""

    seq: int = 0
    error: dict[str, Any] | None = None


_pub_ack = msgspec.json.Decoder(_PubAck)


class Raw(msgspec.Struct, gc=False):
    """A message as received, for a direct subscription's callback: the four fields of
    nats-py's `Msg` the Bus reads, without its client reference and dataclass."""

    subject: str
    reply: str
    data: bytes
    headers: dict[str, str] | None


OnRaw = Callable[[Raw], None]

_PLAIN_HEADERS = b"NATS/1.0\r\n"  # a header block without an inline status
_NOT_IN_SUBJECT = re.compile(r"[ \t\r\n]")  # what nats-py's publish refuses in a subject


def read_headers(block: bytes) -> dict[str, str] | None:
    """nats-py's reading of a header block without an inline status (`Client._process_headers`
    through `_parse_header_lines`, without its per-character whitespace scan): `Name: value`
    lines, names ASCII without whitespace, values UTF-8; None when there are none."""
    out: dict[str, str] = {}
    for line in block[len(_PLAIN_HEADERS) :].split(b"\r\n"):
        name, sep, value = line.partition(b":")
        if not sep or not name.isascii():
            continue
        key = name.strip().decode()
        if key and key.split() != [key]:  # whitespace inside the name
            continue
        out[key] = value.strip().decode("utf-8", "replace")
    return out or None


class _Client(Client):
    """nats-py's client, plus two cheaper paths for the small messages the registry sends
    and receives several of per decision (nats-py's own per-message machinery was ~40 % of
    its CPU):

    - direct subscriptions (`Bus.subscribe_direct`): each message goes from the read loop
      straight to a plain function, without nats-py's `Msg`, the subscription's pending queue
      and its task's per-message wake-up and callback coroutine. Internal reached:
      `_process_msg(sid, subject, reply, data, headers)`, which nats-py's protocol parser
      awaits for every MSG/HMSG. If a release stops calling it, direct subscriptions still
      work through nats-py's own path (`fallbacks` counts those messages), only slower;
      tests/integration/test_bus.py fails then.
    - `publish_many`: the PUBs of a batch as one pending command, with `publish`'s checks.
      Internals reached: `_send_command` and the flusher kick, as `publish` does them;
      tests/unit/test_bus_direct.py checks the bytes against `publish`'s own.
    """

    def __init__(self) -> None:
        super().__init__()
        self.direct: dict[int, OnRaw] = {}
        """the callback of each direct subscription, by sid"""
        self.fallbacks = 0
        """messages of direct subscriptions that came through nats-py's queue and task"""

    async def _process_msg(self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes | None) -> None:
        on_raw = self.direct.get(sid)
        if on_raw is None:
            # nats-py annotates headers as bytes, but its parser passes None for a plain MSG
            await super()._process_msg(sid, subject, reply, data, headers)  # type: ignore[arg-type]
            return
        if sid not in self._subs:  # unsubscribed: nats-py drops what still comes for it
            del self.direct[sid]
            return
        self.stats["in_msgs"] += 1
        self.stats["in_bytes"] += len(data)
        if not headers:
            parsed = None
        elif headers.startswith(_PLAIN_HEADERS):
            parsed = read_headers(headers)
        else:  # an inline status (a pull's 408, a 503): nats-py's own reading
            parsed = await self._process_headers(headers)
        try:
            on_raw(Raw(subject.decode(), reply.decode(), data, parsed))
        except Exception:  # never into the read loop: that would drop the connection
            log.exception("bus: direct subscription callback failed on %s", subject.decode(errors="replace"))

    async def publish_many(self, msgs: Sequence[tuple[str, str, bytes]]) -> None:
        """`publish(subject, data, reply=reply)` of each `(subject, reply, data)`, with its
        checks in its order, written as one pending command: ~2 us a message less than
        `publish` (its coroutine, stats and flush kick per message). A message `publish` would
        refuse raises its error, and none of the batch is sent."""
        parts: list[bytes] = []
        pending = self._pending_data_size
        for subject, reply, data in msgs:
            if not subject or _NOT_IN_SUBJECT.search(subject) or (reply and _NOT_IN_SUBJECT.search(reply)):
                raise nats.errors.BadSubjectError  # whitespace would inject protocol lines
            if self.is_closed:
                raise nats.errors.ConnectionClosedError
            if self.is_draining_pubs:
                raise nats.errors.ConnectionDrainingError
            if not self.is_connected and (self._max_pending_size <= 0 or len(data) + pending > self._max_pending_size):
                raise nats.errors.OutboundBufferLimitError
            if len(data) > self._max_payload:
                raise nats.errors.MaxPayloadError
            command = f"PUB {subject} {reply} {len(data)}\r\n".encode() + data + b"\r\n"
            pending += len(command)
            parts.append(command)
        if not parts:
            return
        self.stats["out_msgs"] += len(parts)
        self.stats["out_bytes"] += sum(len(data) for _, _, data in msgs)
        await self._send_command(b"".join(parts))
        if self._flush_queue is not None and self._flush_queue.empty():
            await self._flush_pending()


def stored_seq(reply: Raw) -> int:
    """The stream sequence a PubAck names; raises what nats-py's JetStream publish raises
    (NoStreamResponseError for no stream, APIError for a refusal). msgspec reads it in a
    fraction of nats-py's json + dataclass path, once per stored message on hot paths."""
    if reply.headers and reply.headers.get("Status") == _NO_RESPONDERS:
        raise nats.js.errors.NoStreamResponseError
    try:
        ack = _pub_ack.decode(reply.data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise nats.js.errors.APIError(description=f"unreadable PubAck {reply.data[:200]!r}: {exc}") from None
    if ack.error is not None:
        raise nats.js.errors.APIError.from_error(ack.error)
    return ack.seq


class _AckWait:
    """PubAcks still awaited by one `publish_all`: a sequence or an error per message."""

    __slots__ = ("results", "left", "done")

    def __init__(self, n: int, done: asyncio.Future):
        self.results: list[int | BaseException | None] = [None] * n
        self.left = n
        self.done = done

    def take(self, i: int, reply: Raw) -> None:
        try:
            self.results[i] = stored_seq(reply)
        except nats.errors.Error as exc:
            self.results[i] = exc
        self.left -= 1
        if self.left == 0:
            _settle_future(self.done, None)


def _settle_future(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _connect_options(cfg: BusConfig) -> dict[str, Any]:
    options: dict[str, Any] = {}
    password = cfg.password
    if cfg.password_env:
        password = os.environ.get(cfg.password_env)
        if password is None:
            raise BusError(
                f"bus.password_env: environment variable {cfg.password_env!r} is not set; "
                "export it or remove bus.password_env"
            )
    if password is not None and not cfg.user:
        raise BusError("bus.user: a password is configured but no user; set bus.user")
    if cfg.user:
        options["user"] = cfg.user
        options["password"] = password
    if cfg.creds_file:
        if not os.path.isfile(cfg.creds_file):
            raise BusError(f"bus.creds_file: {cfg.creds_file!r} does not exist")
        options["user_credentials"] = cfg.creds_file
    if cfg.tls_ca or cfg.tls_cert or cfg.url.startswith("tls://"):
        if bool(cfg.tls_cert) != bool(cfg.tls_key):
            raise BusError("bus.tls_cert/bus.tls_key: give both for client certificates, or neither")
        context = ssl.create_default_context(cafile=cfg.tls_ca)
        if cfg.tls_cert:
            context.load_cert_chain(cfg.tls_cert, cfg.tls_key)
        options["tls"] = context
    return options


class Bus:
    """One connection of one service of one run. Create with `await Bus.connect(...)`."""

    def __init__(self, nc: _Client, run: str, service: str):
        self.nc = nc
        self.js = nc.jetstream()
        self.run = subjects.token(run, "run")
        self.service = subjects.token(service, "service")
        self._consumers: set[asyncio.Task] = set()
        self._subs: list[Subscription] = []
        # labelled once: `labels()` takes a lock and builds a key, per message on hot paths
        self.published = MESSAGES.labels(self.service, "published")
        self.consumed = MESSAGES.labels(self.service, "consumed")
        self._view = False
        """a view of another Bus's connection (`for_run`): closing it leaves the connection open"""
        self._replies: Subscription | None = None
        self._replies_prefix = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        """the loop the reply inbox runs on (kept: on Python 3.11 each lookup costs a getpid())"""
        self._reply_next = 0
        self._reply_waits: dict[str, Callable[[Raw], None]] = {}
        """what to do with each awaited reply (an answer, a PubAck), by its reply subject's last token"""

    # --- connection ---------------------------------------------------------------------

    @classmethod
    async def connect(cls, cfg: BusConfig, *, run: str, service: str) -> Bus:
        """Connect, retrying for up to `cfg.connect_timeout_s` (a service may start before
        the server); afterwards nats-py reconnects on its own, every RECONNECT_WAIT_S."""
        subjects.token(run, "run")
        subjects.token(service, "service")
        options = _connect_options(cfg)

        nc = _Client()

        async def on_disconnect() -> None:
            if not (nc.is_closed or nc.is_draining):  # our own close() is not news
                log.warning("bus: disconnected from %s", cfg.url)

        async def on_reconnect() -> None:
            RECONNECTS.labels(service).inc()
            log.info("bus: reconnected to %s", cfg.url)

        async def on_error(exc: Exception) -> None:
            # Connection refused while reconnecting is expected noise during a restart.
            log.debug("bus: %s: %s", type(exc).__name__, exc)

        try:
            # nats-py retries the first connect too (every RECONNECT_WAIT_S, forever with
            # max_reconnect_attempts=-1): bound the whole attempt by connect_timeout_s.
            await asyncio.wait_for(
                nc.connect(
                    servers=[cfg.url],
                    name=f"lorabus-{run}-{service}",
                    # nats-py annotates both as int but hands them to asyncio timeouts as seconds
                    connect_timeout=cfg.connect_timeout_s,  # type: ignore[arg-type]
                    allow_reconnect=True,
                    max_reconnect_attempts=cfg.max_reconnect_attempts,
                    reconnect_time_wait=RECONNECT_WAIT_S,  # type: ignore[arg-type]
                    disconnected_cb=on_disconnect,
                    reconnected_cb=on_reconnect,
                    error_cb=on_error,
                    # replies to this user's requests (PubAcks, pulled messages, grants) come to
                    # an inbox only it may subscribe to (deploy/nats: `_INBOX_<user>.>`)
                    inbox_prefix=f"_INBOX_{cfg.user}" if cfg.user else "_INBOX",
                    **options,
                ),
                timeout=cfg.connect_timeout_s,
            )
        except (TimeoutError, OSError, nats.errors.Error) as exc:
            cause = nc.last_error or exc
            await nc.close()
            raise BusError(
                f"bus.url: cannot connect to NATS at {cfg.url} within {cfg.connect_timeout_s}s "
                f"({type(cause).__name__}: {cause}); is nats-server running (`lorabus up` "
                "starts one), and are bus.user/password/creds_file right?"
            ) from exc
        return cls(nc, run, service)

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
        view = Bus(self.nc, run, self.service)
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
        for config in streams.stream_configs(self.run):
            assert config.name is not None  # stream_configs names every stream
            try:
                existing = (await self.js.stream_info(config.name)).config
            except nats.js.errors.NotFoundError:
                try:
                    await self.js.add_stream(config)
                except (nats.errors.TimeoutError, nats.js.errors.APIError) as exc:
                    raise BusError(
                        f"stream {config.name}: missing, and this user cannot create it "
                        f"({type(exc).__name__}); start the registry first (it creates the run's streams)"
                    ) from exc
                continue
            if not streams.differs(existing, config):
                continue
            try:
                await self.js.update_stream(config)
            except nats.js.errors.BadRequestError as exc:
                raise BusError(
                    f"stream {config.name}: existing stream cannot be changed to the current "
                    f"definition ({exc.description}); delete it (`nats stream rm`) or keep the "
                    "old settings"
                ) from exc
            except (nats.errors.TimeoutError, nats.js.errors.APIError) as exc:
                raise BusError(
                    f"stream {config.name}: differs from the current definition and this user may not "
                    f"update it ({type(exc).__name__}); run `lorabus streams --config FILE` as the operator"
                ) from exc

    async def key_value(self, bucket: str, *, history: int = 1) -> KeyValue:
        """Open a KV bucket, creating it (file storage) if it does not exist."""
        if not 1 <= history <= 64:
            raise BusError(f"history: {history} must be within 1..64 (JetStream's limit)")
        try:
            return await self.js.key_value(bucket)
        except nats.js.errors.BucketNotFoundError:
            config = KeyValueConfig(bucket=bucket, history=history, storage=StorageType.FILE)
            return await self.js.create_key_value(config)

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
        delay = 0.05
        while True:
            remaining = deadline - time.monotonic()
            try:
                seq = await self._js_publish(subject, data, headers, max(0.1, min(remaining, 2.0)))
                self.published.inc()
                return seq
            except TRANSIENT_ERRORS as exc:
                if time.monotonic() + delay >= deadline:
                    raise BusError(
                        f"publish {subject}: no JetStream ack within {timeout}s "
                        f"({type(exc).__name__}); is a stream capturing it (ensure_streams) "
                        "and is the server up?"
                    ) from exc
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    async def _js_publish(self, subject: str, data: bytes, headers: dict[str, str] | None, timeout: float) -> int:
        """One JetStream publish (a request the stream answers with a PubAck): its sequence."""
        try:
            reply = await self._request_raw(subject, data, headers, timeout)
        except nats.errors.NoRespondersError:
            raise nats.js.errors.NoStreamResponseError from None
        return stored_seq(reply)

    # --- replies: one inbox per Bus for every answer it waits for -----------------------------
    #
    # nats-py's request costs a random token, a NUID, a done-callback and a wait_for (a waiter
    # and a timer) per call, and its publish_async a semaphore, a token and a future per message;
    # these run several times per decision (rollout, registry). Here: a counter, a dict entry
    # and one timer per wait.

    async def _open_replies(self) -> asyncio.AbstractEventLoop:
        """Subscribe the reply inbox (once); the loop it runs on."""
        if self._loop is None:
            # set before the await: a request made meanwhile uses this inbox (its SUB goes out
            # first, on the same connection) instead of subscribing a second one
            loop = self._loop = asyncio.get_running_loop()
            self._replies_prefix = self.nc.new_inbox() + "."
            try:
                self._replies = await self.subscribe_direct(self._replies_prefix + "*", self._on_reply)
            except BaseException:
                self._loop = None
                raise
            return loop
        return self._loop

    def _reply_to(self, on_reply: Callable[[Raw], None]) -> str:
        """A reply subject whose one message goes to `on_reply` (drop it with `_forget`)."""
        self._reply_next += 1
        key = str(self._reply_next)
        self._reply_waits[key] = on_reply
        return self._replies_prefix + key

    def _forget(self, reply_to: str) -> None:
        self._reply_waits.pop(reply_to[len(self._replies_prefix) :], None)

    def _on_reply(self, msg: Raw) -> None:
        on_reply = self._reply_waits.pop(msg.subject[len(self._replies_prefix) :], None)
        if on_reply is not None:  # else its waiter gave up
            on_reply(msg)

    async def _request_raw(self, subject: str, data: bytes, headers: dict[str, str] | None, timeout: float) -> Raw:
        """Core request: the reply, or nats.errors.TimeoutError / NoRespondersError as nats-py."""
        loop = self._loop or await self._open_replies()
        answer: asyncio.Future = loop.create_future()
        reply_to = self._reply_to(partial(_settle_future, answer))
        timer = loop.call_later(timeout, _settle_future, answer, None)
        try:
            await self.nc.publish(subject, data, reply=reply_to, headers=headers)
            reply = await answer
        finally:
            timer.cancel()
            self._forget(reply_to)
        if reply is None:
            raise nats.errors.TimeoutError
        if reply.headers and reply.headers.get("Status") == _NO_RESPONDERS:
            raise nats.errors.NoRespondersError
        return reply

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
        DEAD_LETTERS.labels(self.service, reason).inc()
        log.warning("bus: dead-lettered a message on %s (%s): %s", subject, reason, error[:200])
        return seq

    # --- request/reply ------------------------------------------------------------------

    async def request(self, subject: str, msg: msgspec.Struct, reply_type: type[T] | Any, *, timeout: float = 2.0) -> T:
        """Core request/reply; raises `nats.errors.TimeoutError` when nobody answers in time
        and `proto.codec.DecodeError` when the reply is not a `reply_type`."""
        reply = await self._request_raw(subject, codec.encode(msg), None, timeout)
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
        connection's read loop (`_Client`): a plain function that must neither block nor
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
        from services.common.pull import Puller

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
            await self.js.add_consumer(c.stream, config)
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
        """Run `handler(msg, meta)` on every delivery of `reader` in a background task; returns
        the task (cancel it to stop; the durable keeps its position on the server).

        Deliveries are handled one at a time in stream order. Returning acks; raising `Refused`
        dead-letters and terminates at once; raising anything else naks with a delay of
        `retry_delay_s * 2**(n-1)` (n = deliveries so far) and, on the `max_deliver`-th
        failure, dead-letters and terminates the message. Nothing but cancelling ends the task.
        """

        async def run() -> None:
            try:
                while True:
                    try:
                        burst = await reader.burst()
                    except Exception:  # a consumer never dies while its service lives
                        log.exception("bus: pull on %s/%s failed; pulling again", reader.stream, reader.durable)
                        await asyncio.sleep(CONSUMER_PAUSE_S)
                        continue
                    # what waits its turn, and what is being handled, stays ours while this
                    # process lives; a dead one's comes back after ack_wait, which can be short
                    alive = asyncio.create_task(reader.keep_alive(burst))
                    try:
                        for delivery in burst:
                            await _handle(delivery)
                    finally:
                        alive.cancel()
            finally:
                await reader.stop()

        async def _handle(delivery: Any) -> None:
            try:
                try:
                    await handler(delivery.msg, delivery.meta)
                except Refused as exc:
                    await delivery.reject("validation", str(exc))
                    return
                except Exception as exc:
                    await delivery.retry(repr(exc))
                    return
                await delivery.ack()
            except Exception:  # settling failed: the server redelivers after ack_wait
                log.exception("bus: settling a delivery on %s failed", delivery.meta.subject)

        task = asyncio.create_task(run(), name=f"consume:{reader.stream}/{reader.durable}")
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
            info = await self.js.consumer_info(stream, durable)
        except nats.js.errors.NotFoundError:
            return None
        return info.num_pending + info.num_ack_pending

    # --- reading streams back -------------------------------------------------------------

    async def last_seq(self, stream: str) -> int:
        """The stream's last sequence (0 when it never held a message)."""
        return (await self.js.stream_info(stream)).state.last_seq

    async def message(self, stream: str, seq: int, subject: str | None = None) -> StoredMsg | None:
        """The message at `seq`; with `subject`, the first one at or after `seq` on it; None
        if there is none."""
        try:
            if subject is None:
                raw = await self.js.get_msg(stream, seq=seq)
            else:
                raw = await self.js.get_msg(stream, seq=seq, subject=subject, next=True)
        except nats.js.errors.NotFoundError:
            return None
        return StoredMsg(raw.subject or "", raw.seq or 0, raw.data or b"", raw.headers)

    async def last_raw(self, stream: str, subject: str | None = None) -> StoredMsg | None:
        """The newest message of the stream (on `subject`, if given); None if there is none."""
        if subject is None:
            info = (await self.js.stream_info(stream)).state
            if not info.last_seq or not info.messages:
                return None
            return await self.message(stream, info.last_seq)
        try:
            raw = await self.js.get_last_msg(stream, subject)
        except nats.js.errors.NotFoundError:
            return None
        return StoredMsg(raw.subject or subject, raw.seq or 0, raw.data or b"", raw.headers)

    async def read_all(self, stream: str, msg_type: type[T] | Any, *, batch: int = 256) -> list[T]:
        """Every message of `stream` that decodes as `msg_type`, in stream order ([] when the
        stream does not exist). An ephemeral consumer without acks reads it in batches, so a
        reader (the launcher's summary) sees what is stored, not what it happened to receive."""
        try:
            info = await self.js.stream_info(stream)
        except nats.js.errors.NotFoundError:
            return []
        if not info.state.messages:
            return []
        last = info.state.last_seq
        config = ConsumerConfig(
            ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL, inactive_threshold=30.0, mem_storage=True
        )
        sub = await self.js.pull_subscribe((info.config.subjects or [">"])[0], stream=stream, config=config)
        out: list[T] = []
        try:
            seq = 0
            while seq < last:
                try:
                    msgs = await sub.fetch(batch, timeout=1.0)
                except nats.errors.TimeoutError:
                    break  # what is left was removed meanwhile (limits): nothing more to read
                for raw in msgs:
                    seq = raw.metadata.sequence.stream
                    try:
                        out.append(decode(raw.data, msg_type))
                    except codec.DecodeError:
                        continue  # a reader of history skips what the consumers dead-lettered
        finally:
            try:
                await sub.unsubscribe()
            except Exception:  # the ephemeral consumer goes after inactive_threshold anyway
                pass
        return out

    @overload
    async def last(self, stream: str, msg_type: type[T], subject: str | None = None) -> T | None: ...
    @overload
    async def last(self, stream: str, msg_type: Any, subject: str | None = None) -> Any: ...
    async def last(self, stream: str, msg_type: type[T] | Any, subject: str | None = None) -> T | None:
        """The newest message of the stream (on `subject`, if given), decoded; None if there is
        none; `codec.DecodeError` if it does not decode as `msg_type`."""
        raw = await self.last_raw(stream, subject)
        return None if raw is None else decode(raw.data, msg_type)

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
        then gather every PubAck within `timeout`: a sequence, or the error, per message (a
        PubAck that did not come: nats.errors.TimeoutError)."""
        if not msgs:
            return []
        loop = self._loop or await self._open_replies()
        wait = _AckWait(len(msgs), loop.create_future())
        reply_tos = []
        timer = None
        try:
            for i, (subject, data, msg_id) in enumerate(msgs):
                reply_tos.append(reply_to := self._reply_to(partial(wait.take, i)))
                await self.nc.publish(subject, data, reply=reply_to, headers={MSG_ID_HEADER: msg_id})
            self.published.inc(len(msgs))
            timer = loop.call_later(timeout, _settle_future, wait.done, None)
            await wait.done
        finally:
            if timer is not None:
                timer.cancel()
            for reply_to in reply_tos:
                self._forget(reply_to)
        return [nats.errors.TimeoutError() if r is None else r for r in wait.results]

    async def dead_letter_quietly(self, subject: str, reason: DeadLetterReason, error: str, raw: bytes) -> None:
        """`dead_letter` for messages nothing redelivers (core requests): log what fails."""
        try:
            await self.dead_letter(subject, reason, error, raw)
        except DEAD_LETTER_ERRORS as exc:
            log.error("bus: could not dead-letter %s (%r)", subject, exc)

    # --- the fleet: its run table (KV, written by the registry alone) and run requests --------

    async def run_records(self, fleet: str) -> dict[str, RunRecord]:
        """Every run of `fleet` as the run table holds it now."""
        bucket = streams.runs_bucket(fleet)
        kv = await self.key_value(bucket)
        # The keys from the stream's own subject list, not `kv.keys()`: nats-py's key watcher
        # can end its initial replay early and return some of the keys (nats-io/nats.py#842,
        # #995), and a restarted fleet registry would then forget live runs. STREAM.INFO
        # answers from one snapshot of the stream.
        prefix = f"$KV.{bucket}."
        info = await self.js.stream_info(f"KV_{bucket}", subjects_filter=f"{prefix}>")
        keys = [subject.removeprefix(prefix) for subject in info.state.subjects or {}]
        out = {}
        for key in keys:
            with contextlib.suppress(nats.js.errors.KeyNotFoundError):
                entry = await kv.get(key)
                if entry.value:
                    out[key] = decode(entry.value, RunRecord)
        return out

    async def put_run_record(self, record: RunRecord) -> int:
        """Write one run's record (the registry's job); returns the bucket revision."""
        kv = await self.key_value(streams.runs_bucket(record.fleet))
        return await kv.put(subjects.token(record.run, "run"), codec.encode(record))

    async def watch_run_records(self, fleet: str, handler: Callable[[RunRecord], Awaitable[None]]) -> asyncio.Task:
        """`handler(record)` for every run of `fleet` now, then for every change, in order, in
        a background task (cancel it to stop). A record that does not decode is logged and
        skipped: the registry is the one writer, so it is a bug, not a message to retry."""
        kv = await self.key_value(streams.runs_bucket(fleet))
        watcher = await kv.watchall()

        async def run() -> None:
            try:
                async for entry in watcher:
                    if entry is None or not entry.value:  # end of the initial values; a delete
                        continue
                    try:
                        record = decode(entry.value, RunRecord)
                    except codec.DecodeError as exc:
                        log.error("bus: run record %s of fleet %s does not decode: %s", entry.key, fleet, exc)
                        continue
                    await handler(record)
            finally:
                with contextlib.suppress(Exception):
                    await watcher.stop()

        task = asyncio.create_task(run(), name=f"runs:{fleet}")
        self._consumers.add(task)
        task.add_done_callback(self._consumer_done)
        return task

    async def submit_run(self, fleet: str, run: str, config: dict[str, Any], *, timeout: float = 10.0) -> RunReply:
        """Ask the fleet's registry to add a run (`lorabus run submit`)."""
        request = RunSubmit(fleet=fleet, run=run, config=config)
        return await self.request(subjects.run_control(fleet, "submit"), request, RunReply, timeout=timeout)

    async def stop_run(self, fleet: str, run: str, reason: str = "", *, timeout: float = 10.0) -> RunReply:
        """Ask the fleet's registry to stop a run (`lorabus run stop`)."""
        request = RunStop(fleet=fleet, run=run, reason=reason)
        return await self.request(subjects.run_control(fleet, "stop"), request, RunReply, timeout=timeout)

    async def list_runs(self, fleet: str, *, timeout: float = 5.0) -> RunReply:
        """The fleet's runs (`lorabus run list`)."""
        return await self.request(subjects.run_control(fleet, "list"), RunList(fleet=fleet), RunReply, timeout=timeout)


decode = codec.decode
"""`codec.decode` (which also turns nesting too deep for the decoder into a "decode" error)."""
