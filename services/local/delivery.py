"""The run summary's delivery figures: how long a step takes, and how long its version then takes
to be servable on the replicas, by the path it took (object store or XCCL).

A version's time to servable on a replica is its AdapterLoaded.loaded_at minus the trainer's
step end (TrainerStep.trained_at): publication, transfer, the replica's load and whatever the
replica checks before it marks the version loaded. What a user compares between trainers
(Megatron against FSDP2) and between paths, for the same adapter.

Invariant: pure (no I/O); steps and loads that predate these fields count as absent, never as 0.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable

from proto import messages as m


def _stats(xs: list[float]) -> dict | None:
    if not xs:
        return None
    return {
        "n": len(xs),
        "median": float(f"{statistics.median(xs):.4g}"),
        # sum, not fmean: a value near the float maximum (a forged step on the bus) must give
        # inf in the figure, not an OverflowError in the summary
        "mean": float(f"{sum(xs) / len(xs):.4g}"),
        "max": float(f"{max(xs):.4g}"),
    }


def delivery(steps: Iterable[m.TrainerStep], loads: Iterable[m.AdapterLoaded]) -> dict | None:
    """Step seconds, and per load path the time to servable and the replica's load seconds."""
    by_version = {s.version: s for s in steps}
    if not by_version:
        return None
    servable: dict[str, list[float]] = {}
    load_s: dict[str, list[float]] = {}
    for ld in loads:
        step = by_version.get(ld.version)
        if step is None or step.trained_at is None or ld.loaded_at < step.trained_at:
            continue
        servable.setdefault(ld.via, []).append(ld.loaded_at - step.trained_at)
        load_s.setdefault(ld.via, []).append(ld.load_seconds)
    return {
        "step_seconds": _stats([s.step_seconds for s in by_version.values()]),
        "time_to_servable_s": {via: _stats(xs) for via, xs in sorted(servable.items())},
        "replica_load_s": {via: _stats(xs) for via, xs in sorted(load_s.items())},
    }


def lines(result: dict) -> list[str]:
    """The summary's printed line for these figures (none when the run has none)."""
    d = result.get("delivery")
    if not d or not d["time_to_servable_s"]:
        return []
    paths = ", ".join(
        f"{via} median {s['median']:.3f} s (max {s['max']:.3f})" for via, s in d["time_to_servable_s"].items()
    )
    return [f"time to servable (step end -> loaded on a replica): {paths}"]
