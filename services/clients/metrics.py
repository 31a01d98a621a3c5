"""Metrics of the outside-user tools (the evaluator)."""

from prometheus_client import Gauge, Histogram

EVAL_SCORE = Gauge(
    "lorabus_eval_score",
    "Score of the newest evaluated version, by evaluator and metric",
    ["evaluator", "metric"],
)
EVAL_VERSION = Gauge(
    "lorabus_eval_version",
    "Adapter version the evaluator scored last",
    ["evaluator"],
)
EVAL_SECONDS = Histogram(
    "lorabus_eval_seconds",
    "Time to score one version (load the PEFT directory, run the hook)",
    ["evaluator"],
    buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
)
