"""The Bus's direct path reads and writes what nats-py's own path does: header blocks, and the
ack/nak/term/progress bodies a pull delivery is settled with."""

from __future__ import annotations

import inspect

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from services.common.nats_client import Client as _Client
from services.common.nats_client import read_headers
from services.common.pull import ACK, IN_PROGRESS, TERM, nak_payload

HEADER_BLOCKS = [
    b"NATS/1.0\r\n\r\n",
    b"NATS/1.0\r\nNats-Msg-Id: c1-t7\r\n\r\n",
    b"NATS/1.0\r\nNats-Msg-Id: a\r\nNats-Expected-Last-Sequence: 12\r\nNats-Rollup: all\r\n\r\n",
    b"NATS/1.0\r\nName:Value\r\nOther:\tspaced  \r\n\r\n",  # no space after the colon; tabs
    b"NATS/1.0\r\nBad Name: x\r\n\x1cSep: y\r\nok: z\r\n\r\n",  # whitespace in a name: skipped
    b"NATS/1.0\r\n: empty name\r\nno colon here\r\n\r\n",
    b"NATS/1.0\r\nN\xc3\xa4me: non-ascii name\r\nV: caf\xc3\xa9 \xff\r\n\r\n",  # names ASCII, values UTF-8
    b"NATS/1.0\r\nK: a: b: c\r\nK: second\r\n\r\n",  # colons in the value; the last K wins
]


@pytest.mark.parametrize("block", HEADER_BLOCKS)
async def test_read_headers_reads_what_nats_py_reads(block):
    assert await Client()._process_headers(block) == read_headers(block)


def test_the_nats_py_hook_has_the_shape_the_bus_overrides():
    """`_Client` overrides nats-py's `_process_msg`; a release that renames or reshapes it
    would silently send direct subscriptions through the slow path (the integration test
    `test_direct_subscriptions_skip_nats_py_queue` notices that too)."""
    params = list(inspect.signature(Client._process_msg).parameters)
    assert params == ["self", "sid", "subject", "reply", "data", "headers"]
    assert inspect.iscoroutinefunction(Client._process_msg)
    assert _Client._process_msg is not Client._process_msg


class _Sent:
    """What a Msg's settle method hands to its client's publish (nats-py's own bodies)."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    async def publish(self, subject: str, payload: bytes = b"", **_: object) -> None:
        self.bodies.append(payload)


@pytest.mark.parametrize("delay", [None, 0, 0.25, 1.0, 8.0])
async def test_settle_bodies_are_nats_py_s(delay):
    sent = _Sent()
    reply = "$JS.ACK.S.c.1.2.3.1733222222000000000.0"
    await Msg(_client=sent, reply=reply).ack()
    await Msg(_client=sent, reply=reply).in_progress()
    await Msg(_client=sent, reply=reply).term()
    await Msg(_client=sent, reply=reply).nak(delay=delay)
    ack, progress, term, nak = sent.bodies
    assert (ack, progress, term) == (ACK, IN_PROGRESS, TERM)
    assert nak.replace(b" ", b"") == nak_payload(delay).replace(b" ", b"")


PUBLISHES = [
    ("lorabus.r1.decision.c1", "", b'{"schema_version":"1.0"}'),
    ("$JS.ACK.S.c.1.2.3.1733222222000000000.0", "", b""),
    ("lorabus.r1.admission", "_INBOX.abc.7", b"x" * 300),
]


def _buffering() -> _Client:
    """A client not connected yet: publishes wait in its pending buffer, as during a reconnect."""
    nc = _Client()
    nc._max_pending_size = 1 << 20
    return nc


async def test_publish_many_writes_what_publish_writes():
    one, many = _buffering(), _buffering()
    for subject, reply, data in PUBLISHES:
        await one.publish(subject, data, reply=reply)
    await many.publish_many(PUBLISHES)
    assert b"".join(many._pending) == b"".join(one._pending)
    assert (many.stats["out_msgs"], many.stats["out_bytes"]) == (one.stats["out_msgs"], one.stats["out_bytes"])


def _closed() -> _Client:
    nc = _buffering()
    nc._status = Client.CLOSED
    return nc


@pytest.mark.parametrize(
    "bad",
    [("", "", b"x"), ("a b", "", b"x"), ("a\r\nPUB x", "", b"x"), ("a", "r\n", b"x"), ("a", "", b"x" * (1 << 21)),
     ("a", "", b"x" * ((1 << 20) + 1)), ("a", "", b"x")],
)  # fmt: skip
@pytest.mark.parametrize("client", [_buffering, _Client, _closed])
async def test_publish_many_refuses_what_publish_refuses(bad, client):
    """Same error, in `publish`'s order of checks (a bad subject before a closed connection,
    the disconnected buffer before the payload limit); a refused batch sends nothing."""
    one = client()
    try:
        for subject, reply, data in [PUBLISHES[0], bad]:
            await one.publish(subject, data, reply=reply)
        theirs = None
    except Exception as exc:
        theirs = type(exc)
    many = client()
    try:
        await many.publish_many([PUBLISHES[0], bad])
        ours = None
    except Exception as exc:
        ours = type(exc)
        assert not many._pending
    assert ours is theirs
