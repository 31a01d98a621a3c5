"""`lorabus up` exits 0 only for a finished or interrupted run; every other way out says why and
how to go on; a dead process is restarted with a backoff within a budget."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from services.local.outcome import Outcome, exit_status
from services.local.supervision import RestartPolicy, Restarts, describe_exit

RESUME = "rerun the same command"


def test_a_finished_run_exits_0_silently() -> None:
    assert exit_status(Outcome.FINISHED, "", Path("/run"), 60.0) == (0, None)


def test_an_interrupted_run_exits_0_and_says_how_to_resume() -> None:
    code, message = exit_status(Outcome.INTERRUPTED, "", Path("/run"), 60.0)
    assert code == 0 and message is not None and RESUME in message and "/run" in message


@pytest.mark.parametrize(
    ("outcome", "detail", "start"),
    [
        (Outcome.TIMEOUT, "", "timeout after 60.0 s"),
        (Outcome.GAVE_UP, "exporter died (exit 1) 5 times", "exporter died (exit 1) 5 times"),
        (Outcome.BUS_LOST, "came back on another port", "nats-server: came back on another port"),
        (Outcome.SERVERS_UNHEALTHY, "vllm-0 exited with 1", "vllm-0 exited with 1"),
    ],
)
def test_every_other_ending_exits_1_with_the_reason_and_the_resume_hint(
    outcome: Outcome, detail: str, start: str
) -> None:
    code, message = exit_status(outcome, detail, Path("/run"), 60.0)
    assert code == 1 and message is not None
    assert message.startswith(start) and RESUME in message


def test_every_outcome_has_an_exit_status() -> None:
    for outcome in Outcome:
        code, _ = exit_status(outcome, "x", Path("/run"), 1.0)
        assert code in (0, 1)


def test_restarts_back_off_doubling_up_to_the_cap_then_give_up() -> None:
    r = Restarts(RestartPolicy(base_s=1.0, max_s=3.0, budget=3, window_s=100.0))
    delays = []
    now = 0.0
    for _ in range(3):
        delay = r.on_death("registry", now)
        assert delay is not None
        delays.append(delay)
        assert not r.ready("registry", now + delay - 0.01)
        now += delay
        assert r.ready("registry", now)
    assert delays == [1.0, 2.0, 3.0]
    assert r.on_death("registry", now) is None  # budget spent
    assert r.counts() == {"registry": 3}


def test_a_pending_restart_is_scheduled_once_and_old_restarts_stop_counting() -> None:
    r = Restarts(RestartPolicy(base_s=1.0, budget=1, window_s=10.0))
    assert r.on_death("trainer", 0.0) == 1.0
    assert r.on_death("trainer", 0.5) == 0.5  # same death, seen again while waiting
    assert r.ready("trainer", 1.0)
    assert r.on_death("trainer", 5.0) is None
    assert r.on_death("trainer", 11.5) == 1.0  # the restart at t=1 is outside the window


def test_exits_are_described_in_words() -> None:
    assert describe_exit(1) == "exit 1"
    assert describe_exit(-signal.SIGKILL) == "killed by SIGKILL"
