"""Durable pull consumers read in bursts, with the one delivery policy every service follows.

A `Puller` hands out decoded `Delivery`s; `keep_alive` keeps those being worked on from
redelivery, so a consumer's ack_wait is the time a dead reader's messages take to come back,
not a bound on how long a handler may run. What does not decode (bad JSON, wrong schema, too
large, nested too deep) never reaches the caller: it is dead-lettered and terminated here. A
caller settles each delivery with `ack()`, `nak(delay)`, `in_progress()`, `reject(reason,
error)` (dead-letter + terminate) or `retry(error)` (nak with backoff, dead-letter on the
`max_deliver`-th failure). Nothing is ever dropped unrecorded: a dead letter that cannot be
stored turns into a nak, so the server delivers the message again.

Two ways to pull (`keep_open`):
- kept open (the registry's trajectories): one pull request of `batch` stays open and is
  refilled at half, so a burst never waits a round trip; messages arrive while the caller works.
- fetched (everything else): a long poll for one message, then a no-wait pull for the rest of
  the burst. Nothing is delivered between bursts, so a stopped reader leaves behind only what
  it handed out, and that comes back after `ack_wait` in stream order.

Pull requests are plain core requests on `$JS.API.CONSUMER.MSG.NEXT` with a reply inbox per
request, so a status (408 expired, 404 no messages, 409) ends exactly the request it names.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Generic, Protocol, TypeVar

import msgspec
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from proto import codec
from proto.messages import DeadLetterReason
from services.common.nats_client import (
    DEAD_LETTER_ERRORS,
    MSG_ID_HEADER,
    TRANSIENT_ERRORS,
    Client,
    Handler,
    MsgMeta,
    OnRaw,
    Raw,
    Refused,
    decode,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

PULL_EXPIRES_S = 2.0
"""lifetime of one open pull request on the server; a new one is sent when it ends"""
FETCH_TIMEOUT_S = 1.0
"""long-poll length of one fetch; bounds how long `stop()` waits for a reader to notice"""
NO_WAIT_S = 1.0
"""how long a no-wait pull may take to answer before the burst goes on without it"""
IDLE_S = 0.5
"""pause after a pull request the server refused (deleted durable, no responders)"""
CONSUMER_PAUSE_S = 0.5
"""pause of a consumer whose pull failed with an unexpected error, before it pulls again"""
_ENDS_QUIETLY = {"404", "408"}  # no messages, request expired: the ordinary end of a pull
# what nats-py's Msg.ack/in_progress/term/nak send on a delivery's reply subject (an empty
# body is an ack)
ACK, IN_PROGRESS, TERM = b"", b"+WPI", b"+TERM"


class Link(Protocol):
    """What a puller needs of the Bus that made it (`Bus.pull`; the Bus imports this module)."""

    nc: Client
    service: str
    consumed: Any
    """the Bus's counter of deliveries received"""

    async def subscribe_direct(self, subject: str, on_raw: OnRaw, *, queue: str = "") -> Subscription: ...

    async def dead_letter(
        self, subject: str, reason: DeadLetterReason, error: str, raw: bytes, *, msg_id: str | None = None
    ) -> int: ...


def nak_payload(delay: float | None) -> bytes:
    """`-NAK`, with the redelivery delay in nanoseconds when there is one."""
    return b"-NAK" if not delay else b"-NAK " + msgspec.json.encode({"delay": int(delay * 10**9)})


def stream_position(reply: str) -> tuple[int, int] | None:
    """(stream sequence, times delivered) from a JetStream delivery's ack subject, or None if
    it is not one: the two facts of nats-py's `Msg.metadata` a consumer needs, without its
    datetime and dataclasses (read once per delivery on the registry's hot path).

    `$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<time>.<pending>`, or
    with `<domain>.<account hash>` after `ACK` (and an optional trailing token) in the newer form.
    """
    t = reply.split(".")
    if len(t) < 9 or t[0] != "$JS" or t[1] != "ACK":
        return None
    if len(t) == 9:
        return int(t[5]), int(t[4])
    if len(t) >= 11:
        return int(t[7]), int(t[6])
    return None


