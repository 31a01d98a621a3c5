"""Run `lorabus up` to the end and check what tests/e2e/test_up.py checks of a finished run
(shared by the server-engine end-to-end tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from services.config.areal.report import REPORTED_ENV

ROOT = Path(__file__).resolve().parents[2]
# tests/e2e/test_up.py: best of the last three versions >= v0 + MARGIN on the fixed held-out set
MARGIN = 0.06


def run_up(
    config: str,
    run_dir: Path,
    steps: int,
    *overrides: str,
    timeout_s: float = 420.0,
    evaluate: bool = True,
    beside: Callable[[Path], None] | None = None,
    flags: Sequence[str] = (),
) -> dict:
    """`beside(run_dir)`: run on a thread while the run goes (a fault to inject); what it
    raises fails the test after the run. `flags`: the launcher's own (`--server-site DIR`)."""
    flags = [*flags] if evaluate else [*flags, "--no-evaluate"]
    cmd = [
        sys.executable,
        "-m",
        "services.local.launcher",
        "--config",
        config,
        *flags,
        "--timeout",
        str(timeout_s),
        "--progress-every",
        "10",
        f"run_dir={run_dir}",
        f"total_train_steps={steps}",
        *overrides,
    ]
    errors: list[BaseException] = []

    def run_beside() -> None:
        try:
            if beside is not None:
                beside(run_dir)
        except BaseException as exc:  # re-raised on the test's thread below
            errors.append(exc)

    thread = threading.Thread(target=run_beside, daemon=True)
    thread.start()
    # an AReaL file loaded earlier in this pytest process marked its table printed in os.environ;
    # a fresh `lorabus up` must print its own
    env = {k: v for k, v in os.environ.items() if k != REPORTED_ENV}
    proc = subprocess.run(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout_s + 120
    )
    print(proc.stdout)
    (run_dir / "up.log").write_text(proc.stdout)
    thread.join(10)
    if errors:
        raise errors[0]
    assert proc.returncode == 0, f"lorabus up failed:\n{proc.stdout[-4000:]}{trainer_log_tail(run_dir)}"
    return json.loads((run_dir / "summary.json").read_text())


def trainer_log_tail(run_dir: Path, chars: int = 3000) -> str:
    log = run_dir / "trainer.log"
    return f"\n--- trainer.log ---\n{log.read_text()[-chars:]}" if log.exists() else ""


def check_learned(summary: dict, steps: int) -> None:
    evals = {int(v): s for v, s in summary["eval_by_version"].items()}
    assert set(range(steps + 1)) <= set(evals), f"versions not evaluated: {evals}"
    base = evals[0]
    best_late = max(evals[v] for v in (steps - 2, steps - 1, steps))
    assert best_late >= base + MARGIN, f"held-out score did not rise by {MARGIN}: {evals}"
    verdicts = summary["trajectories"]
    assert verdicts.get("accepted", 0) >= steps * 8, verdicts
    assert summary["max_accepted_staleness"] <= summary["max_head_offpolicyness"], summary
    trained = summary["trained_groups"]
    assert trained + summary["accepted_unconsumed"] == verdicts["accepted"], summary
