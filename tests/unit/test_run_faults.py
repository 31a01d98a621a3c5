"""A run's own failure (services/common/run_faults.py): counted in strikes, and a run that cannot
start on its own account is reported once and never opened again, while any other failure is
only logged (it may be the bus, everyone's) and the other runs are served either way."""

from __future__ import annotations

from services.common.run_faults import RunFault, Strikes, failed, reason
from services.common.run_host import RunHost
from tests.unit.test_run_host import FakeBus, FakeWorker, fleet, record  # noqa: F401 - fleet is a fixture


def test_strikes_reach_the_limit_once_and_a_success_clears_them():
    s = Strikes(limit=3)
    assert [s.hit(), s.hit()] == [False, False]
    s.clear()
    assert [s.hit(), s.hit(), s.hit(), s.hit()] == [False, False, True, False]


def test_reasons_name_the_service_and_read_as_failures():
    why = reason("rollout r0", RunFault("train_dataset.reward_fn: x raised KeyError('a')"))
    assert why == "failed in rollout r0: train_dataset.reward_fn: x raised KeyError('a')"
    assert failed(why) and not failed("stopped by request")


async def test_a_run_that_fails_on_its_own_is_reported_once_and_never_opened_again(fleet):
    cfg, _, log, _, _ = fleet
    reports: list[tuple[str, str, str, str]] = []

    async def report(bus, fleet_name, run, service, fault) -> bool:
        reports.append((fleet_name, run, service, str(fault)))
        return True

    async def make(run_cfg, bus):
        if run_cfg.run == "bad":
            raise RunFault("its adapter cannot join the base model: no such module")
        if run_cfg.run == "flaky":
            raise ConnectionError("bus down")
        return FakeWorker(run_cfg.run, bus, log)

    host = RunHost(cfg, FakeBus(cfg.run, log), make, name="trainer", report=report)  # type: ignore[arg-type]
    await host.start()
    await host.on_record(record(cfg, "bad", "active"))
    await host.on_record(record(cfg, "bad", "active"))  # the table says it again: not retried
    await host.on_record(record(cfg, "flaky", "active"))
    await host.on_record(record(cfg, "good", "active"))
    assert reports == [(cfg.run, "bad", "trainer", "its adapter cannot join the base model: no such module")]
    assert "bad" in host.ended and "flaky" not in host.ended  # a failure not its own may pass
    assert sorted(host.workers) == sorted([cfg.run, "good"])
    await host.close()
