"""A Docker engine for the deploy tests: the one running, else a `dockerd` started here.

Started as root with `--iptables=false` (no NAT: containers reach each other and, through
published ports, the host, nothing beyond), overlay2 storage where the kernel allows it, else
vfs. It keeps Debian's default data root, so built images and their layers survive between
runs and a rerun builds in seconds; the engine started here is stopped when the tests end.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

STORAGE_DRIVERS = ("overlay2", "vfs")


class EngineError(RuntimeError):
    pass


@dataclass
class Engine:
    storage_driver: str
    process: subprocess.Popen | None
    """None when the engine was already running (it is left running)"""

    def stop(self, timeout_s: float = 60.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)


def docker_info(fmt: str = "{{.Driver}}") -> str | None:
    """The running engine's answer to `docker info --format`, None when none answers."""
    if shutil.which("docker") is None:
        return None
    result = subprocess.run(["docker", "info", "--format", fmt], capture_output=True, text=True, timeout=30)
    return result.stdout.strip() if result.returncode == 0 else None


def _start(driver: str, log_path: Path, timeout_s: float) -> subprocess.Popen | None:
    log = open(log_path, "ab")
    process = subprocess.Popen(
        ["dockerd", "--iptables=false", f"--storage-driver={driver}"],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return None
        if docker_info() == driver:
            return process
        time.sleep(0.5)
    process.kill()
    process.wait(10)
    return None


def ensure_engine(log_dir: Path, timeout_s: float = 60.0) -> Engine:
    running = docker_info()
    if running is not None:
        return Engine(running, None)
    missing = [tool for tool in ("docker", "dockerd") if shutil.which(tool) is None]
    if missing:
        raise EngineError(f"{', '.join(missing)}: not installed; `apt-get install docker.io` (or `make docker-engine`)")
    if os.geteuid() != 0:
        raise EngineError("dockerd: no engine runs and starting one needs root; start dockerd, then rerun")
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / "dockerd.log"
    for driver in STORAGE_DRIVERS:
        process = _start(driver, log_path, timeout_s)
        if process is not None:
            return Engine(driver, process)
    tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-20:])
    raise EngineError(f"dockerd: did not start with storage drivers {STORAGE_DRIVERS}; {log_path}:\n{tail}")
