"""The worker processes of the propagation benchmarks (`propagation.py`'s replicas,
`propagation_servers.py`'s vLLM sidecars) and the XCCL sender that feeds them, driven alike.

Invariant: a worker is this interpreter running a benchmark script, with the repository on its
path, one compute thread and a log file of its own for stderr; it is told to exit over NATS
(`{"op": "exit"}` on its command subject) and killed when it has not within 10 s.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nats.aio.client import Client

    from services.trainer.xccl_sender import XcclSender

ROOT = Path(__file__).resolve().parents[1]


def spawn(argv: list[str], log: Path) -> subprocess.Popen:
    """`python argv...` from the repository root."""
    return subprocess.Popen(
        [sys.executable, *argv],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        stderr=open(log, "w"),
    )


async def stop(nc: Client, cmd: str, procs: list[subprocess.Popen]) -> None:
    """Tell worker i (on subject `cmd.format(i)`) to exit, close `nc`, and wait for each."""
    for i in range(len(procs)):
        await nc.publish(cmd.format(i), json.dumps({"op": "exit"}).encode())
    await nc.flush()
    await nc.close()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()


def gloo_sender(bucket_mb: float, release_wait_s: float | None = None) -> XcclSender:
    """The trainer's XCCL sender over gloo on this host, on a free port; `release_wait_s`
    (default the service's) is how long its durable copy waits for the replicas' release."""
    from services.common import xccl
    from services.trainer.xccl_sender import XcclSender

    return XcclSender(
        address="127.0.0.1",
        port=0,
        backend="gloo",
        bucket_bytes=xccl.bucket_bytes_of(bucket_mb),
        timeout_s=60,
        release_wait_s=xccl.RELEASE_WAIT_S if release_wait_s is None else release_wait_s,
    )


async def joined(sender: XcclSender, n: int, within_s: float = 30.0) -> None:
    """Wait until `n` receivers have joined `sender`'s group (or `within_s` has passed)."""
    deadline = time.monotonic() + within_s
    while sender.store.add("join_seq", 0) < n and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


async def settled(sender: XcclSender | None) -> None:
    """Wait for `sender`'s durable copy in flight, so it does not run into the next repetition."""
    if sender is not None and sender.durable is not None:
        await asyncio.wrap_future(sender.durable)
        sender.durable = None
