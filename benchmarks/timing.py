"""Timing on the CPU or a CUDA device, the one way every benchmark takes it.

Invariant: a clock is read only once the device's queued work is done (`sync` before and after),
so a CUDA figure is the work's time and never just its launch; medians are reported in ms.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable

import torch


def sync(device: torch.device) -> None:
    """Wait for `device`'s queued work (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds `fn()` takes on `device`, its queued work included."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def median_ms(seconds: Iterable[float]) -> float:
    return statistics.median(seconds) * 1e3


def device_name(device: torch.device) -> str:
    """The GPU's name for a results file, or "cpu"."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
