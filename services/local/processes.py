"""Process-group handling for the servers and services `lorabus up` starts.

Every child leads its own process group (vLLM's engine core and torchrun's ranks are children of
the process we start), so it is signalled as a group; every child also dies with its parent, so a
SIGKILLed launcher leaves no server or service behind.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

PR_SET_PDEATHSIG = 1
_SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lorabus-spawner")
"""the one thread `spawn_lasting` forks from; its worker never ends before the process does"""


def die_with_parent() -> None:
    """preexec_fn: a child outlives nothing; SIGTERM it when the launcher dies (even by SIGKILL)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def spawn_lasting(cmd: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    """`Popen(cmd, preexec_fn=die_with_parent, **kwargs)`, forked from a thread that lives as
    long as this process, whichever thread calls. The kernel sends the parent-death signal
    when the *thread* that forked the child ends, not the process (prctl(2), PR_SET_PDEATHSIG):
    a server restarted from a short-lived thread (a test's fault driver, an executor's worker)
    would be SIGTERMed as soon as that thread returned."""

    def spawn() -> subprocess.Popen[bytes]:
        return subprocess.Popen(cmd, preexec_fn=die_with_parent, **kwargs)

    return _SPAWNER.submit(spawn).result()


def terminate_group(pid: int) -> None:
    """SIGTERM the process group `pid` leads; a group already gone is not an error."""
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
