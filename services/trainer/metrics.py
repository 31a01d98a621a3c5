"""The trainer's Prometheus metrics (served by services.common.metrics), one series per run (`run`
label): a fleet's trainer trains several (docs/multi-run.md)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

STEP_SECONDS = Histogram(
    "lorabus_trainer_step_seconds",
    "Wall time of one train step (forward, backward, update)",
    ["run"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
)
TOKENS_PER_SECOND = Gauge(
    "lorabus_trainer_tokens_per_second", "Completion tokens trained per second in the last step", ["run"]
)
VERSION = Gauge("lorabus_trainer_version", "Latest adapter version this trainer published", ["run"])
LOSS = Gauge("lorabus_trainer_loss", "Policy loss of the last step", ["run"])
REWARD_MEAN = Gauge("lorabus_trainer_reward_mean", "Mean reward of the last step's completions", ["run"])
STEPS = Counter("lorabus_trainer_steps_total", "Train steps completed", ["run"])
PUBLISH_SECONDS = Histogram(
    "lorabus_trainer_publish_seconds",
    "Time to serialize, upload and announce one adapter version",
    ["run"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
