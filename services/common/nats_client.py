"""What lorabus reaches of nats-py, below the Bus: the client, raw messages, errors, connecting,
and which failures are waited out (`transient`, `retrying`).

The Bus (`bus.py`) and its pullers (`pull.py`) build on this module and on nothing of each
other's: it holds the pieces both need. What it reaches of nats-py's internals is in `Client`
alone (direct subscriptions and batched publishes, each tested against nats-py's own path);
`connect` turns a `BusConfig` into an open connection, with the credentials and TLS it names.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import ssl
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import msgspec
import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as _NatsClient
from prometheus_client import Counter

from proto import codec
from services.config.schema import BusConfig

log = logging.getLogger(__name__)

MSG_ID_HEADER = "Nats-Msg-Id"
RECONNECT_WAIT_S = 0.5
NO_RESPONDERS = "503"  # the status of a request nobody (no stream) answers

RECONNECTS = Counter(
    "lorabus_bus_reconnects_total",
    "Reconnections to the NATS server after a lost connection",
    ["service"],
)

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


RECOVER_S = 30.0
"""how long a JetStream call is retried while the server or cluster recovers: a cluster that
loses a node elects a new leader for each group the node led once its followers miss the
leader's heartbeats for their election timeout (4-9 s in nats-server's raft.go), the metadata
group's and a stream's in turn; a restarted single server takes a few seconds"""

RECOVERING_CODES = frozenset({
    10008,  # 503 "JetStream system temporarily unavailable": no metadata leader, an election
    10158,  # 409 "duplicate message id is in process": an earlier attempt with this Nats-Msg-Id
            # is proposed to the stream's group, not yet stored; once it is, the same publish is
            # answered as a duplicate with its sequence (or, after a leader change, stored anew)
})  # fmt: skip
"""JetStream API error codes that say "not now" rather than "no": the same call may succeed"""

T = TypeVar("T")


class BusError(RuntimeError):
    pass


class Refused(ValueError):
    """Raised by a handler: the message is wrong for good (a forged or out-of-order event), so
    it is dead-lettered at once as "validation" with this message, not retried."""


class SequenceMismatch(BusError):
    """A `publish_expect` found the stream past the expected sequence: someone else wrote."""


DEAD_LETTER_ERRORS: tuple[type[BaseException], ...] = (BusError, *TRANSIENT_ERRORS)
"""what `dead_letter` raises when it could not record the message"""


def transient(exc: BaseException) -> bool:
    """Whether the JetStream call that raised `exc` may succeed if made again unchanged: the
    server is unreachable or restarting, a cluster is electing a leader (no answer in time, no
    responders, 503 10008), or a publish's earlier attempt is still being stored (409 10158).
    Any other API error is the server's answer (not found, refused, wrong last sequence)."""
    if isinstance(exc, nats.js.errors.APIError) and exc.err_code is not None:
        return exc.err_code in RECOVERING_CODES
    return isinstance(exc, TRANSIENT_ERRORS)


_UNAVAILABLE_FIX = "is nats-server up, and in a cluster are most of its nodes up and routed to each other?"


async def retrying(call: Callable[[], Awaitable[T]], what: str, url: str, bound_s: float = RECOVER_S, *,
                   fix: str = _UNAVAILABLE_FIX) -> T:  # fmt: skip
    """`await call()`, made again with backoff (50 ms doubling to 1 s) while it fails with a
    `transient` error, for `bound_s` at most; then `BusError` naming the bus URL, `what` failed
    and `fix`. Only for calls that may be repeated: reads, idempotent creates and updates,
    publishes (stored once if they carry a Nats-Msg-Id)."""
    deadline = time.monotonic() + bound_s
    delay, failures = 0.05, 0
    while True:
        try:
            result = await call()
        except Exception as exc:
            if not transient(exc):
                if failures:  # an answer at last, if not the one hoped for (a version not there)
                    log.info("bus: %s answered after %d retries", what, failures)
                raise
            failures += 1
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                problem = f"{what} failed for {bound_s:g} s ({type(exc).__name__}: {exc})"
                raise BusError(f"bus.url: {url}, {problem}; {fix}") from exc
            if failures == 1:
                log.warning("bus: %s: %r; retrying for up to %g s", what, exc, bound_s)
            await asyncio.sleep(min(delay, remaining))  # the last attempt is made at the bound
            delay = min(2 * delay, 1.0)
            continue
        if failures:
            log.info("bus: %s answered after %d retries", what, failures)
        return result


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


class Client(_NatsClient):
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
    if reply.headers and reply.headers.get("Status") == NO_RESPONDERS:
        raise nats.js.errors.NoStreamResponseError
    try:
        ack = _pub_ack.decode(reply.data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise nats.js.errors.APIError(description=f"unreadable PubAck {reply.data[:200]!r}: {exc}") from None
    if ack.error is not None:
        raise nats.js.errors.APIError.from_error(ack.error)
    return ack.seq


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
    if cfg.tls_ca or cfg.tls_cert or "tls://" in cfg.url:
        if bool(cfg.tls_cert) != bool(cfg.tls_key):
            raise BusError("bus.tls_cert/bus.tls_key: give both for client certificates, or neither")
        context = ssl.create_default_context(cafile=cfg.tls_ca)
        if cfg.tls_cert:
            context.load_cert_chain(cfg.tls_cert, cfg.tls_key)
        options["tls"] = context
    return options


def servers(cfg: BusConfig) -> list[str]:
    """The URLs of `bus.url`: one server, or a cluster's nodes comma-separated (the client
    fails over between them and learns the rest of the cluster from the one it reaches)."""
    urls = [url.strip() for url in cfg.url.split(",")]
    for url in urls:
        if not url.startswith(("nats://", "tls://")) or url in ("nats://", "tls://"):
            raise BusError(
                f"bus.url: {url!r} is not a NATS URL; give nats://host:port (or tls://), several "
                "comma-separated for a cluster"
            )
    return urls


async def connect(cfg: BusConfig, *, run: str, service: str) -> Client:
    """An open connection, after retrying for up to `cfg.connect_timeout_s` (a service may start
    before the server); afterwards nats-py reconnects on its own, every RECONNECT_WAIT_S."""
    urls = servers(cfg)
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
                servers=urls,
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
    return nc


decode = codec.decode
"""`codec.decode` (which also turns nesting too deep for the decoder into a "decode" error)."""