async def ack_all(deliveries: list[Delivery[T]]) -> None:
    """`ack()` each delivery not settled yet, as one pending command (a burst's acks)."""
    todo = [d for d in deliveries if not d.settled]
    if not todo:
        return
    for d in todo:
        d.settled = True
    try:
        await todo[0]._reader.bus.nc.publish_many([(d._raw.reply, "", ACK) for d in todo])
    except Exception as exc:  # the server redelivers after ack_wait
        log.debug("bus: acks not sent: %r", exc)


async def _settle(reader: Puller, raw: Raw, payload: bytes) -> None:
    """Ack/nak/term; if the connection is gone the server redelivers after ack_wait."""
    try:
        await reader.bus.nc.publish(raw.reply, payload)
    except Exception as exc:
        log.debug("bus: ack not sent: %r", exc)


class Delivery(Generic[T]):
    """One decoded message of a durable consumer, to be settled exactly once."""

    __slots__ = ("msg", "meta", "settled", "_raw", "_reader")

    def __init__(self, msg: T, meta: MsgMeta, raw: Raw, reader: Puller[T]):
        self.msg, self.meta, self._raw, self._reader = msg, meta, raw, reader
        self.settled = False
        """acked, nak'd or rejected: no longer this reader's to keep alive"""

    @property
    def data(self) -> bytes:
        """The bytes as stored (what a republish or a dead letter carries)."""
        return self._raw.data

    async def ack(self) -> None:
        await self._final(ACK)

    async def nak(self, delay: float | None = None) -> None:
        await self._final(nak_payload(delay))

    async def _final(self, payload: bytes) -> None:
        if self.settled:  # the server has its answer (nats-py: MsgAlreadyAckdError)
            return
        self.settled = True
        await _settle(self._reader, self._raw, payload)

    async def in_progress(self) -> None:
        """Restart the server's ack_wait clock: the message is still being worked on."""
        await _settle(self._reader, self._raw, IN_PROGRESS)

    async def reject(self, reason: DeadLetterReason, error: str) -> None:
        """Dead-letter and terminate; if the dead letter cannot be stored, nak instead."""
        self.settled = True
        await self._reader.reject(self._raw, self.meta, reason, error)

    async def retry(self, error: str) -> None:
        """The handler failed: nak with backoff, or dead-letter at the last delivery."""
        reader, n = self._reader, self.meta.num_delivered
        if 0 < reader.max_deliver <= n:
            log.error("bus: handler failed on %s, giving up: %s", self.meta.subject, error)
            await self.reject("handler", error)
            return
        log.warning("bus: handler failed on %s (delivery %d of %s): %s", self.meta.subject, n,
                    reader.max_deliver if reader.max_deliver > 0 else "unlimited", error)  # fmt: skip
        await self.nak(delay=reader.retry_delay_s * 2 ** (n - 1))


