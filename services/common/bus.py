"""The bus client every service uses: nats-py core NATS + JetStream, typed with `proto`.

What it adds over nats-py: messages are encoded/decoded with `proto.codec`; anything a
service cannot decode, or keeps failing on, goes to the run's dead-letter stream instead of
blocking the consumer or being dropped silently; JetStream publishes carry a `Nats-Msg-Id`
so retries are deduplicated; and every message is counted for Prometheus.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal, TypeVar, get_args, get_type_hints

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
from proto.messages import DeadLetter
from services.common import streams
from services.common.config_schema import BusConfig

log = logging.getLogger(__name__)

T = TypeVar("T")

MSG_ID_HEADER = "Nats-Msg-Id"
DEAD_LETTER_RAW_BYTES = 64 * 1024
DEAD_LETTER_REASONS: tuple[str, ...] = get_args(get_type_hints(DeadLetter)["reason"])
DEAD_LETTER_ERROR_CHARS = 2000
RECONNECT_WAIT_S = 0.5
PUBLISH_TIMEOUT_S = 10.0
"""total time `publish` keeps retrying while the server is unreachable or recovering"""
FETCH_TIMEOUT_S = 1.0
CLOSE_TIMEOUT_S = 5.0
"""how long close() waits for consumers to stop and the connection to drain"""
BURST_WAIT_S = 0.005
"""how long a consumer waits for more of a burst once one message has arrived"""
"""long-poll length of one pull; bounds how long `close()` waits for a consumer to notice"""

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
_TRANSIENT = (
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


class MsgMeta(msgspec.Struct, frozen=True):
    """Delivery facts a handler may need (idempotency, logging, retry decisions)."""

    subject: str
    stream_seq: int
    """0 for core NATS messages"""
    num_delivered: int
    msg_id: str | None = None


Handler = Callable[[Any, MsgMeta], Awaitable[None]]


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

    def __init__(self, nc: Client, run: str, service: str):
        self.nc = nc
        self.js = nc.jetstream()
        self.run = subjects.token(run, "run")
        self.service = subjects.token(service, "service")
        self._consumers: set[asyncio.Task] = set()
        self._subs: list[Subscription] = []

    # --- connection ---------------------------------------------------------------------

    @classmethod
    async def connect(cls, cfg: BusConfig, *, run: str, service: str) -> Bus:
        """Connect, retrying for up to `cfg.connect_timeout_s` (a service may start before
        the server); afterwards nats-py reconnects on its own, every RECONNECT_WAIT_S."""
        subjects.token(run, "run")
        subjects.token(service, "service")
        options = _connect_options(cfg)

        nc = Client()

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
                    connect_timeout=cfg.connect_timeout_s,
                    allow_reconnect=True,
                    max_reconnect_attempts=cfg.max_reconnect_attempts,
                    reconnect_time_wait=RECONNECT_WAIT_S,
                    disconnected_cb=on_disconnect,
                    reconnected_cb=on_reconnect,
                    error_cb=on_error,
                    **options,
                ),
                timeout=cfg.connect_timeout_s,
            )
        except (asyncio.TimeoutError, OSError, nats.errors.Error) as exc:
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

    async def close(self) -> None:
        """Stop consumers (un-acked messages are redelivered to the next owner of the
        durable), then drain: pending publishes are flushed, subscriptions finish."""
        tasks = list(self._consumers)
        for task in tasks:
            task.cancel()
        # a consumer's last unsubscribe needs the server: never let a lost server hold close()
        await asyncio.wait(tasks, timeout=CLOSE_TIMEOUT_S) if tasks else None
        if self.nc.is_closed:
            return
        if not self.nc.is_connected:  # draining needs the server; don't wait for a reconnect
            await self.nc.close()
            return
        try:
            await asyncio.wait_for(self.nc.drain(), CLOSE_TIMEOUT_S)
        except (asyncio.TimeoutError, nats.errors.ConnectionClosedError,
                nats.errors.FlushTimeoutError, nats.errors.DrainTimeoutError):
            await self.nc.close()

    # --- streams and KV -----------------------------------------------------------------

    async def ensure_streams(self) -> None:
        """Create every stream of the run, or update it to the current definition."""
        for config in streams.stream_configs(self.run):
            try:
                await self.js.stream_info(config.name)
            except nats.js.errors.NotFoundError:
                await self.js.add_stream(config)
                continue
            try:
                await self.js.update_stream(config)
            except nats.js.errors.BadRequestError as exc:
                raise BusError(
                    f"stream {config.name}: existing stream cannot be changed to the current "
                    f"definition ({exc.description}); delete it (`nats stream rm`) or keep the "
                    "old settings"
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

    async def _publish_raw(
        self, subject: str, data: bytes, *, msg_id: str | None, timeout: float
    ) -> int:
        headers = {MSG_ID_HEADER: msg_id} if msg_id else None
        deadline = time.monotonic() + timeout
        delay = 0.05
        while True:
            remaining = deadline - time.monotonic()
            try:
                ack = await self.js.publish(
                    subject, data, headers=headers, timeout=max(0.1, min(remaining, 2.0))
                )
                MESSAGES.labels(self.service, "published").inc()
                return ack.seq
            except _TRANSIENT as exc:
                if time.monotonic() + delay >= deadline:
                    raise BusError(
                        f"publish {subject}: no JetStream ack within {timeout}s "
                        f"({type(exc).__name__}); is a stream capturing it (ensure_streams) "
                        "and is the server up?"
                    ) from exc
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    async def publish_core(self, subject: str, msg: msgspec.Struct) -> None:
        """Core NATS publish: fire and forget, not persisted."""
        await self.nc.publish(subject, codec.encode(msg))
        MESSAGES.labels(self.service, "published").inc()

    async def dead_letter(
        self, subject: str, reason: str, error: str, raw: bytes, *, msg_id: str | None = None
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
        seq = await self.publish(
            subjects.dead_letter(self.run, self.service), letter, msg_id=msg_id
        )
        DEAD_LETTERS.labels(self.service, reason).inc()
        log.warning("bus: dead-lettered a message on %s (%s): %s", subject, reason, error[:200])
        return seq

    # --- request/reply ------------------------------------------------------------------

    async def request(
        self, subject: str, msg: msgspec.Struct, reply_type: type[T] | Any, *, timeout: float = 2.0
    ) -> T:
        """Core request/reply; raises `nats.errors.TimeoutError` when nobody answers in time
        and `proto.codec.DecodeError` when the reply is not a `reply_type`."""
        reply = await self.nc.request(subject, codec.encode(msg), timeout=timeout)
        MESSAGES.labels(self.service, "published").inc()
        MESSAGES.labels(self.service, "consumed").inc()
        return codec.decode(reply.data, reply_type)

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
            MESSAGES.labels(self.service, "consumed").inc()
            try:
                request = codec.decode(nats_msg.data, request_type)
            except codec.DecodeError as exc:
                await self._dead_letter_quietly(nats_msg.subject, exc.reason, str(exc), nats_msg.data)
                return
            try:
                reply = await handler(request)
            except Exception as exc:
                log.exception("bus: handler for %s failed", subject)
                await self._dead_letter_quietly(nats_msg.subject, "handler", repr(exc), nats_msg.data)
                return
            if nats_msg.reply:
                await nats_msg.respond(codec.encode(reply))
                MESSAGES.labels(self.service, "published").inc()

        sub = await self.nc.subscribe(subject, queue=queue, cb=on_request)
        self._subs.append(sub)
        return sub

    # --- subscriptions ------------------------------------------------------------------

    async def subscribe(self, subject: str, msg_type: type[T] | Any, handler: Handler) -> Subscription:
        """Ephemeral core subscription (live events only, no replay, no acks).
        `handler(msg, meta)`; undecodable messages are dead-lettered, handler errors logged."""

        async def on_msg(nats_msg: Msg) -> None:
            MESSAGES.labels(self.service, "consumed").inc()
            try:
                msg = codec.decode(nats_msg.data, msg_type)
            except codec.DecodeError as exc:
                await self._dead_letter_quietly(nats_msg.subject, exc.reason, str(exc), nats_msg.data)
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
        """Run a durable pull consumer in a background task; returns the task (cancel it to
        stop this consumer; the durable keeps its position on the server).

        Messages are handled one at a time in stream order. `handler(msg, meta)` returning
        acks; raising naks with a delay of `retry_delay_s * 2**(n-1)` (n = deliveries so
        far) and, on the `max_deliver`-th failure, dead-letters and terminates the message.
        An undecodable message is dead-lettered and terminated at once.
        """
        if deliver not in _DELIVER:
            raise BusError(f"deliver: {deliver!r} is not one of {sorted(_DELIVER)}")
        if batch < 1 or max_deliver < 1 or ack_wait_s <= 0:
            raise BusError(
                f"consume {durable}: batch ({batch}) and max_deliver ({max_deliver}) must be "
                f">= 1 and ack_wait_s ({ack_wait_s}) > 0"
            )
        config = ConsumerConfig(
            durable_name=durable,
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=_DELIVER[deliver],
            ack_wait=ack_wait_s,
            max_deliver=max_deliver,
            filter_subject=filter_subject,
            max_ack_pending=max(batch, 1000),
        )
        try:
            await self.js.add_consumer(stream, config)
        except nats.js.errors.NotFoundError as exc:
            raise BusError(
                f"consume {durable}: stream {stream!r} does not exist; call ensure_streams() "
                "first, with stream names from services.common.streams"
            ) from exc
        except nats.js.errors.BadRequestError as exc:
            raise BusError(
                f"consume {durable}: existing durable on {stream} has an incompatible config "
                f"({exc.description}); pick a new durable name or delete the old one"
            ) from exc
        psub = await self.js.pull_subscribe_bind(durable=durable, stream=stream)

        async def run() -> None:
            try:
                while True:
                    try:
                        # nats-py's fetch(n > 1) on an empty stream lingers until its
                        # timeout collecting a full batch, so a trickle of messages would
                        # wait up to FETCH_TIMEOUT_S each: long-poll for one, then take
                        # whatever burst is already there with a short second pull.
                        msgs = await psub.fetch(1, timeout=FETCH_TIMEOUT_S)
                        if batch > 1:
                            try:
                                msgs += await psub.fetch(batch - 1, timeout=BURST_WAIT_S)
                            except nats.errors.TimeoutError:
                                pass
                    except nats.errors.TimeoutError:
                        continue
                    except _TRANSIENT as exc:  # server restarting: nats-py reconnects
                        log.debug("bus: fetch on %s/%s: %r", stream, durable, exc)
                        await asyncio.sleep(RECONNECT_WAIT_S)
                        continue
                    except nats.js.errors.APIError as exc:  # e.g. the durable was deleted
                        log.warning("bus: fetch on %s/%s failed: %s", stream, durable, exc)
                        await asyncio.sleep(RECONNECT_WAIT_S * 4)
                        continue
                    for nats_msg in msgs:
                        await self._handle_delivery(
                            nats_msg, msg_type, handler, max_deliver, retry_delay_s
                        )
            finally:
                try:
                    await psub.unsubscribe()
                except Exception:  # connection already gone: nothing left to unsubscribe
                    pass

        task = asyncio.create_task(run(), name=f"consume:{stream}/{durable}")
        self._consumers.add(task)
        task.add_done_callback(self._consumer_done)
        return task

    def _consumer_done(self, task: asyncio.Task) -> None:
        self._consumers.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("bus: consumer %s stopped", task.get_name(), exc_info=task.exception())

    async def _handle_delivery(
        self,
        nats_msg: Msg,
        msg_type: Any,
        handler: Handler,
        max_deliver: int,
        retry_delay_s: float,
    ) -> None:
        MESSAGES.labels(self.service, "consumed").inc()
        info = nats_msg.metadata
        headers = nats_msg.headers or {}
        meta = MsgMeta(
            subject=nats_msg.subject,
            stream_seq=info.sequence.stream,
            num_delivered=info.num_delivered,
            msg_id=headers.get(MSG_ID_HEADER),
        )
        # Derived from the stream position, so a redelivered poison message is recorded once.
        letter_id = f"{info.stream}:{meta.stream_seq}:{self.service}"
        try:
            msg = codec.decode(nats_msg.data, msg_type)
        except codec.DecodeError as exc:
            await self._dead_letter_or_retry(nats_msg, meta, exc.reason, str(exc), letter_id)
            return
        try:
            await handler(msg, meta)
        except Exception as exc:
            if meta.num_delivered >= max_deliver:
                log.exception("bus: handler failed on %s, giving up", meta.subject)
                await self._dead_letter_or_retry(nats_msg, meta, "handler", repr(exc), letter_id)
            else:
                log.warning(
                    "bus: handler failed on %s (delivery %d of %d): %r",
                    meta.subject, meta.num_delivered, max_deliver, exc,
                )  # fmt: skip
                await self._settle(nats_msg.nak(delay=retry_delay_s * 2 ** (meta.num_delivered - 1)))
            return
        await self._settle(nats_msg.ack())

    async def _dead_letter_or_retry(
        self, nats_msg: Msg, meta: MsgMeta, reason: str, error: str, letter_id: str
    ) -> None:
        try:
            await self.dead_letter(meta.subject, reason, error, nats_msg.data, msg_id=letter_id)
        except (BusError, *_TRANSIENT) as exc:
            # Never drop a message we could not record: let the server deliver it again.
            log.error("bus: could not dead-letter %s (%r); will retry", meta.subject, exc)
            await self._settle(nats_msg.nak(delay=1.0))
            return
        await self._settle(nats_msg.term())

    async def _settle(self, ack: Awaitable[None]) -> None:
        """Ack/nak/term; if the connection is gone the server redelivers after ack_wait."""
        try:
            await ack
        except (nats.errors.Error, *_TRANSIENT) as exc:
            log.debug("bus: ack not sent: %r", exc)

    async def _dead_letter_quietly(self, subject: str, reason: str, error: str, raw: bytes) -> None:
        try:
            await self.dead_letter(subject, reason, error, raw)
        except (BusError, *_TRANSIENT) as exc:
            log.error("bus: could not dead-letter %s (%r)", subject, exc)
