"""`lorabus up` exits 0 only for a finished or interrupted run; every other way out says why."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.local.launcher import Outcome, exit_status


@pytest.mark.parametrize("outcome", [Outcome.FINISHED, Outcome.INTERRUPTED])
def test_clean_endings_exit_0_silently(outcome: Outcome) -> None:
    assert exit_status(outcome, "", Path("/run"), 60.0) == (0, None)


@pytest.mark.parametrize(
    ("outcome", "detail", "message"),
    [
        (Outcome.TIMEOUT, "", "timeout after 60.0 s"),
        (Outcome.TRAINER_FAILED, "3", "trainer exited with 3; see /run/trainer.log"),
        (Outcome.CHILD_CRASHED, "exporter (exit 1)", "exporter (exit 1) stopped; see its log in /run"),
        (Outcome.SERVERS_UNHEALTHY, "vllm-0 exited with 1", "vllm-0 exited with 1"),
    ],
)
def test_every_other_ending_exits_1_with_a_message(outcome: Outcome, detail: str, message: str) -> None:
    assert exit_status(outcome, detail, Path("/run"), 60.0) == (1, message)


def test_every_outcome_has_an_exit_status() -> None:
    for outcome in Outcome:
        code, _ = exit_status(outcome, "x", Path("/run"), 1.0)
        assert code in (0, 1)
