"""`lorabus up` with `actor.nproc_per_node=2`: the launcher starts the trainer under torchrun and
the whole loop runs to its last exported version with two gloo ranks training.

How the ranks share a step (rank 0 alone on the bus, every rank trains, a killed rank ends the
job) is tested without the launcher in tests/integration/test_trainer_torchrun.py.
"""

from __future__ import annotations

import pytest

from tests.e2e.up_run import run_up

pytestmark = [pytest.mark.slow, pytest.mark.timeout(360)]


def test_lorabus_up_with_two_trainer_ranks(tmp_path):
    run_dir = tmp_path / "run"
    steps = 4
    summary = run_up(
        "examples/tiny.yaml",
        run_dir,
        steps,
        "actor.nproc_per_node=2",
        "rollout.consumer_batch_size=2",
        "rollout.replicas=1",
        timeout_s=200.0,
        evaluate=False,
    )
    trainer_log = (run_dir / "trainer.log").read_text()
    assert summary["trainer_steps"] == steps
    assert sorted(int(v) for v in summary["exported"]) == list(range(steps + 1))
    assert "world size 2" in trainer_log
