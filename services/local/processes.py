"""Process-group handling for the servers and services `lorabus up` starts.

Every child leads its own process group (vLLM's engine core and torchrun's ranks are children of
the process we start), so it is signalled as a group; every child also dies with its parent, so a
SIGKILLed launcher leaves no server or service behind.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """preexec_fn: a child outlives nothing; SIGTERM it when the launcher dies (even by SIGKILL)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def terminate_group(pid: int) -> None:
    """SIGTERM the process group `pid` leads; a group already gone is not an error."""
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
