"""Liveness of the inference servers `lorabus up` started, and what a lost one does to its replica.

A server is lost when it exits, when it answers `GET /health` with no 200 for `misses` probes in
a row once it was ready (hung: it keeps its port but does not answer within `timeout_s`; or an
error status: vLLM answers 5xx once its engine is dead), or when a (re)started server is not
ready within `start_timeout_s`. A lost server is killed as a group (a hung one would keep its
port) and restarted under the launcher's restart policy like any child.

Its sidecar (the rollout replica that drives it) is stopped with it and started again only once
the new server is ready. Why: the new sidecar is a new incarnation, so the registry frees the
old one's grants at its first heartbeat (`policy._new_incarnation`) instead of holding them to
their lease, and it loads the keep window from the adapter stream (the head first) into the
fresh server. So every sidecar process generates only from a server incarnation it loaded
itself: no trajectory can claim a version its server had not loaded (the version names the
adapter in each request, and a server without it answers 404, `VersionNotLoaded`, as a second
line). Pure bookkeeping (`on_probe`) apart from the probes and the signals.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import httpx

from services.local import processes
from services.local.supervision import describe_exit

if TYPE_CHECKING:
    from services.local.processes import Child


@dataclass(frozen=True)
class WatchPolicy:
    every_s: float = 2.0
    """seconds between two probes of one server"""
    timeout_s: float = 5.0
    """a probe not answered within this is a miss (a hung server)"""
    misses: int = 3
    """failed probes in a row, once ready, before the server counts as lost"""
    start_timeout_s: float = 300.0
    """a (re)started server not ready within this is lost (`--server-timeout`)"""
    stop_wait_s: float = 30.0
    """a sidecar that has not exited this long after its SIGTERM is SIGKILLed"""


@dataclass
class ServerState:
    pid: int
    started_at: float
    ready: bool = False
    missed: int = 0
    last_probe: float = -math.inf


def on_probe(state: ServerState, problem: str | None, now: float, policy: WatchPolicy) -> str | None:
    """Record one probe (`problem` None: it answered 200); returns why the server is lost, or None."""
    if problem is None:
        state.ready, state.missed = True, 0
        return None
    if not state.ready:
        if now - state.started_at > policy.start_timeout_s:
            return f"not ready {policy.start_timeout_s:.0f} s after its start ({problem})"
        return None
    state.missed += 1
    if state.missed >= policy.misses:
        return f"{state.missed} health probes in a row failed, the last: {problem}"
    return None


async def probe(client: httpx.AsyncClient, url: str, timeout_s: float) -> str | None:
    """None when `GET url/health` answers 200 within `timeout_s`, else what went wrong."""
    try:
        response = await client.get(f"{url}/health", timeout=timeout_s)
    except httpx.TimeoutException:
        return f"no answer to GET /health within {timeout_s:g} s"
    except httpx.HTTPError as exc:
        return f"GET /health: {type(exc).__name__}"
    return None if response.status_code == 200 else f"GET /health: HTTP {response.status_code}"


def kill_group(child: Child) -> None:
    """SIGKILL the child's process group (a stopped or hung process included) and reap the
    child, so that it reads as dead from here on."""
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        child.popen().wait(timeout=5.0)
    except subprocess.TimeoutExpired:  # in uninterruptible sleep: reaped at a later look
        pass


@dataclass
class ServerWatch:
    """The servers of one deployment and their sidecars (`sidecar_of`: server name -> child)."""

    servers: list[Child]
    sidecar_of: dict[str, Child]
    restart_sidecar: Callable[[Child], None]
    """starts a held sidecar again (the launcher counts and reports it)"""
    policy: WatchPolicy = field(default_factory=WatchPolicy)
    states: dict[str, ServerState] = field(default_factory=dict)
    held: dict[str, float] = field(default_factory=dict)
    """sidecar name -> when it was stopped for its server; the launcher does not restart these"""
    _probes: dict[str, asyncio.Task[str | None]] = field(default_factory=dict)
    _client: httpx.AsyncClient | None = None

    def started(self, now: float) -> None:
        """The servers are healthy (the launcher waited for them): watched as ready from now."""
        for server in self.servers:
            if server.alive():
                self.states[server.name] = ServerState(pid=server.pid, started_at=now, ready=True)

    def _state(self, server: Child, now: float) -> ServerState:
        st = self.states.get(server.name)
        if st is None or st.pid != server.pid:  # first look, or restarted: starting again
            st = self.states[server.name] = ServerState(pid=server.pid, started_at=now)
        return st

    async def tick(self, now: float) -> list[str]:
        """Probe what is due, act on lost servers, start held sidecars whose server is ready;
        returns lines for the operator."""
        if self._client is None:
            self._client = httpx.AsyncClient()
        lines = []
        for server in self.servers:
            if server.proc is None:
                continue
            if not server.alive():
                if (pending := self._probes.pop(server.name, None)) is not None:
                    pending.cancel()
                if server.name in self.states:  # alive when last looked at: lost once
                    lines += self._hold(server, f"exited ({describe_exit(server.returncode)})", now)
                continue
            st = self._state(server, now)
            task = self._probes.get(server.name)
            if task is not None and task.done():
                del self._probes[server.name]
                if (why := on_probe(st, task.result(), now, self.policy)) is not None:
                    kill_group(server)
                    lines += self._hold(server, why, now)
                    continue
            if server.name not in self._probes and now - st.last_probe >= self.policy.every_s:
                st.last_probe = now
                self._probes[server.name] = asyncio.create_task(
                    probe(self._client, server.url or "", self.policy.timeout_s)
                )
        lines += self._release(now)
        return lines

    def _hold(self, server: Child, why: str, now: float) -> list[str]:
        """Stop the server's sidecar until the server is ready again (once per loss)."""
        sidecar = self.sidecar_of.get(server.name)
        self.states.pop(server.name, None)
        lines = [f"lorabus up: {server.name} lost: {why}; it is restarted"]
        if sidecar is not None and sidecar.name not in self.held:
            self.held[sidecar.name] = now
            if sidecar.alive():
                processes.terminate_group(sidecar.pid)
            lines[0] += f", and its sidecar {sidecar.name} is stopped until it is ready again"
        return lines

    def _release(self, now: float) -> list[str]:
        lines = []
        for server_name, sidecar in self.sidecar_of.items():
            since = self.held.get(sidecar.name)
            if since is None:
                continue
            if sidecar.alive():
                if now - since > self.policy.stop_wait_s:
                    kill_group(sidecar)
                continue
            st = self.states.get(server_name)
            if st is not None and st.ready:
                del self.held[sidecar.name]
                self.restart_sidecar(sidecar)
                lines.append(f"  {server_name} is ready again: restarted its sidecar {sidecar.name}")
        return lines

    async def close(self) -> None:
        for task in self._probes.values():
            task.cancel()
        await asyncio.gather(*self._probes.values(), return_exceptions=True)
        self._probes.clear()
        if self._client is not None:
            await self._client.aclose()
            self._client = None