def _release(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


class Puller(Generic[T]):
    """A durable pull consumer read in bursts (create with `Bus.pull`)."""

    def __init__(self, bus: Link, stream: str, durable: str, msg_type: type[T] | Any, *, batch: int,
                 max_deliver: int, retry_delay_s: float, keep_open: bool, ack_wait_s: float = 30.0):  # fmt: skip
        self.bus, self.stream, self.durable, self.msg_type = bus, stream, durable, msg_type
        self.batch, self.max_deliver, self.retry_delay_s = batch, max_deliver, retry_delay_s
        self.keep_open, self.ack_wait_s = keep_open, ack_wait_s
        self._nc = bus.nc
        self._next = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}"
        self._inbox = bus.nc.new_inbox()
        self._buf: list[Raw] = []
        self._waiter: asyncio.Future | None = None
        """what `_wait` waits on: done when a message arrives or a pull request ends"""
        self._credit = 0
        """messages the open pull request(s) may still deliver"""
        self._requests = 0
        self._current = ""
        """the reply subject of the last request sent (a fetch has one open at a time)"""
        self._ended = True
        self._open_until = 0.0
        """when the last request has ended on the server at the latest (a lost one ends too)"""
        self._refused: str | None = None
        self._last_pull = 0.0
        self._sub: Subscription | None = None
        self._loop = asyncio.get_running_loop()  # kept: on Python 3.11 each lookup costs a getpid()

    async def start(self) -> None:
        self._sub = await self.bus.subscribe_direct(f"{self._inbox}.*", self._on_msg)

    async def stop(self) -> None:
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:  # connection already closed
                pass

    def _on_msg(self, msg: Raw) -> None:
        headers = msg.headers or {}
        status = headers.get("Status")
        if status is None:
            self._buf.append(msg)
            self._credit -= 1
            if self._credit <= 0:
                self._ended = True
        elif status == "100":  # idle heartbeat
            return
        else:
            if status not in _ENDS_QUIETLY:  # 409 max-ack-pending, deleted durable, 503, ...
                self._refused = status
                log.debug("bus: pull on %s/%s ended: %s %s", self.stream, self.durable, status,
                          headers.get("Description", ""))  # fmt: skip
            if self.keep_open:
                self._credit = 0
            elif msg.subject == self._current:  # a late status of an earlier fetch ends nothing
                self._credit, self._ended = 0, True
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None:
            _release(self._waiter)

    async def _pull(self, n: int, *, expires_s: float | None) -> None:
        """One pull request for `n` messages; without `expires_s` the server answers at once."""
        self._requests += 1
        self._current = f"{self._inbox}.{self._requests}"
        request: dict[str, Any] = {"batch": n}
        if expires_s is None:
            request["no_wait"] = True  # the server ignores no_wait when expires is present
        else:
            request["expires"] = int(expires_s * 1e9)
        self._credit = n if not self.keep_open else self._credit + n
        self._ended = False
        self._last_pull = time.monotonic()
        self._open_until = self._last_pull + (NO_WAIT_S if expires_s is None else expires_s) + 0.5
        await self._nc.publish(self._next, msgspec.json.encode(request), reply=self._current)

    async def _wait(self, timeout: float) -> None:
        """Until the next message or end of a pull request (`_wake`), or `timeout`: a future and
        a timer, where wait_for(Event.wait()) would make a task per wait (one per burst)."""
        waiter = self._waiter = self._loop.create_future()
        timer = self._loop.call_later(max(timeout, 0.0), _release, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    def _done(self) -> bool:
        return self._ended or time.monotonic() > self._open_until

    async def _until_ended(self) -> None:
        while not self._done():
            await self._wait(self._open_until - time.monotonic())

    # --- the two ways to pull ---------------------------------------------------------------

    async def _fill_open(self, deadline: float | None) -> None:
        """Keep one request open; return once something arrived (or at `deadline`)."""
        stale = time.monotonic() - self._last_pull > PULL_EXPIRES_S + 1.0
        if self._credit <= 0 or stale:  # also covers a request lost in a server restart
            await self._pull(self.batch, expires_s=PULL_EXPIRES_S)
        if not self._buf:
            wait = PULL_EXPIRES_S + 1.0
            await self._wait(wait if deadline is None else min(wait, deadline - time.monotonic()))

    async def _fetch(self, want: int, deadline: float | None) -> None:
        """Long-poll for one message, then take the rest of the burst that is already there."""
        if not self._buf:
            wait = FETCH_TIMEOUT_S if deadline is None else min(FETCH_TIMEOUT_S, deadline - time.monotonic())
            if wait <= 0:
                return
            if self._done():  # else the previous long poll is still open: wait on it
                await self._pull(1, expires_s=wait)
            await self._until_ended()
        if self._buf and want > len(self._buf) and self._done():
            await self._pull(want - len(self._buf), expires_s=None)
            await self._until_ended()

    async def burst(self, max_n: int | None = None, timeout: float | None = None) -> list[Delivery[T]]:
        """Every decodable message that has arrived, at least one and at most `max_n` (default
        `batch`); [] only when `timeout` passes first."""
        want = self.batch if max_n is None else max_n
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                if self.keep_open:
                    await self._fill_open(deadline)
                else:
                    await self._fetch(want, deadline)
            except TRANSIENT_ERRORS as exc:  # server restarting: nats-py reconnects
                log.debug("bus: pull on %s/%s: %r", self.stream, self.durable, exc)
                self._credit, self._ended = 0, True
                await asyncio.sleep(IDLE_S)
            raw, self._buf = self._buf[:want], self._buf[want:]
            if raw:
                self.bus.consumed.inc(len(raw))
            deliveries = [d for m in raw if (d := await self._decode(m)) is not None]
            if self.keep_open and deliveries and self._credit <= self.batch // 2:
                await self._pull(self.batch - self._credit, expires_s=PULL_EXPIRES_S)  # no wait next time
            if deliveries:
                return deliveries
            if deadline is not None and time.monotonic() >= deadline:
                return []
            if not raw and self._refused is not None:
                self._refused = None
                await asyncio.sleep(IDLE_S)  # e.g. the durable was deleted: do not spin

    async def keep_alive(self, deliveries: list[Delivery[T]]) -> None:
        """Restart the ack_wait clock of every unsettled delivery, three times per ack_wait,
        until cancelled: while this process lives its deliveries stay its own however long a
        handler takes, so ack_wait only bounds how soon a dead reader's deliveries come back."""
        while True:
            await asyncio.sleep(self.ack_wait_s / 3)
            for d in deliveries:
                if not d.settled:
                    await d.in_progress()

    async def _decode(self, raw: Raw) -> Delivery[T] | None:
        position = stream_position(raw.reply)
        if position is None:  # a form this reader does not know: nats-py's reading (or its error)
            info = Msg.Metadata._from_reply(raw.reply)
            position = info.sequence.stream, info.num_delivered
        headers = raw.headers
        meta = MsgMeta(raw.subject, position[0], position[1], headers.get(MSG_ID_HEADER) if headers else None)
        try:
            msg = decode(raw.data, self.msg_type)
        except codec.DecodeError as exc:
            await self.reject(raw, meta, exc.reason, str(exc))
            return None
        return Delivery(msg, meta, raw, self)

    async def reject(self, raw: Raw, meta: MsgMeta, reason: DeadLetterReason, error: str) -> None:
        # Derived from the stream position, so a redelivered poison message is recorded once.
        letter_id = f"{self.stream}:{meta.stream_seq}:{self.bus.service}"
        try:
            await self.bus.dead_letter(meta.subject, reason, error, raw.data, msg_id=letter_id)
        except DEAD_LETTER_ERRORS as exc:
            # Never drop a message we could not record: let the server deliver it again.
            log.error("bus: could not dead-letter %s (%r); will retry", meta.subject, exc)
            await _settle(self, raw, nak_payload(1.0))
            return
        await _settle(self, raw, TERM)


async def handle_all(reader: Puller, handler: Handler) -> None:
    """Run `handler(msg, meta)` on every delivery of `reader`, one at a time in stream order,
    until cancelled (then the reader stops; the durable keeps its position on the server).

    Returning acks; raising `Refused` dead-letters and terminates at once; raising anything else
    naks with a delay of `retry_delay_s * 2**(n-1)` (n = deliveries so far) and, on the
    `max_deliver`-th failure, dead-letters and terminates the message. Nothing but cancelling
    ends it: a failed pull is logged and pulled again.
    """

    async def handle(delivery: Delivery) -> None:
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

    try:
        while True:
            try:
                burst = await reader.burst()
            except Exception:  # a consumer never dies while its service lives
                log.exception("bus: pull on %s/%s failed; pulling again", reader.stream, reader.durable)
                await asyncio.sleep(CONSUMER_PAUSE_S)
                continue
            # what waits its turn, and what is being handled, stays ours while this process
            # lives; a dead one's comes back after ack_wait, which can be short
            alive = asyncio.create_task(reader.keep_alive(burst))
            try:
                for delivery in burst:
                    await handle(delivery)
            finally:
                alive.cancel()
    finally:
        await reader.stop()
