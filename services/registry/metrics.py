"""The registry's Prometheus metrics (default registry, served by services.common.metrics).

The `lorabus_registry_*` series describe each run's ledger (label `run`: a fleet's registry serves
every run of the fleet in one process); the `FLEET_*` series (`lorabus_fleet_*`) the fleet's run
table, one series per run too.
"""

from __future__ import annotations

import functools

from prometheus_client import Counter, Gauge, Histogram

HEAD_VERSION = Gauge("lorabus_registry_head_version", "Latest adapter version published (H)", ["run"])
GRANTS = Counter("lorabus_registry_grants_total", "Admission grants issued", ["run"])
DENIALS = Counter("lorabus_registry_denials_total", "Admission requests denied, by reason", ["run", "reason"])
TRAJECTORIES = Counter(
    "lorabus_registry_trajectories_total",
    "Trajectory decisions (first decisions only; duplicates are not counted), by verdict",
    ["run", "verdict"],
)
REJECTIONS = Counter(
    "lorabus_registry_rejections_total",
    "Trajectories rejected (first decisions only), by reason code (identity: named another policy than published)",
    ["run", "reason"],
)
STALENESS = Histogram(
    "lorabus_registry_staleness",
    "H - v (head minus the trajectory's oldest version) at decision time",
    ["run"],
    buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16),
)
IN_FLIGHT = Gauge("lorabus_registry_in_flight", "Grants issued and not yet finished or expired", ["run"])
REPLICA_LOADED_VERSION = Gauge(
    "lorabus_registry_replica_loaded_version",
    "Newest adapter version each replica reports loaded (-1: none)",
    ["run", "replica"],
)
DECISION_SECONDS = Histogram(
    "lorabus_registry_decision_seconds",
    "From receiving a trajectory to its decision being persisted and published",
    ["run"],
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
)
LEDGER_WRITES = Counter("lorabus_registry_ledger_writes_total", "Ledger snapshots written to the KV bucket", ["run"])

FLEET_RUNS = Gauge("lorabus_fleet_runs", "Runs in the fleet's run table, by state", ["state"])
FLEET_GRANTS = Counter("lorabus_fleet_grants_total", "Fleet admission grants, by the run picked", ["run"])
FLEET_DENIALS = Counter(
    "lorabus_fleet_denials_total", "Fleet admission requests no run could take, by reason", ["reason"]
)
FLEET_RUNNING = Gauge("lorabus_fleet_running", "Groups in flight (grants issued, not yet finished), by run", ["run"])
FLEET_HEAD_VERSION = Gauge("lorabus_fleet_head_version", "Latest adapter version published, by run", ["run"])
FLEET_ACCEPTED = Gauge("lorabus_fleet_accepted", "Trajectories accepted so far, by run", ["run"])
FLEET_SHARE = Gauge("lorabus_fleet_share", "A run's weight in the fair share (0 once it stops)", ["run"])
FLEET_ADAPTER_MEMORY = Gauge(
    "lorabus_fleet_adapter_memory_bytes",
    "Trainer memory a live run's adapter holds by the quota's arithmetic: fp32 LoRA parameters, gradients and "
    "optimizer moments (0 once it stops; set only under fleet.max_adapter_memory_gib)",
    ["run"],
)
FLEET_ADAPTER_MEMORY_BUDGET = Gauge(
    "lorabus_fleet_adapter_memory_budget_bytes",
    "fleet.max_adapter_memory_gib in bytes: what the live runs' adapters may hold together (absent: unbounded)",
)


@functools.cache
def verdict_count(run: str, verdict: str):
    """TRAJECTORIES' child for a run's verdict, labelled once (a decision counts on the hot path)."""
    return TRAJECTORIES.labels(run, verdict)


def observe_ledger(run: str, ledger) -> None:
    """Gauges that mirror a run's ledger state (set after every change)."""
    if ledger.head is not None:
        HEAD_VERSION.labels(run).set(ledger.head)
    IN_FLIGHT.labels(run).set(ledger.running)
    for replica, state in ledger.replicas.items():
        REPLICA_LOADED_VERSION.labels(run, replica).set(max(state.loaded, default=-1))
