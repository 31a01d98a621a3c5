"""`processes.spawn_lasting`: a child started from a thread that ends lives on, where one that
`die_with_parent` alone guards is SIGTERMed with that thread (Linux's parent-death signal
follows the forking thread). Issue 30: nats-server nodes restarted by a test's fault driver
died with it, and the cluster lost two of three nodes at once."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import pytest

from services.local import processes

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")


def started_from_a_thread_that_ends(spawn) -> subprocess.Popen:
    box: list[subprocess.Popen] = []
    thread = threading.Thread(target=lambda: box.append(spawn(["sleep", "30"])))
    thread.start()
    thread.join()
    return box[0]


def ended(proc: subprocess.Popen, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return True
        time.sleep(0.02)
    return False


def test_a_child_spawned_lasting_outlives_the_thread_that_asked():
    proc = started_from_a_thread_that_ends(processes.spawn_lasting)
    try:
        assert not ended(proc, 0.5)
    finally:
        proc.kill()
        proc.wait()


def test_die_with_parent_alone_ends_the_child_with_its_thread():
    proc = started_from_a_thread_that_ends(lambda cmd: subprocess.Popen(cmd, preexec_fn=processes.die_with_parent))
    try:
        assert ended(proc, 5.0) and proc.returncode == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
