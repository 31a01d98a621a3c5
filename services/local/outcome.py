"""Why `lorabus up` stopped, and what that means for its exit code and the line it prints.

Pure rules: every way out but a finished run keeps the run's state and says how to resume it.
"""

from __future__ import annotations

import sys
from enum import Enum, auto
from pathlib import Path


class Outcome(Enum):
    """Why `lorabus up` stopped watching; `exit_status` turns it into the exit code and message."""

    FINISHED = auto()
    """the last version is exported (and scored, or the bounded wait for its scores is over),
    and so is every submitted run's last version"""
    INTERRUPTED = auto()
    """SIGINT or SIGTERM: the operator stopped the run"""
    SERVERS_UNHEALTHY = auto()
    """an inference server exited or did not answer /health within --server-timeout"""
    GAVE_UP = auto()
    """a process kept dying: its restart budget (`supervision.RestartPolicy`) is spent"""
    BUS_LOST = auto()
    """the run's own nats-server could not be brought back on its store and port"""
    TIMEOUT = auto()
    """--timeout passed before the run finished"""


def resume_hint(run_dir: Path | str) -> str:
    argv = " ".join(sys.argv[1:]) if sys.argv[1:] else "--config FILE"
    return (
        f"the run's state (streams, ledger, checkpoints, exports) is kept in {run_dir}: "
        f"rerun the same command (lorabus up {argv}) to resume it"
    )


def exit_status(outcome: Outcome, detail: str, run_dir: Path, timeout_s: float) -> tuple[int, str | None]:
    """The exit code, and the line for stderr; `detail` is what `supervise` found."""
    match outcome:
        case Outcome.FINISHED:
            return 0, None
        case Outcome.INTERRUPTED:
            return 0, f"stopped; {resume_hint(run_dir)}"
        case Outcome.SERVERS_UNHEALTHY:
            return 1, f"{detail}; {resume_hint(run_dir)}"
        case Outcome.GAVE_UP:
            return 1, f"{detail}; fix the cause (see its log in {run_dir}), then {resume_hint(run_dir)}"
        case Outcome.BUS_LOST:
            return 1, f"nats-server: {detail}; {resume_hint(run_dir)}"
        case Outcome.TIMEOUT:
            return 1, f"timeout after {timeout_s} s; {resume_hint(run_dir)}"
