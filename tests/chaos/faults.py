"""Faults injected into a running `lorabus up`, and what a run's streams hold afterwards.

A `Fault` fires once the exporter has written `export/v<after>` (the run's own clock, so the
schedule does not depend on the machine's speed), acting on the pids `lorabus up` writes to
`pids.json`. `read_streams` reads the stopped run's store back through a fresh nats-server on
the same directory, message by message (not the launcher's reader), so a summary can be checked
against it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from proto import codec
from proto import messages as m
from services.common import streams
from services.common.bus import Bus
from services.common.config_schema import BusConfig
from services.local.nats_server import start_nats_server

ROOT = Path(__file__).resolve().parents[2]
RUN = "tiny-trial0"
GAP = 1
"""versions the run must export between two faults (each is recovered from before the next)"""


@dataclass
class Fault:
    name: str
    after: int
    """fires once export/v<after> exists"""
    act: Callable[[Path], str]
    """does it; returns what it did, for the table"""
    fired_at: float | None = None
    did: str = ""


def pid_of(run_dir: Path, name: str) -> int:
    return int(json.loads((run_dir / "pids.json").read_text())[name])


def kill(name: str, sig: signal.Signals = signal.SIGKILL) -> Callable[[Path], str]:
    def act(run_dir: Path) -> str:
        pid = pid_of(run_dir, name)
        os.kill(pid, sig)
        return f"{sig.name} {name} (pid {pid})"

    return act


def stop_for(name: str, seconds: float) -> Callable[[Path], str]:
    """SIGSTOP, then SIGCONT after `seconds` (a replica that hangs, then wakes up)."""

    def act(run_dir: Path) -> str:
        pid = pid_of(run_dir, name)
        os.kill(pid, signal.SIGSTOP)
        threading.Timer(seconds, lambda: os.kill(pid, signal.SIGCONT)).start()
        return f"SIGSTOP {name} for {seconds:g} s"

    return act


def head_object(run_dir: Path) -> tuple[int, Path]:
    adapters = run_dir / "store" / RUN / "adapters"
    version = max(int(p.name[1:]) for p in adapters.iterdir() if p.name[1:].isdigit())
    return version, adapters / f"v{version}" / "adapter_model.safetensors"


def spoil_head_then_kill(replica: str, how: str) -> Callable[[Path], str]:
    """Corrupt (zero 64 bytes) or delete the head version's object, then SIGKILL `replica`: its
    restart loads the head from the store first, and must give it up and go on with the next.
    The trainer is paused meanwhile (SIGSTOP, a few seconds) so that the head is exported before
    it is spoiled and is still the head when the replica comes back."""

    def act(run_dir: Path) -> str:
        trainer = pid_of(run_dir, "trainer")
        os.kill(trainer, signal.SIGSTOP)
        try:
            version, path = head_object(run_dir)
            wait_for(lambda: (run_dir / "export" / f"v{version}").is_dir(), 30)
            if how == "corrupt":
                data = bytearray(path.read_bytes())
                data[len(data) // 2 : len(data) // 2 + 64] = bytes(64)
                path.write_bytes(bytes(data))
            else:
                path.unlink()
            old = pid_of(run_dir, replica)
            os.kill(old, signal.SIGKILL)
            log = run_dir / f"{replica}.log"
            wait_for(lambda: f"tiny_lora-v{version} given up" in log.read_text(errors="replace"), 60)
        finally:
            os.kill(trainer, signal.SIGCONT)
        return f"{how} object of v{version}, SIGKILL {replica}"

    return act


def wait_for(check: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"chaos: condition not met within {timeout_s} s")
        time.sleep(0.2)


def exported_head(run_dir: Path) -> int:
    export = run_dir / "export"
    if not export.is_dir():
        return -1
    return max((int(p.name[1:]) for p in export.iterdir() if p.name[1:].isdigit()), default=-1)


@dataclass
class Run:
    """`lorabus up` on the tiny task, with faults fired from a thread."""

    run_dir: Path
    steps: int
    overrides: list[str] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    timeout_s: float = 540.0

    def command(self) -> list[str]:
        return [sys.executable, "-m", "services.local.launcher", "--config", "examples/tiny.yaml",
                "--timeout", str(self.timeout_s), "--progress-every", "10",
                f"run_dir={self.run_dir}", f"total_train_steps={self.steps}", *self.overrides]  # fmt: skip

    def go(self) -> tuple[subprocess.CompletedProcess, float]:
        cmd = self.command()
        started = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        done = threading.Event()
        driver = threading.Thread(target=self._drive, args=(done, started), daemon=True)
        driver.start()
        try:
            out, _ = proc.communicate(timeout=self.timeout_s + 120)
        finally:
            done.set()
            if proc.poll() is None:
                proc.kill()
        driver.join(timeout=5)
        return subprocess.CompletedProcess(cmd, proc.returncode, out), time.monotonic() - started

    def _drive(self, done: threading.Event, started: float) -> None:
        """Fire each fault at its version, and not before the run has exported `GAP` more
        versions since the previous one fired: each fault meets a run that recovered."""
        floor = -1
        for fault in self.faults:
            while exported_head(self.run_dir) < max(fault.after, floor + GAP):
                if done.wait(0.2):
                    return
            try:
                fault.did = fault.act(self.run_dir)
            except Exception as exc:  # the assertion on fired faults reports it
                fault.did = f"failed: {exc!r}"
                return
            fault.fired_at = time.monotonic() - started
            floor = exported_head(self.run_dir)


@dataclass
class Streams:
    """A run as its streams hold it, read one message at a time."""

    decisions: dict[str, str] = field(default_factory=dict)
    """trajectory id -> first verdict"""
    accepted_ids: list[str] = field(default_factory=list)
    """the ACCEPTED stream, in order (one entry per stored message)"""
    steps: dict[int, m.TrainerStep] = field(default_factory=dict)
    evals: dict[int, float] = field(default_factory=dict)
    exported: set[int] = field(default_factory=set)
    given_up: list[tuple[str, int]] = field(default_factory=list)
    """(replica, version) of AdapterFailed reports with will_retry false"""
    loaded: dict[str, list[int]] = field(default_factory=dict)
    trainer_backlog: int = 0


async def _read(run_dir: Path) -> Streams:
    server = start_nats_server(run_dir / "nats")
    bus = await Bus.connect(BusConfig(url=server.url), run=RUN, service="chaos-check")
    s = Streams()
    try:

        async def each(stream: str, msg_type):
            last = await bus.last_seq(stream)
            seq = 1
            while seq <= last:
                raw = await bus.message(stream, seq, ">")  # the first stored at or after seq
                if raw is None:
                    break
                yield codec.decode(raw.data, msg_type)
                seq = raw.seq + 1

        async for d in each(streams.DECISIONS(RUN), m.TrajectoryDecision):
            s.decisions.setdefault(d.trajectory_id, d.verdict)
        async for t in each(streams.ACCEPTED(RUN), m.Trajectory):
            s.accepted_ids.append(t.trajectory_id)
        async for step in each(streams.TRAINER(RUN), m.TrainerStep):
            s.steps[step.step] = step
        async for ev in each(streams.EVALS(RUN), m.EvalResult):
            s.evals[ev.version] = ev.score
        async for done in each(streams.EXPORTS(RUN), m.ExportDone):
            s.exported.add(done.version)
        async for r in each(streams.REPORTS(RUN), m.RolloutReport):
            if isinstance(r, m.AdapterFailed) and not r.will_retry:
                s.given_up.append((r.replica, r.version))
            elif isinstance(r, m.AdapterLoaded):
                s.loaded.setdefault(r.replica, []).append(r.version)
        trainer = streams.consumer(RUN, "trainer")
        s.trainer_backlog = await bus.consumer_backlog(trainer.stream, trainer.durable) or 0
    finally:
        await bus.close()
        server.close()
    return s


def read_streams(run_dir: Path) -> Streams:
    return asyncio.run(_read(run_dir))
