"""The pull reader's own reading of a delivery's ack subject agrees with nats-py's `metadata`."""

from __future__ import annotations

import pytest
from nats.aio.msg import Msg

from services.common.pull import stream_position

ACK_SUBJECTS = [
    # the form nats-server 2.x sends without a domain
    "$JS.ACK.LORABUS_r1_TRAJECTORIES.registry-trajectories.1.4711.4702.1733222222000000000.17",
    "$JS.ACK.S.c.3.1.1.1733222222000000000.0",
    # the newer form: domain and account hash, with and without the trailing token
    "$JS.ACK.hub.ACCHASH.S.c.2.99.98.1733222222000000000.5",
    "$JS.ACK._.ACCHASH.S.c.7.123456789.120.1733222222000000000.0.x7Yz",
]


@pytest.mark.parametrize("reply", ACK_SUBJECTS)
def test_stream_position_reads_what_nats_py_reads(reply):
    info = Msg.Metadata._from_reply(reply)
    assert stream_position(reply) == (info.sequence.stream, info.num_delivered)


@pytest.mark.parametrize("reply", ["", "_INBOX.abc.1", "$JS.API.CONSUMER.MSG.NEXT.S.c", "$JS.ACK.S.c.1.2.3.4"])
def test_stream_position_of_anything_else_is_none(reply):
    assert stream_position(reply) is None
