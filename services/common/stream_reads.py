"""Reading a run's streams back: one message by sequence, the newest, or all of them in order.

What the launcher's summary, the registry's replay and the run table read. Every call goes
through the Bus's retrying `jetstream`, so a recovering server or cluster is a pause here too;
a stream or message that does not exist is None or [], never an error.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from proto import codec
from services.common.nats_client import StoredMsg, decode

T = TypeVar("T")
R = TypeVar("R")


class Bus(Protocol):
    """What a read needs of `services.common.bus.Bus` (named here so the two modules do not
    import each other): its JetStream context and its retrying call."""

    js: JetStreamContext

    async def jetstream(self, what: str, call: Callable[..., Awaitable[R]], *args: Any, **kwargs: Any) -> R: ...


async def message(bus: Bus, stream: str, seq: int, subject: str | None = None) -> StoredMsg | None:
    """The message at `seq`; with `subject`, the first one at or after `seq` on it; None
    if there is none."""
    what = f"read message {seq} of {stream}"
    try:
        if subject is None:
            raw = await bus.jetstream(what, bus.js.get_msg, stream, seq=seq)
        else:
            raw = await bus.jetstream(what, bus.js.get_msg, stream, seq=seq, subject=subject, next=True)
    except nats.js.errors.NotFoundError:
        return None
    return StoredMsg(raw.subject or "", raw.seq or 0, raw.data or b"", raw.headers)


async def last_raw(bus: Bus, stream: str, subject: str | None = None) -> StoredMsg | None:
    """The newest message of the stream (on `subject`, if given); None if there is none."""
    if subject is None:
        info = (await bus.jetstream(f"stream info {stream}", bus.js.stream_info, stream)).state
        if not info.last_seq or not info.messages:
            return None
        return await message(bus, stream, info.last_seq)
    try:
        raw = await bus.jetstream(f"read the last {subject} of {stream}", bus.js.get_last_msg, stream, subject)
    except nats.js.errors.NotFoundError:
        return None
    return StoredMsg(raw.subject or subject, raw.seq or 0, raw.data or b"", raw.headers)


async def read_all(bus: Bus, stream: str, msg_type: type[T] | Any, *, batch: int = 256) -> list[T]:
    """Every message of `stream` that decodes as `msg_type`, in stream order ([] when the
    stream does not exist). An ephemeral consumer without acks reads it in batches, so a
    reader (the launcher's summary) sees what is stored, not what it happened to receive. A
    read cut off by a recovering server or cluster (a fetch answered 503 by a node that has
    just rejoined) starts over on a fresh consumer: reading is idempotent."""
    try:
        info = await bus.jetstream(f"stream info {stream}", bus.js.stream_info, stream)
    except nats.js.errors.NotFoundError:
        return []
    if not info.state.messages:
        return []
    subject, last = (info.config.subjects or [">"])[0], info.state.last_seq
    return await bus.jetstream(f"read {stream}", _read_to, bus.js, stream, subject, last, msg_type, batch)


async def _read_to(
    js: JetStreamContext, stream: str, subject: str, last: int, msg_type: type[T] | Any, batch: int
) -> list[T]:
    """One pass over `stream` up to sequence `last`, on an ephemeral consumer of its own."""
    config = ConsumerConfig(
        ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL, inactive_threshold=30.0, mem_storage=True
    )
    sub = await js.pull_subscribe(subject, stream=stream, config=config)
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
