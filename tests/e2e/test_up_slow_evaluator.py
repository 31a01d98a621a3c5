"""`lorabus up` with an evaluator slower than training: the run ends once training has ended,
the last version is exported and the bounded wait for the missing scores is over; it says that
it is waiting, for how many versions, and which ones it never got.

The evaluator is the real one (its own process, the base model, greedy held-out scoring) with a
hook that sleeps before each score (`tests/fixtures/slow_eval.py`), so it needs far longer than
the wait allows: the test cannot pass by the evaluator happening to keep up.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.slow_eval import SECONDS_PER_VERSION

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
MAX_WAIT_S = 4.0

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_a_slow_evaluator_is_waited_for_a_bounded_time_and_named(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "services.local.launcher",
        "--config",
        "examples/tiny.yaml",
        "--timeout",
        "400",
        "--progress-every",
        "1",
        f"run_dir={run_dir}",
        f"total_train_steps={STEPS}",
        "evaluator.score=tests.fixtures.slow_eval:slow_heldout_reward",
        f"evaluator.max_wait_s={MAX_WAIT_S}",
        "evaluator.max_prompts=50",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=500)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())

    # training finished and every version was exported ...
    assert summary["trainer_steps"] == STEPS
    assert set(map(int, summary["exported"])) == set(range(STEPS + 1))
    # ... but the evaluator (>= 6 s per version, 4 versions) was still busy when the wait ended
    unscored = summary["eval_unscored"]
    scored = {int(v) for v in summary["eval_by_version"]}
    assert unscored, summary
    assert STEPS in unscored and not scored & set(unscored), summary
    assert scored | set(unscored) == set(range(STEPS + 1)), summary
    assert MAX_WAIT_S <= summary["eval_waited_s"] < MAX_WAIT_S + SECONDS_PER_VERSION, summary

    out = proc.stdout
    assert "training done, waiting for the evaluator:" in out, out[-3000:]
    assert f"v{STEPS}" in out.split("waiting for the evaluator:", 1)[1].splitlines()[0]
    assert "stopped waiting for the evaluator after" in out, out[-3000:]
    assert "evaluator: still scoring" in out, out[-3000:]
