"""Faults injected into a running `lorabus up`, and what a run's streams hold afterwards.

Each `Fault` is gated on the run's observed state, never on the clock, so that every fault fires
however fast or loaded the machine is (the tiny task trains 40 versions in well under a minute
while a killed process takes seconds to come back):
- a fault waits for its *target*: the exporter has written `export/v<target>`, where the target
  is its own version or `GAP` versions past the export head at which the previous fault was
  recovered from, whichever is later (so each fault meets a run that made progress after the
  last one);
- meanwhile the trainer (the run's only clock) is held at a `Gate` (SIGSTOP) once it has
  announced `LEAD` versions past the target, so the run cannot end before its faults fire;
- the fault is injected with the trainer held and is *seen* before the gate opens: the killed
  process restarted (a new pid in `pids.json`), the stopped one stopped, the replica gave the
  spoiled version up.
No wait can hang the run: every hold and every wait has a bound (`HOLD_BOUND_S`, `SEEN_BOUND_S`);
the gate opens at it saying so, and the run goes on to fail its "every fault fired" check with
the reason, instead of stalling (the earlier hold waited for "nothing left to export", which a
version stored by a trainer killed before announcing it never satisfies). So versions are read
from what was announced (the trainer's log, or the ADAPTERS stream where it must be exact), never
from the store, which may hold such an orphan.

`read_streams` reads the stopped run's store back through a fresh nats-server on the same
directory, message by message (not the launcher's reader), so a summary can be checked
against it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
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
from services.config.schema import BusConfig
from services.local.nats_server import start_nats_server
from tests.fixtures.waiting import until

ROOT = Path(__file__).resolve().parents[2]
RUN = "tiny-trial0"
GAP = 2
"""versions the run must export after a fault was recovered from before the next one fires"""
LEAD = 0
"""versions the trainer may announce past a pending fault's target before it is held: none, so
that each fault's target is at most about GAP + 1 past the last (the exports catching up to a
held trainer move the floor), and eight faults stay well inside a 40-step run"""
HOLD_BOUND_S = 120.0
"""the longest the trainer is held for one fault (the exports should catch up in seconds)"""
SEEN_BOUND_S = 90.0
"""the longest a fault waits to see its effect (a restart, a replica giving a version up)"""
TICK_S = 0.2


@dataclass
class Fault:
    name: str
    after: int
    """fires once export/v<after> exists (and GAP versions after the previous fault)"""
    act: Callable[[Path], str]
    """does it, with the trainer held, and returns once its effect is seen; returns what it
    did, for the table"""
    recovered: Callable[[Path], bool] | None = None
    """what must hold before the next fault fires, beyond the GAP versions (a stopped process
    woke up); the trainer runs meanwhile, up to the next fault's gate"""
    target: int | None = None
    """the export version it waited for"""
    fired_at: float | None = None
    did: str = ""


def pid_of(run_dir: Path, name: str) -> int:
    return int(json.loads((run_dir / "pids.json").read_text())[name])


def current_pid(run_dir: Path, name: str) -> int | None:
    """`pid_of`, or None while pids.json is absent or being rewritten."""
    try:
        return pid_of(run_dir, name)
    except (OSError, KeyError, ValueError):
        return None


def kill(name: str, sig: signal.Signals = signal.SIGKILL) -> Callable[[Path], str]:
    """Signal `name`; seen once the launcher has restarted it (a new pid in pids.json)."""

    def act(run_dir: Path) -> str:
        pid = pid_of(run_dir, name)
        os.kill(pid, sig)
        t0 = time.monotonic()
        until(lambda: current_pid(run_dir, name) not in (None, pid), SEEN_BOUND_S, f"{name} restarted", TICK_S)
        return f"{sig.name} {name} (pid {pid}), back in {time.monotonic() - t0:.0f} s"

    return act


