"""The exporter's Prometheus metrics (default registry, served by `start_metrics_server`)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

EXPORTS = Counter(
    "lorabus_exporter_exports_total",
    "Adapter versions written as PEFT directories (a redelivered, already exported version is not counted again)",
)
EXPORT_SECONDS = Histogram(
    "lorabus_exporter_export_seconds",
    "Time from taking an adapter event to its ExportDone: fetch, convert, write, publish",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
LAST_VERSION = Gauge(
    "lorabus_exporter_last_version",
    "Highest adapter version exported so far (-1 before the first)",
)
LAST_VERSION.set(-1)
FAILURES = Counter(
    "lorabus_exporter_failures_total",
    "Export attempts that failed, by stage (a retried event counts once per attempt)",
    ["stage"],
)
STAGES = ("fetch", "convert", "write", "publish", "no-object-payload")
for _stage in STAGES:
    FAILURES.labels(_stage)
