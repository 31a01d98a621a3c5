"""The rollout's work loop with fake runs: a round waits for every batch, or, when the engine
batches continuously (`streaming`), the loop tops up as soon as one batch is served; never more
than `batch_groups` grants in flight; a stop lets the batches in flight finish."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from proto.messages import AdmissionDeny, AdmissionGrant
from services.rollout.work import work_loop

pytestmark = pytest.mark.unit


class Book:
    def __init__(self) -> None:
        self.newest: int | None = 1

    def head(self) -> int | None:
        return self.newest


class FakeRun:
    """Serves each grant for the time its id names: grants 'g<k>' alternate long and short."""

    def __init__(self, durations):
        self.run_id, self.book, self.draining = "r", Book(), False
        self.durations = durations
        self.in_flight = 0
        self.peak = 0
        self.served: list[tuple[str, float, float]] = []  # grant, start, end

    def loaded(self) -> list[int]:
        return [1]

    def take(self, reply, grants) -> float:
        grants.append(reply)
        return 0.0

    async def head_moved(self, seen) -> None:
        while self.book.head() == seen:
            await asyncio.sleep(0.005)

    async def serve(self, grants) -> float:
        self.in_flight += len(grants)
        self.peak = max(self.peak, self.in_flight)
        start = time.monotonic()
        await asyncio.sleep(max(self.durations(g.grant_id) for g in grants))
        self.in_flight -= len(grants)
        self.served.append((",".join(g.grant_id for g in grants), start, time.monotonic()))
        return 0.0


def admitting(limit: int):
    """Grants g0, g1, ... up to `limit`, then denies (retry shortly)."""
    counter = itertools.count()

    async def admit(runs, ids):
        k = next(counter)
        if k >= limit:
            return AdmissionDeny(request_id=str(k), reason="enough", retry_after_s=0.02)
        return AdmissionGrant(request_id=str(k), grant_id=f"g{k}", version=1, lease_expires_at=time.time() + 60)

    return admit


def duration(grant_id: str) -> float:
    return 0.4 if int(grant_id[1:]) % 2 == 0 else 0.05


async def run_loop(streaming: bool, grants: int, batch_groups: int = 2) -> FakeRun:
    run = FakeRun(duration)
    stop = asyncio.Event()
    loop = asyncio.create_task(
        work_loop({"r": run}, admitting(grants), own="r", replica="x", batch_groups=batch_groups, stop=stop,
                  streaming=streaming)
    )  # fmt: skip
    while sum(len(g.split(",")) for g, _, _ in run.served) < grants:
        await asyncio.sleep(0.01)
    stop.set()
    await asyncio.wait_for(loop, 5)
    return run


async def test_a_round_waits_for_its_longest_batch_without_streaming():
    run = await run_loop(streaming=False, grants=4)
    assert [g for g, _, _ in run.served] == ["g0,g1", "g2,g3"]  # one batch per round
    assert run.peak == 2


async def test_streaming_serves_each_grant_alone_and_tops_up_as_soon_as_one_is_served():
    run = await run_loop(streaming=True, grants=6)
    assert all("," not in g for g, _, _ in run.served)
    assert run.peak == 2
    starts = {g: start for g, start, _ in run.served}
    ends = {g: end for g, _, end in run.served}
    assert starts["g2"] < ends["g0"]  # g1 was short: g2 began while the long g0 was served
    assert ends["g5"] - starts["g0"] < 0.4 * 3  # not three long rounds one after another


async def test_stop_lets_the_batches_in_flight_finish():
    run = FakeRun(lambda g: 0.3)
    stop = asyncio.Event()
    loop = asyncio.create_task(
        work_loop({"r": run}, admitting(2), own="r", replica="x", batch_groups=2, stop=stop, streaming=True)
    )
    while run.in_flight < 2:
        await asyncio.sleep(0.005)
    stop.set()
    await asyncio.wait_for(loop, 5)
    assert run.in_flight == 0 and len(run.served) == 2  # both grants served, one by one


async def test_a_deny_is_waited_out_until_a_version_is_loaded_not_for_its_whole_retry():
    """A synchronous run's replica is denied until the next version exists; the registry says
    ask again in 5 s, but the version loaded 0.1 s later wakes the loop at once."""
    run = FakeRun(lambda g: 0.0)
    asked: list[float] = []

    async def admit(runs, ids):
        asked.append(time.monotonic())
        if run.book.head() == 1:
            return AdmissionDeny(request_id="d", reason="staleness: waiting for the next version", retry_after_s=5.0)
        return AdmissionGrant(request_id="g", grant_id="g0", version=2, lease_expires_at=time.time() + 60)

    stop = asyncio.Event()
    loop = asyncio.create_task(work_loop({"r": run}, admit, own="r", replica="x", batch_groups=1, stop=stop))
    await asyncio.sleep(0.1)
    loaded_at = time.monotonic()
    run.book.newest = 2
    while not run.served:
        await asyncio.sleep(0.005)
    stop.set()
    await asyncio.wait_for(loop, 5)
    assert len(asked) >= 2 and asked[1] - loaded_at < 1.0  # not the deny's 5 s


async def test_a_round_asks_once_then_for_the_rest_of_its_room_at_once_each_under_its_own_id():
    run = FakeRun(lambda g: 0.2)
    asked: list[tuple[float, str]] = []
    waiting = 0
    peak = 0

    async def admit(runs, ids):
        nonlocal waiting, peak
        rid = ids.next()
        asked.append((time.monotonic(), rid))
        if len(asked) == 1:
            return None  # no answer: this id is asked again, first
        waiting += 1
        peak = max(peak, waiting)
        await asyncio.sleep(0.05)  # the round trip
        waiting -= 1
        ids.answered()
        k = len(asked)
        return AdmissionGrant(request_id=rid, grant_id=f"g{k}", version=1, lease_expires_at=time.time() + 60)

    stop = asyncio.Event()
    loop = asyncio.create_task(work_loop({"r": run}, admit, own="r", replica="x", batch_groups=4, stop=stop))
    while not run.served:
        await asyncio.sleep(0.005)
    stop.set()
    await asyncio.wait_for(loop, 5)
    assert asked[1][1] == asked[0][1]  # the unanswered request, asked again under its id
    round_ = asked[1:5]
    assert len({rid for _, rid in round_}) == 4  # then three more, each its own request
    assert peak == 3  # after the first, the other three at once
    assert run.served[0][0].count(",") == 3  # one batch of the four grants


async def test_a_deny_to_a_rounds_first_ask_ends_its_asking():
    run = FakeRun(lambda g: 0.0)
    asked = 0

    async def admit(runs, ids):
        nonlocal asked
        asked += 1
        return AdmissionDeny(request_id=ids.next(), reason="staleness: waiting", retry_after_s=0.05)

    stop = asyncio.Event()
    loop = asyncio.create_task(work_loop({"r": run}, admit, own="r", replica="x", batch_groups=8, stop=stop))
    await asyncio.sleep(0.3)
    stop.set()
    await asyncio.wait_for(loop, 5)
    assert 2 <= asked <= 8  # about one a retry, never eight a round
