"""`lorabus up`'s server watch with real processes: a health server that hangs (SIGSTOP: it
keeps its port and stops answering) or dies is found lost, killed as a group, and its sidecar
is stopped and started again only once the server's replacement answers. The same with the real
vLLM server inside a whole run: tests/e2e/test_up_vllm.py[disk]."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

from services.local.ports import free_port
from services.local.processes import Child
from services.local.server_watch import ServerWatch, WatchPolicy

HEALTH = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""
SIDECAR = "import time\nwhile True: time.sleep(1)\n"
POLICY = WatchPolicy(every_s=0.1, timeout_s=0.3, misses=2, start_timeout_s=20.0, stop_wait_s=5.0)


async def run_until(watch: ServerWatch, done, timeout_s: float = 20.0) -> list[str]:
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"not reached in {timeout_s} s; lines: {lines}"
        lines += await watch.tick(time.monotonic())
        await asyncio.sleep(0.05)
    return lines


async def test_a_hung_or_dead_server_is_killed_and_its_sidecar_waits_for_the_replacement(tmp_path: Path):
    port = free_port()
    server = Child("vllm-0", [sys.executable, "-c", HEALTH, str(port)], tmp_path / "s.log", url=f"http://127.0.0.1:{port}",
                   server=True, sidecar="rollout-0")  # fmt: skip
    sidecar = Child("rollout-0", [sys.executable, "-c", SIDECAR], tmp_path / "r.log")
    env = dict(os.environ)
    restarted: list[int] = []

    def restart_sidecar(child: Child) -> None:
        child.start(env)
        restarted.append(child.pid)

    watch = ServerWatch([server], {"vllm-0": sidecar}, restart_sidecar, POLICY)
    server.start(env)
    sidecar.start(env)
    try:
        await run_until(watch, lambda: watch.states.get("vllm-0") and watch.states["vllm-0"].ready)
        first_sidecar = sidecar.pid
        os.kill(server.pid, signal.SIGSTOP)  # hung: the port stays open, nothing answers
        lines = await run_until(watch, lambda: not server.alive())
        assert server.returncode == -signal.SIGKILL
        assert any("vllm-0 lost: 2 health probes in a row failed" in x and "within 0.3 s" in x for x in lines), lines
        await run_until(watch, lambda: not sidecar.alive())
        assert sidecar.returncode == -signal.SIGTERM and "rollout-0" in watch.held
        for _ in range(5):  # no server yet: the sidecar stays stopped
            await watch.tick(time.monotonic())
            await asyncio.sleep(0.1)
        assert not sidecar.alive() and restarted == []

        server.start(env)  # what the launcher's restart_dead does after its backoff
        lines = await run_until(watch, lambda: restarted)
        assert sidecar.alive() and sidecar.pid != first_sidecar and watch.held == {}
        assert any("vllm-0 is ready again: restarted its sidecar rollout-0" in x for x in lines), lines

        os.kill(server.pid, signal.SIGKILL)  # dies outright
        lines = await run_until(watch, lambda: not sidecar.alive())
        assert any("vllm-0 lost: exited (killed by SIGKILL)" in x for x in lines), lines
    finally:
        await watch.close()
        for child in (server, sidecar):
            if child.alive():
                os.killpg(child.pid, signal.SIGKILL)
                child.popen().wait()