def process_state(pid: int) -> str:
    """The state letter in /proc/<pid>/stat ('T': stopped), or '' for no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def running(name: str) -> Callable[[Path], bool]:
    """`name` is not stopped (its SIGCONT came)."""
    return lambda run_dir: process_state(pid_of(run_dir, name)) not in ("T", "t")


def stop_for(name: str, seconds: float) -> Callable[[Path], str]:
    """SIGSTOP, then SIGCONT after `seconds` (a replica that hangs, then wakes up); seen once
    the process is stopped."""

    def act(run_dir: Path) -> str:
        pid = pid_of(run_dir, name)
        os.kill(pid, signal.SIGSTOP)
        threading.Timer(seconds, lambda: os.kill(pid, signal.SIGCONT)).start()
        until(lambda: process_state(pid) == "T", SEEN_BOUND_S, f"{name} (pid {pid}) stopped", 0.02)
        return f"SIGSTOP {name} for {seconds:g} s"

    return act


def spoil_head_then_kill(replica: str, how: str) -> Callable[[Path], str]:
    """Corrupt (zero 64 bytes) or delete the head version's object, then SIGKILL `replica`: its
    restart loads the head from the store first, and must give it up and go on with the next.
    The trainer is held meanwhile (acts run behind the gate), so the head stays the head while
    the replica comes back; it is read from the ADAPTERS stream (as the replica reads it: the
    trainer's log can lag its announce, the store can hold a version not announced) and is
    spoiled only once exported."""

    def act(run_dir: Path) -> str:
        version = bus_head(run_dir)
        until(lambda: (run_dir / "export" / f"v{version}").is_dir(), SEEN_BOUND_S, f"export/v{version}", TICK_S)
        path = run_dir / "store" / RUN / "adapters" / f"v{version}" / "adapter_model.safetensors"
        if how == "corrupt":
            data = bytearray(path.read_bytes())
            data[len(data) // 2 : len(data) // 2 + 64] = bytes(64)
            path.write_bytes(bytes(data))
        else:
            path.unlink()
        os.kill(pid_of(run_dir, replica), signal.SIGKILL)
        log = run_dir / f"{replica}.log"
        gave_up = f"tiny_lora-v{version} given up"
        until(lambda: gave_up in log.read_text(errors="replace"), SEEN_BOUND_S, f"{replica}: {gave_up!r}", TICK_S)
        return f"{how} object of v{version}, SIGKILL {replica}"

    return act


def bus_url(run_dir: Path) -> str:
    """The run's NATS URL, as the launcher hands it to its children (`bus.url=` on the
    registry's command line)."""
    pid = pid_of(run_dir, "registry")
    for arg in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"):
        if arg.startswith(b"bus.url="):
            return arg.removeprefix(b"bus.url=").decode()
    raise AssertionError(f"chaos: the registry (pid {pid}) has no bus.url= argument")


def bus_head(run_dir: Path) -> int:
    """The newest version announced on the ADAPTERS stream (-1 before the first)."""

    async def read() -> int:
        bus = await Bus.connect(BusConfig(url=bus_url(run_dir)), run=RUN, service="chaos-driver")
        try:
            event = await bus.last(streams.ADAPTERS(RUN), m.AdapterReady)
            return -1 if event is None else event.version
        finally:
            await bus.close()

    return asyncio.run(asyncio.wait_for(read(), SEEN_BOUND_S))


def exported_head(run_dir: Path) -> int:
    export = run_dir / "export"
    if not export.is_dir():
        return -1
    return max((int(p.name[1:]) for p in export.iterdir() if p.name[1:].isdigit()), default=-1)


_ANNOUNCED = re.compile(rb" v(\d+) (?:announced|was already announced)")


def announced_head(run_dir: Path) -> int:
    """The newest version the trainer's log says it announced (-1 before the first)."""
    try:
        text = (run_dir / "trainer.log").read_bytes()
    except OSError:
        return -1
    return max((int(v) for v in _ANNOUNCED.findall(text)), default=-1)


def clock_s(wall: float) -> float:
    """Seconds since local midnight: the services' log stamps (HH:MM:SS.mmm)."""
    t = time.localtime(wall)
    return t.tm_hour * 3600 + t.tm_min * 60 + t.tm_sec + wall % 1


@dataclass
class Gate:
    """Holds the trainer (SIGSTOP) and lets it go (SIGCONT), recording why each hold began and
    ended and when (wall clock), so a check of the run's pace can leave the holds out. It
    follows the trainer across restarts: a held trainer that was killed is replaced by a new
    process, which `follow` holds in its turn."""

    run_dir: Path
    started: float
    events: list[str] = field(default_factory=list)
    held: list[tuple[float, float]] = field(default_factory=list)
    """(from, to) wall-clock seconds of every hold"""
    pid: int | None = None
    since: float | None = None

    def note(self, what: str) -> None:
        self.events.append(f"{time.monotonic() - self.started:5.0f}s {what}")

    def hold(self, why: str) -> None:
        if self.since is None:
            self.since = time.time()
            self.note(f"trainer held: {why}")
        self.follow()

    def follow(self) -> None:
        """Stop the trainer now running if a hold is on and it is not the one stopped."""
        if self.since is None:
            return
        pid = current_pid(self.run_dir, "trainer")
        if pid is None or pid == self.pid:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
            if self.pid is not None:
                self.note(f"trainer restarted while held (pid {self.pid} -> {pid}); holding the new one")
            self.pid = pid

    def release(self, why: str) -> None:
        if self.since is None:
            return
        # the pid stopped, whether or not pids.json still names it (it may be mid-rewrite): a
        # killed trainer's pid is not reused within seconds, and SIGCONT to a running process
        # does nothing
        if self.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGCONT)
        self.held.append((self.since, time.time()))
        self.note(f"trainer released after {time.time() - self.since:.1f} s: {why}")
        self.pid = self.since = None

    def held_s(self) -> float:
        return 0.0 if self.since is None else time.time() - self.since


