"""A reward function that raises stops its run only (real nats-server, real embedded engines):
two runs on one replica's work loop, as a fleet replica serves them; the run whose reward
raises publishes nothing, is reported once after `run_faults.STRIKES` failed batches in a row
and is asked for no more, while the other run's trajectories keep coming; the replica's metrics
keep one series per run."""

from __future__ import annotations

import asyncio
import copy
import itertools
import time
import uuid

from prometheus_client import REGISTRY

from proto.messages import AdmissionGrant
from services.common import run_faults
from services.rollout.engines.embedded import EmbeddedEngine
from services.rollout.work import work_loop
from tests.fixtures.waiting import wait_until
from tests.integration.test_rollout_service import (  # noqa: F401 - start_run and base are fixtures
    EOS,
    KEEP,
    base,
    peft_version,
    start_run,
)


async def test_a_raising_reward_stops_its_run_and_the_other_goes_on(start_run, base):
    good = await start_run("rg", seed=1, max_new_tokens=4, batch_groups=2)
    bad = await start_run("rb", seed=2, max_new_tokens=4, batch_groups=2)

    def broken(prompt: str, completion: str, answer: str) -> float:
        raise KeyError("score")

    services = {}
    for run, reward in ((good, lambda p, c, a: 1.0), (bad, broken)):
        engine = EmbeddedEngine(copy.deepcopy(base), eos_ids=[EOS], pad_id=0, slots=KEEP + 1)
        services[run.run] = run.service("r1", engine, reward_fn=reward)
        await run.publish(0, peft_version(base, seed=5)[1])
    faults: list[run_faults.RunFault] = []

    async def on_fault(fault: run_faults.RunFault) -> bool:
        faults.append(fault)
        return True

    services[bad.run].on_fault = on_fault
    turns = itertools.cycle(sorted(services))

    async def admit(live, ids) -> AdmissionGrant | None:  # the fleet's turn-taking, without a registry
        run = next(r for r in turns if r in live or not live)
        if run not in live or not live[run].loaded():
            return None
        return AdmissionGrant(request_id=uuid.uuid4().hex, grant_id=uuid.uuid4().hex, run=run,
                              version=max(live[run].loaded()), lease_expires_at=time.time() + 60)  # fmt: skip

    stop = asyncio.Event()
    for service in services.values():
        await service.start()
    loop = asyncio.create_task(work_loop(services, admit, own=good.run, replica="r1", batch_groups=2, stop=stop))
    try:
        await wait_until(lambda: faults, 60, "the bad run reported")
        assert services[bad.run].draining and len(faults) == 1
        assert str(faults[0]).startswith("train_dataset.reward_fn: ") and "KeyError('score')" in str(faults[0])
        after = len(good.rec.trajectories)
        await wait_until(lambda: len(good.rec.trajectories) >= after + 4, 60, "the good run going on")
        await asyncio.sleep(1.5)  # a report more would come within a strike's wait (1 s)
        assert len(faults) == 1 and bad.rec.trajectories == []
        assert all(t.run == good.run for t in good.rec.trajectories)

        # one replica, two runs: a series per run, the bad run's never counting the good one's work
        def published(run: str) -> float | None:
            return REGISTRY.get_sample_value("lorabus_rollout_trajectories_total", {"run": run, "replica": "r1"})

        # equal between two batches (the recorder may see a trajectory before its count goes up)
        await wait_until(lambda: published(good.run) == len(good.rec.trajectories), 30, "the good run's series")
        assert not published(bad.run)
        assert REGISTRY.get_sample_value("lorabus_rollout_in_flight", {"run": bad.run, "replica": "r1"}) == 0
    finally:
        stop.set()
        await asyncio.wait_for(loop, 30)
        for service in services.values():
            await service.close()
