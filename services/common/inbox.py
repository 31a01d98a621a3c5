"""One reply inbox per Bus for every answer it waits for: core requests and PubAcks.

nats-py's request costs a random token, a NUID, a done-callback and a wait_for (a waiter and a
timer) per call, and its publish_async a semaphore, a token and a future per message; these run
several times per decision (rollout, registry). Here: a counter, a dict entry and one timer per
wait, on one wildcard subscription (`<inbox>.*`) opened on first use.

Invariant: every reply subject handed out is forgotten when its waiter ends (answered, timed out
or cancelled), so `waits` holds exactly the answers still awaited.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import nats.errors

from services.common.nats_client import MSG_ID_HEADER, NO_RESPONDERS, Client, OnRaw, Raw, stored_seq

Subscribe = Callable[[str, OnRaw], Awaitable[Any]]
"""how the inbox subscribes its wildcard (`Bus.subscribe_direct`: the Bus's to close)"""


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


class Inbox:
    def __init__(self, nc: Client, subscribe: Subscribe):
        self.nc, self._subscribe = nc, subscribe
        self._loop: asyncio.AbstractEventLoop | None = None
        """the loop the inbox runs on (kept: on Python 3.11 each lookup costs a getpid())"""
        self._prefix = ""
        self._next = 0
        self.waits: dict[str, Callable[[Raw], None]] = {}
        """what to do with each awaited reply (an answer, a PubAck), by its reply subject's last token"""

    async def _open(self) -> asyncio.AbstractEventLoop:
        """Subscribe the inbox (once); the loop it runs on."""
        if self._loop is None:
            # set before the await: a request made meanwhile uses this inbox (its SUB goes out
            # first, on the same connection) instead of subscribing a second one
            loop = self._loop = asyncio.get_running_loop()
            self._prefix = self.nc.new_inbox() + "."
            try:
                await self._subscribe(self._prefix + "*", self._on_reply)
            except BaseException:
                self._loop = None
                raise
            return loop
        return self._loop

    def _reply_to(self, on_reply: Callable[[Raw], None]) -> str:
        """A reply subject whose one message goes to `on_reply` (drop it with `_forget`)."""
        self._next += 1
        key = str(self._next)
        self.waits[key] = on_reply
        return self._prefix + key

    def _forget(self, reply_to: str) -> None:
        self.waits.pop(reply_to[len(self._prefix) :], None)

    def _on_reply(self, msg: Raw) -> None:
        on_reply = self.waits.pop(msg.subject[len(self._prefix) :], None)
        if on_reply is not None:  # else its waiter gave up
            on_reply(msg)

    async def request(self, subject: str, data: bytes, headers: dict[str, str] | None, timeout: float) -> Raw:
        """Core request: the reply, or nats.errors.TimeoutError / NoRespondersError as nats-py."""
        loop = self._loop or await self._open()
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
        if reply.headers and reply.headers.get("Status") == NO_RESPONDERS:
            raise nats.errors.NoRespondersError
        return reply

    async def publish_all(
        self, msgs: list[tuple[str, bytes, str]], timeout: float, on_sent: Callable[[int], None]
    ) -> list[int | BaseException]:
        """JetStream-publish `(subject, data, msg_id)`s without waiting for each ack in turn
        (`on_sent(n)` once all are out), then gather every PubAck within `timeout`: a sequence,
        or the error, per message (a PubAck that did not come: nats.errors.TimeoutError)."""
        if not msgs:
            return []
        loop = self._loop or await self._open()
        wait = _AckWait(len(msgs), loop.create_future())
        reply_tos = []
        timer = None
        try:
            for i, (subject, data, msg_id) in enumerate(msgs):
                reply_tos.append(reply_to := self._reply_to(partial(wait.take, i)))
                await self.nc.publish(subject, data, reply=reply_to, headers={MSG_ID_HEADER: msg_id})
            on_sent(len(msgs))
            timer = loop.call_later(timeout, _settle_future, wait.done, None)
            await wait.done
        finally:
            if timer is not None:
                timer.cancel()
            for reply_to in reply_tos:
                self._forget(reply_to)
        return [nats.errors.TimeoutError() if r is None else r for r in wait.results]
