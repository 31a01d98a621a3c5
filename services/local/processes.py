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
from dataclasses import dataclass, field
from pathlib import Path
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


def log_tail(path: Path, n: int = 30) -> str:
    """The last `n` lines of a child's log, for an error message; never raises (a log that
    cannot be read is named instead)."""
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return f"(no log at {path})"


def terminate_group(pid: int) -> None:
    """SIGTERM the process group `pid` leads; a group already gone is not an error."""
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass


@dataclass
class Child:
    """One process `lorabus up` starts and supervises: a service, or an inference server and
    the replica that drives it."""

    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    url: str | None = None
    """inference servers: the base URL"""
    env_extra: dict[str, str] = field(default_factory=dict)
    server: bool = False
    """an inference server (started before the sidecars, stopped after them)"""
    sidecar: str | None = None
    """inference servers: the rollout replica that drives it (`server_watch`)"""

    def start(self, env: dict[str, str]) -> None:
        log = open(self.log_path, "ab", buffering=0)
        # own process group: Ctrl-C in the terminal reaches only the launcher, which then stops
        # the children in order
        self.proc = subprocess.Popen(
            self.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**env, **self.env_extra},
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            # a launcher killed outright takes its services along (SIGTERM: they stop cleanly),
            # so rerunning the command resumes the run instead of meeting orphans
            preexec_fn=die_with_parent,
        )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def popen(self) -> subprocess.Popen[bytes]:
        if self.proc is None:
            raise RuntimeError(f"child {self.name}: not started; call start() first")
        return self.proc

    @property
    def pid(self) -> int:
        return self.popen().pid

    @property
    def returncode(self) -> int | None:
        return self.popen().returncode