@dataclass
class Run:
    """`lorabus up` on the tiny task, with faults fired from a thread."""

    run_dir: Path
    steps: int
    overrides: list[str] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    timeout_s: float = 540.0
    hold_bound_s: float = HOLD_BOUND_S
    gate: Gate | None = None
    bus_url: str | None = None
    """a NATS server or cluster already running (`--bus-url`); None: the launcher's own"""

    def command(self) -> list[str]:
        bus = ["--bus-url", self.bus_url] if self.bus_url else []
        return [sys.executable, "-m", "services.local.launcher", "--config", "examples/tiny.yaml", *bus,
                "--timeout", str(self.timeout_s), "--progress-every", "10",
                f"run_dir={self.run_dir}", f"total_train_steps={self.steps}", *self.overrides]  # fmt: skip

    def go(self) -> tuple[subprocess.CompletedProcess, float]:
        cmd = self.command()
        started = time.monotonic()
        self.gate = Gate(self.run_dir, started)
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        done = threading.Event()
        driver = threading.Thread(target=self._drive, args=(done, started, self.gate), daemon=True)
        driver.start()
        try:
            out, _ = proc.communicate(timeout=self.timeout_s + 120)
        finally:
            done.set()
            driver.join(timeout=SEEN_BOUND_S + 10)
            self.gate.release("the run ended")
            if proc.poll() is None:
                proc.kill()
        return subprocess.CompletedProcess(cmd, proc.returncode, out), time.monotonic() - started

    def _drive(self, done: threading.Event, started: float, gate: Gate) -> None:
        """Fire each fault at its target, holding the trainer while the exports catch up to
        it, then inject it behind the held gate and open the gate once its effect is seen."""
        floor, before = -1, None
        try:
            for fault in self.faults:
                fault.target = target = max(fault.after, floor + GAP)
                if not self._await_target(fault, target, before, done, gate):
                    return
                gate.hold(f"{fault.name}: injecting")
                gate.note(f"{fault.name}: export v{exported_head(self.run_dir)} reached (target v{target}); injecting")
                try:
                    fault.did = fault.act(self.run_dir)
                except Exception as exc:  # the assertion on fired faults reports it
                    fault.did = f"failed: {exc!r}"
                    gate.release(f"{fault.name} failed")
                    return
                fault.fired_at = time.monotonic() - started
                gate.release(f"{fault.name} injected and seen")
                floor, before = exported_head(self.run_dir), fault
        finally:
            gate.release("the driver stopped")

    def _await_target(self, fault: Fault, target: int, before: Fault | None, done: threading.Event, gate: Gate) -> bool:
        """Wait until export/v<target> exists and the fault `before` recovered, holding the
        trainer once it announced LEAD versions past the target, for `hold_bound_s` at most;
        False when the run ended first."""
        held_before = 0.0
        pending = before if before is not None and before.recovered is not None else None
        while True:
            exported = exported_head(self.run_dir)
            if pending is not None and pending.recovered is not None and pending.recovered(self.run_dir):
                gate.note(f"{pending.name} recovered")
                pending = None
            if exported >= target and pending is None:
                return True
            waits = f"{fault.name} waits for export v{target}" + (f" and {pending.name} to recover" if pending else "")
            announced = announced_head(self.run_dir)
            if announced >= target + LEAD and held_before + gate.held_s() < self.hold_bound_s:
                gate.hold(f"{waits}; v{announced} announced, v{exported} exported")
            elif gate.since is not None:
                held_before += gate.held_s()
                gate.release(f"bound: held {self.hold_bound_s:g} s while {waits}; v{exported} exported")
            if done.wait(TICK_S):
                gate.note(f"the run ended while {waits} (v{exported} exported)")
                return False


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
    trainer_consumer: str = ""
    """the trainer's durable as the server holds it (for a failure's message)"""
    step_records: list[m.TrainerStep] = field(default_factory=list)
    """every TrainerStep stored, duplicates of a step included (for a failure's message)"""


async def _read(run_dir: Path, url: str | None) -> Streams:
    server = start_nats_server(run_dir / "nats") if url is None else None
    if server is not None:
        url = server.url
    assert url is not None
    bus = await Bus.connect(BusConfig(url=url), run=RUN, service="chaos-check")
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
            s.step_records.append(step)
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
        info = await bus.js.consumer_info(trainer.stream, trainer.durable)
        s.trainer_consumer = (
            f"pending {info.num_pending}, ack pending {info.num_ack_pending}, redelivered {info.num_redelivered}, "
            f"delivered up to seq {info.delivered.stream_seq}, acked up to seq {info.ack_floor.stream_seq}"
        )
    finally:
        await bus.close()
        if server is not None:
            server.close()
    return s


def read_streams(run_dir: Path, url: str | None = None) -> Streams:
    """The stopped run's streams: from its own store (a fresh nats-server on the run's
    directory), or from the server or cluster at `url` that served it."""
    return asyncio.run(_read(run_dir, url))
