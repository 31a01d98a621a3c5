"""The GPU while a benchmark runs: utilisation and memory in use, sampled from nvidia-smi.

    with GpuMonitor() as gpu:
        ...                      # the work
    gpu.summary()                # {"util_mean_pct", "util_busy_frac", "mem_peak_mib", ...} or None

`utilization.gpu` is nvidia-smi's share of the last sample period (1/6 s to 1 s, by GPU) in
which any kernel ran: a coarse busy fraction, not SM occupancy; it is what a fleet of small
runs is meant to raise. Memory is the whole GPU's (every process of the fleet together).
Without nvidia-smi (a CPU machine) every summary is None, and the work runs the same.

Invariant: sampling never fails the work it watches: a failed query is a missing sample.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
import time

QUERY = ["nvidia-smi", "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader,nounits"]


def gpu_name() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def sample() -> tuple[float, float] | None:
    """(utilisation %, memory used MiB) of GPU 0, or None."""
    try:
        out = subprocess.run(QUERY, capture_output=True, text=True, timeout=5)
        util, mem = out.stdout.strip().splitlines()[0].split(",")
        return float(util), float(mem)
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def summarize(samples: list[tuple[float, float, float]]) -> dict | None:
    """(t, util, mem) samples -> the figures a row reports; None without samples."""
    if not samples:
        return None
    utils = [u for _, u, _ in samples]
    return {
        "util_mean_pct": round(sum(utils) / len(utils), 1),
        "util_busy_frac": round(sum(u > 0 for u in utils) / len(utils), 3),
        "mem_peak_mib": max(m for _, _, m in samples),
        "mem_mean_mib": round(sum(m for _, _, m in samples) / len(samples), 1),
        "samples": len(samples),
        "seconds": round(samples[-1][0] - samples[0][0], 1),
    }


def combine(parts: list[dict | None]) -> dict | None:
    """Several summaries as one (runs one after another): means weighted by their seconds."""
    parts = [p for p in parts if p]
    if not parts:
        return None
    weight = sum(max(p["seconds"], 1e-9) for p in parts)
    return {
        "util_mean_pct": round(sum(p["util_mean_pct"] * max(p["seconds"], 1e-9) for p in parts) / weight, 1),
        "util_busy_frac": round(sum(p["util_busy_frac"] * max(p["seconds"], 1e-9) for p in parts) / weight, 3),
        "mem_peak_mib": max(p["mem_peak_mib"] for p in parts),
        "mem_mean_mib": round(sum(p["mem_mean_mib"] * max(p["seconds"], 1e-9) for p in parts) / weight, 1),
        "samples": sum(p["samples"] for p in parts),
        "seconds": round(sum(p["seconds"] for p in parts), 1),
    }


class GpuMonitor(threading.Thread):
    def __init__(self, every_s: float = 0.5):
        super().__init__(daemon=True, name="gpu-monitor")
        self.every_s, self.samples, self.done = every_s, [], threading.Event()
        self.enabled = shutil.which("nvidia-smi") is not None

    def run(self) -> None:
        while self.enabled and not self.done.is_set():
            got = sample()
            if got is not None:
                self.samples.append((time.monotonic(), *got))
            self.done.wait(self.every_s)

    def __enter__(self) -> GpuMonitor:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.join(timeout=10)

    def summary(self) -> dict | None:
        return summarize(list(self.samples))
