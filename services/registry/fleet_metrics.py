"""The fleet's Prometheus metrics: one series per run (`run` label), set by the registry."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

RUNS = Gauge("lorabus_fleet_runs", "Runs in the fleet's run table, by state", ["state"])
GRANTS = Counter("lorabus_fleet_grants_total", "Fleet admission grants, by the run picked", ["run"])
DENIALS = Counter("lorabus_fleet_denials_total", "Fleet admission requests no run could take, by reason", ["reason"])
RUNNING = Gauge("lorabus_fleet_running", "Groups in flight (grants issued, not yet finished), by run", ["run"])
HEAD_VERSION = Gauge("lorabus_fleet_head_version", "Latest adapter version published, by run", ["run"])
ACCEPTED = Gauge("lorabus_fleet_accepted", "Trajectories accepted so far, by run", ["run"])
SHARE = Gauge("lorabus_fleet_share", "A run's weight in the fair share (0 once it stops)", ["run"])
