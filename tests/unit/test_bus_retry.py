"""Which JetStream failures the Bus waits out (`nats_client.transient`) and how long
(`nats_client.retrying`): a cluster electing a leader, or a publish still being replicated, is
retried; any other answer of the server is not; a bound that runs out names the bus URL."""

from __future__ import annotations

import nats.errors
import nats.js.errors
import pytest

from proto import codec
from proto import messages as m
from services.common import nats_client
from services.common.nats_client import BusError, retrying, transient


def api_error(code: int, err_code: int, description: str) -> nats.js.errors.APIError:
    """The error nats-py raises for a JetStream API or PubAck error of this code."""
    try:
        nats.js.errors.APIError.from_error({"code": code, "err_code": err_code, "description": description})
    except nats.js.errors.APIError as exc:
        return exc
    raise AssertionError("from_error always raises")


ELECTION = api_error(503, 10008, "JetStream system temporarily unavailable")
IN_PROCESS = api_error(409, 10158, "duplicate message id is in process")

WAITED_OUT = [
    ELECTION,
    IN_PROCESS,
    nats.errors.TimeoutError(),  # no answer: a stream or consumer without a leader
    nats.errors.NoRespondersError(),
    nats.js.errors.NoStreamResponseError(),  # a publish nobody took: the stream's leader is gone
    nats.js.errors.ServiceUnavailableError(),  # a 503 status: no JetStream responded to the API
    nats.errors.ConnectionReconnectingError(),
    TimeoutError(),  # asyncio's, which nats-py's waits raise
]
ANSWERS = [
    api_error(404, 10059, "stream not found"),
    api_error(400, 10071, "wrong last sequence: 7"),
    api_error(503, 10039, "JetStream not enabled for account"),  # a 503 that is no election
    api_error(500, 10049, "stream create failed"),
    nats.js.errors.APIError(description="unreadable PubAck"),
    BusError("ledger: written by someone else"),
    ValueError("a bug"),
]


@pytest.mark.parametrize("exc", WAITED_OUT, ids=repr)
def test_a_recovering_server_or_cluster_is_transient(exc):
    assert transient(exc)


@pytest.mark.parametrize("exc", ANSWERS, ids=repr)
def test_an_answer_of_the_server_is_not(exc):
    assert not transient(exc)


def test_the_codes_waited_out_are_nats_servers_election_and_in_process():
    assert ELECTION.err_code in nats_client.RECOVERING_CODES and IN_PROCESS.err_code in nats_client.RECOVERING_CODES
    assert isinstance(ELECTION, nats.js.errors.ServiceUnavailableError) and IN_PROCESS.code == 409


def failing(errors: list[BaseException], result: int = 7):
    """A call that raises each of `errors` in turn, then returns `result`; `calls` counts them."""
    calls: list[int] = []

    async def call() -> int:
        calls.append(1)
        if len(calls) <= len(errors):
            raise errors[len(calls) - 1]
        return result

    return call, calls


async def test_a_publish_in_process_then_a_duplicate_ack_is_one_success():
    """The registry's ledger write after a node loss: its retry found the first attempt still in
    process (409), the next one is answered with the first attempt's sequence."""
    call, calls = failing([nats.errors.TimeoutError(), IN_PROCESS, IN_PROCESS], result=42)
    assert await retrying(call, "ledger write", "nats://a:4222,nats://b:4222", bound_s=5.0) == 42
    assert len(calls) == 4


async def test_an_answer_is_raised_at_once():
    wrong = api_error(400, 10071, "wrong last sequence: 7")
    call, calls = failing([ELECTION, wrong])
    with pytest.raises(nats.js.errors.APIError) as raised:
        await retrying(call, "ledger write", "nats://a:4222", bound_s=5.0)
    assert raised.value is wrong and len(calls) == 2


class Clock:
    """`time.monotonic` and `asyncio.sleep` for `retrying`: sleeping moves the clock, so the
    backoff is read exactly however loaded the machine is."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(round(seconds, 6))
        self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(nats_client.time, "monotonic", clock.monotonic)
    monkeypatch.setattr(nats_client.asyncio, "sleep", clock.sleep)
    return clock


async def test_a_bound_run_out_names_the_bus_url_the_call_and_the_last_error(clock):
    call, calls = failing([ELECTION] * 1000)
    url = "nats://a:4222,nats://b:4222,nats://c:4222"
    with pytest.raises(BusError) as raised:
        await retrying(call, "stream info LORABUS_r_ADAPTERS", url, bound_s=3.0)
    message = str(raised.value)
    assert message.startswith(f"bus.url: {url}, stream info LORABUS_r_ADAPTERS failed for 3 s")
    assert "ServiceUnavailableError" in message and "most of its nodes" in message
    assert raised.value.__cause__ is ELECTION
    # 50 ms doubling to 1 s, the last sleep cut to the bound, then one last attempt at it
    assert clock.slept == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 0.45] and len(calls) == 8


class Raw:
    def __init__(self, seq: int) -> None:
        from types import SimpleNamespace

        self.data = codec.encode(m.RunStop(fleet="f", run=f"r{seq}"))
        self.metadata = SimpleNamespace(sequence=SimpleNamespace(stream=seq))


class FlakySub:
    """A pull consumer whose second fetch is answered 503, as one on a node that just rejoined
    a cluster was (nats: ServiceUnavailableError, code None)."""

    def __init__(self, js: FlakyJs) -> None:
        self.js, self.next = js, 1

    async def fetch(self, batch: int, timeout: float) -> list[Raw]:
        self.js.fetches += 1
        if self.js.fetches == 2:
            raise nats.js.errors.ServiceUnavailableError
        msgs = [Raw(s) for s in range(self.next, min(self.next + batch, self.js.last + 1))]
        self.next += len(msgs)
        return msgs

    async def unsubscribe(self) -> None:
        self.js.consumers_closed += 1


class FlakyJs:
    def __init__(self, last: int) -> None:
        self.last, self.fetches, self.consumers, self.consumers_closed = last, 0, 0, 0

    async def stream_info(self, stream: str):
        from types import SimpleNamespace

        return SimpleNamespace(
            state=SimpleNamespace(messages=self.last, last_seq=self.last), config=SimpleNamespace(subjects=["a.>"])
        )

    async def pull_subscribe(self, subject: str, stream: str, config) -> FlakySub:
        self.consumers += 1
        return FlakySub(self)


class ReadBus:
    def __init__(self, js: FlakyJs) -> None:
        self.js, self.url = js, "nats://test"

    async def jetstream(self, what, call, *args, **kwargs):
        from functools import partial

        return await retrying(partial(call, *args, **kwargs), what, self.url, bound_s=5.0)


def test_a_read_cut_off_by_a_503_starts_over_and_returns_each_message_once():
    import asyncio

    from services.common import stream_reads

    js = FlakyJs(last=5)
    got = asyncio.run(stream_reads.read_all(ReadBus(js), "RUNS", m.RunStop, batch=2))
    assert [stop.run for stop in got] == ["r1", "r2", "r3", "r4", "r5"]
    assert js.consumers == 2 and js.consumers_closed == 2  # the cut-off pass's consumer is let go
