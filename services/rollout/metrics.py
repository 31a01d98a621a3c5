"""Prometheus metrics of a rollout replica, one series per (run, replica): a fleet replica serves
every live run of its fleet in one process (docs/multi-run.md), and each series here is about one
run's adapters, grants or completions, so without `run` two runs' values would overwrite or mix.

Label order is always (`run`, `replica`, ...), as the registry's `lorabus_registry_*` series."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

LOADED_VERSION = Gauge(
    "lorabus_rollout_loaded_version", "Newest adapter version loaded (the head served)", ["run", "replica"]
)
ADAPTER_LOAD_SECONDS = Histogram(
    "lorabus_rollout_adapter_load_seconds",
    "Fetch + verify + load of one adapter version",
    ["run", "replica"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
LOAD_STAGE_SECONDS = Histogram(
    "lorabus_rollout_adapter_load_stage_seconds",
    "One stage of an embedded replica's adapter load: fetch, parse, h2d, copy, merge (in sequence: "
    "event received to servable), verify (sha256, beside them)",
    ["run", "replica", "stage"],
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1),
)
PROPAGATION_SECONDS = Histogram(
    "lorabus_rollout_propagation_seconds",
    "AdapterReady.created_at to loaded here",
    ["run", "replica"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
LOADED_VERSIONS = Gauge(
    "lorabus_rollout_loaded_versions",
    "Adapter versions the engine holds now (the keep window, plus old ones still pinned by requests)",
    ["run", "replica"],
)
TOKENS = Counter("lorabus_rollout_tokens_total", "Completion tokens generated", ["run", "replica"])
TOKENS_PER_SECOND = Gauge(
    "lorabus_rollout_tokens_per_second", "Completion tokens/s of the last engine batch", ["run", "replica"]
)
TRAJECTORIES = Counter("lorabus_rollout_trajectories_total", "Trajectories (groups) published", ["run", "replica"])
REWARD = Histogram(
    "lorabus_rollout_reward",
    "Reward of each completion",
    ["run", "replica"],
    buckets=(-1, -0.5, 0, 0.25, 0.5, 0.75, 1, 2, 5),
)
LOAD_FAILURES = Counter("lorabus_rollout_load_failures_total", "Failed adapter load attempts", ["run", "replica"])
IN_FLIGHT = Gauge("lorabus_rollout_in_flight", "Granted groups being generated", ["run", "replica"])
CANARY_GAP = Histogram(
    "lorabus_rollout_canary_gap",
    "Largest |Δ logprob| between this replica's greedy decode of a version's canary and the trainer's "
    "(checked after each load while the version serves, its output held; beyond the dtype's tolerance "
    "the version is withdrawn)",
    ["run", "replica"],
    buckets=(1e-5, 1e-4, 1e-3, 2e-3, 0.01, 0.05, 0.15, 0.5, 1, 5),
)
CANARY_SECONDS = Histogram(
    "lorabus_rollout_canary_seconds",
    "Time one load's canary check took (beside serving, after the version is marked loaded: not part "
    "of its time to servable; what publication waited for it is lorabus_rollout_canary_wait_seconds)",
    ["run", "replica"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
)
CANARY_WAIT_SECONDS = Histogram(
    "lorabus_rollout_canary_wait_seconds",
    "Time one batch's publication waited for canary checks still running on versions it may have "
    "used (0 when none was): the replica canary's cost to the run",
    ["run", "replica"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
)

PRESENT_STATE = (LOADED_VERSION, LOADED_VERSIONS, IN_FLIGHT, TOKENS_PER_SECOND)
"""gauges of what a replica holds or does for a run now; counters and histograms are its history"""


def close_run(run: str, replica: str) -> None:
    """A run this replica no longer serves: its present-state gauges leave /metrics (a stopped
    run must not show versions it no longer holds, and the loaded-versions gauge's callback
    would keep the closed run's follower alive); its counters and histograms stay, so rates and
    totals over its lifetime still read. Serving the run again opens them anew."""
    for gauge in PRESENT_STATE:
        gauge.remove(run, replica)
