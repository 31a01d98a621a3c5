"""Metrics of the outside-user tools (the evaluator), labelled with the run they score."""

from prometheus_client import Gauge, Histogram

EVAL_SCORE = Gauge(
    "lorabus_eval_score",
    "Score of the newest evaluated version, by evaluator and metric",
    ["run", "evaluator", "metric"],
)
EVAL_VERSION = Gauge(
    "lorabus_eval_version",
    "Adapter version the evaluator scored last",
    ["run", "evaluator"],
)
EVAL_SECONDS = Histogram(
    "lorabus_eval_seconds",
    "Time to score one version (load the PEFT directory, run the hook)",
    ["run", "evaluator"],
    buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
)
