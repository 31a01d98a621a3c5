"""The Bus's direct path reads and writes what nats-py's own path does: header blocks, and the
ack/nak/term/progress bodies a pull delivery is settled with."""

from __future__ import annotations

import inspect

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from services.common.bus import _Client, read_headers
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
    await Msg(_client=sent, reply=reply).ack()  # type: ignore[arg-type]
    await Msg(_client=sent, reply=reply).in_progress()  # type: ignore[arg-type]
    await Msg(_client=sent, reply=reply).term()  # type: ignore[arg-type]
    await Msg(_client=sent, reply=reply).nak(delay=delay)  # type: ignore[arg-type]
    ack, progress, term, nak = sent.bodies
    assert (ack, progress, term) == (ACK, IN_PROGRESS, TERM)
    assert nak.replace(b" ", b"") == nak_payload(delay).replace(b" ", b"")
