"""The fault driver's gate cannot deadlock a run: a fault whose export never comes (a version
stored by a trainer killed before announcing it, an exporter that gave up) holds the trainer
for its bound at most, then lets it go saying why, and the driver stops when the run ends. On a
real process stopped and continued by signals; seconds, no deployment."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.chaos.faults import Fault, Gate, Run, process_state
from tests.fixtures.waiting import until


def test_a_gate_whose_export_never_comes_opens_at_its_bound_and_says_so(tmp_path: Path) -> None:
    trainer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        (tmp_path / "pids.json").write_text(json.dumps({"trainer": trainer.pid}))
        (tmp_path / "trainer.log").write_text("12:00:00.000 INFO trainer service: v5 announced in 1 ms\n")
        (tmp_path / "export" / "v1").mkdir(parents=True)  # stuck: v2 is never exported
        fired: list[Path] = []

        def act(run_dir: Path) -> str:
            fired.append(run_dir)
            return "fired"

        fault = Fault("never due", 2, act)
        run = Run(tmp_path, steps=40, faults=[fault], hold_bound_s=1.5)
        started = time.monotonic()
        run.gate = gate = Gate(tmp_path, started)
        done = threading.Event()
        driver = threading.Thread(target=run._drive, args=(done, started, gate))
        driver.start()
        until(lambda: process_state(trainer.pid) == "T", 10, "the trainer held")
        until(lambda: gate.since is None and gate.held, 10, "the gate opened")
        assert process_state(trainer.pid) in ("S", "R"), "the trainer was not let go"
        assert 1.4 <= gate.held[0][1] - gate.held[0][0] < 5.0, gate.held
        assert "bound: held 1.5 s while never due waits for export v2" in gate.events[-1], gate.events
        time.sleep(1.0)  # the bound is spent: the trainer is not held again
        assert process_state(trainer.pid) in ("S", "R") and len(gate.held) == 1, gate.events
        done.set()
        driver.join(10)
        assert not driver.is_alive() and fired == [] and fault.fired_at is None
        assert "the run ended while never due waits for export v2 (v1 exported)" in gate.events[-1], gate.events
    finally:
        trainer.kill()
        trainer.wait()
