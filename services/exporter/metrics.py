"""The exporter's Prometheus metrics (default registry, served by `start_metrics_server`), one
series per run (label `run`: the exporter serves every run of its fleet)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

EXPORTS = Counter(
    "lorabus_exporter_exports_total",
    "Adapter versions written as PEFT directories (a redelivered, already exported version is not counted again)",
    ["run"],
)
EXPORT_SECONDS = Histogram(
    "lorabus_exporter_export_seconds",
    "Time from taking an adapter event to its ExportDone: fetch, convert, write, publish",
    ["run"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
LAST_VERSION = Gauge(
    "lorabus_exporter_last_version",
    "Highest adapter version exported so far (-1 before the first)",
    ["run"],
)
FAILURES = Counter(
    "lorabus_exporter_failures_total",
    "Export attempts that failed, by stage (a retried event counts once per attempt)",
    ["run", "stage"],
)
STAGES = ("fetch", "convert", "write", "publish", "no-object-payload")


def open_run(run: str) -> None:
    """A run's series from its start (a process serves a run once): no version exported yet
    (-1), no failure at any stage yet."""
    LAST_VERSION.labels(run).set(-1)
    for stage in STAGES:
        FAILURES.labels(run, stage)
