"""Write the Grafana dashboards (JSON models) under deploy/grafana/dashboards/.

    python deploy/grafana/make_dashboards.py           # rewrite the JSON files
    python deploy/grafana/make_dashboards.py --check   # exit 1 if they are stale

The panels are data here and the JSON is derived, so every panel has the same shape and the
tests can read the queries back. Queries use only metrics from docs/metrics.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "dashboards"
DATASOURCE = {"type": "prometheus", "uid": "lorabus-prometheus"}
SCHEMA_VERSION = 39
RATE = "$__rate_interval"


def q95(metric: str, by: str = "") -> str:
    group = f"le{', ' + by if by else ''}"
    return f"histogram_quantile(0.95, sum by ({group}) (rate({metric}_bucket[{RATE}])))"


def q50(metric: str, by: str = "") -> str:
    return q95(metric, by).replace("0.95", "0.5", 1)


# (title, panel type, unit, [(expr, legend)], width)
OVERVIEW = [
    ("Head version (registry)", "stat", "none", [("lorabus_registry_head_version", "head")], 6),
    ("Trainer version", "stat", "none", [("lorabus_trainer_version", "trainer")], 6),
    ("Last exported version", "stat", "none", [("lorabus_exporter_last_version", "exported")], 6),
    ("Grants in flight", "stat", "none", [("lorabus_registry_in_flight", "in flight")], 6),
    (
        "Loaded version per replica",
        "timeseries",
        "none",
        [
            ("lorabus_rollout_loaded_version", "{{replica}} (rollout)"),
            ("lorabus_registry_replica_loaded_version", "{{replica}} (registry's view)"),
            ("lorabus_registry_head_version", "head"),
        ],
        12,
    ),
    (
        "Adapter propagation latency (publish -> loaded)",
        "timeseries",
        "s",
        [
            (q50("lorabus_rollout_propagation_seconds", "replica"), "p50 {{replica}}"),
            (q95("lorabus_rollout_propagation_seconds", "replica"), "p95 {{replica}}"),
        ],
        12,
    ),
    (
        "Staleness at decision (H - v)",
        "bargauge",
        "none",
        [
            ("sum by (le) (increase(lorabus_registry_staleness_bucket[$__range]))", "<= {{le}}"),
        ],
        8,
    ),
    (
        "Trajectories by verdict",
        "timeseries",
        "ops",
        [
            ("sum by (verdict) (rate(lorabus_registry_trajectories_total[%s]))" % RATE, "{{verdict}}"),
        ],
        8,
    ),
    (
        "Admission: grants and denials by reason",
        "timeseries",
        "ops",
        [
            ("rate(lorabus_registry_grants_total[%s])" % RATE, "granted"),
            ("sum by (reason) (rate(lorabus_registry_denials_total[%s]))" % RATE, "denied: {{reason}}"),
        ],
        8,
    ),
    (
        "Reward per version",
        "timeseries",
        "none",
        [
            ("lorabus_trainer_reward_mean", "trainer: mean reward of the step"),
            ("lorabus_trainer_version", "version"),
            (
                "sum by (replica) (rate(lorabus_rollout_reward_sum[5m])) / "
                "sum by (replica) (rate(lorabus_rollout_reward_count[5m]))",
                "rollout {{replica}}: mean reward",
            ),
        ],
        12,
    ),
    ("Trainer loss", "timeseries", "none", [("lorabus_trainer_loss", "loss")], 12),
    (
        "Train/inference mismatch (per-token KL, k3)",
        "timeseries",
        "none",
        [
            ('lorabus_trainer_mismatch_kl{stat="mean", tokens="on_policy"}', "KL mean (on-policy tokens)"),
            ('lorabus_trainer_mismatch_kl{stat="max", tokens="on_policy"}', "KL max (on-policy tokens)"),
            ('lorabus_trainer_mismatch_kl{stat="mean", tokens="all"}', "KL mean (all tokens)"),
            ('lorabus_trainer_mismatch_logprob_diff{stat="mean", tokens="on_policy"}', "|Δ logprob| mean (on-policy)"),
            (q95("lorabus_rollout_canary_gap", "replica"), "canary |Δ logprob| p95 {{replica}} (at each load)"),
        ],
        12,
    ),
    (
        "Policy identity: rejected, refused, load failures (canary withdrawals among them)",
        "timeseries",
        "short",
        [
            ("sum by (reason) (increase(lorabus_registry_rejections_total[5m]))", "registry rejected: {{reason}}"),
            ("sum by (reason) (increase(lorabus_trainer_refused_groups_total[5m]))", "trainer refused: {{reason}}"),
            ("sum by (replica) (increase(lorabus_rollout_load_failures_total[5m]))", "load failures {{replica}}"),
        ],
        12,
    ),
    (
        "Eval score per version",
        "timeseries",
        "none",
        [
            ("lorabus_eval_score", "{{evaluator}} {{metric}}"),
            ("lorabus_eval_version", "{{evaluator}}: version scored"),
        ],
        12,
    ),
]

THROUGHPUT = [
    (
        "Trainer step time",
        "timeseries",
        "s",
        [
            (q50("lorabus_trainer_step_seconds"), "p50"),
            (q95("lorabus_trainer_step_seconds"), "p95"),
        ],
        12,
    ),
    (
        "Trainer tokens/s",
        "timeseries",
        "none",
        [
            ("lorabus_trainer_tokens_per_second", "tokens/s (last step)"),
        ],
        12,
    ),
    (
        "Rollout tokens/s",
        "timeseries",
        "none",
        [
            ("sum by (replica) (rate(lorabus_rollout_tokens_total[%s]))" % RATE, "{{replica}}"),
            ("sum(rate(lorabus_rollout_tokens_total[%s]))" % RATE, "all replicas"),
        ],
        12,
    ),
    (
        "Trajectories published",
        "timeseries",
        "ops",
        [
            ("sum by (replica) (rate(lorabus_rollout_trajectories_total[%s]))" % RATE, "{{replica}}"),
        ],
        12,
    ),
    (
        "Adapter load time",
        "timeseries",
        "s",
        [
            (q95("lorabus_rollout_adapter_load_seconds", "replica"), "p95 {{replica}}"),
        ],
        8,
    ),
    (
        "Adapter publish time (trainer)",
        "timeseries",
        "s",
        [
            (q95("lorabus_trainer_publish_seconds"), "p95"),
        ],
        8,
    ),
    ("Export time", "timeseries", "s", [(q95("lorabus_exporter_export_seconds"), "p95")], 8),
    (
        "Canary time (part of time to servable)",
        "timeseries",
        "s",
        [
            (q95("lorabus_trainer_canary_seconds"), "p95 trainer"),
            (q95("lorabus_rollout_canary_seconds", "replica"), "p95 {{replica}}"),
        ],
        8,
    ),
    (
        "Registry decision latency",
        "timeseries",
        "s",
        [
            (q95("lorabus_registry_decision_seconds"), "p95"),
        ],
        8,
    ),
    (
        "Bus messages",
        "timeseries",
        "ops",
        [
            ("sum by (service, direction) (rate(lorabus_bus_messages_total[%s]))" % RATE, "{{service}} {{direction}}"),
        ],
        8,
    ),
    (
        "Bus errors and dead letters",
        "timeseries",
        "short",
        [
            (
                "sum by (service, reason) (increase(lorabus_bus_dead_letters_total[5m]))",
                "dead letters {{service}}: {{reason}}",
            ),
            ("sum by (service) (increase(lorabus_bus_reconnects_total[5m]))", "reconnects {{service}}"),
            ("sum by (replica) (increase(lorabus_rollout_load_failures_total[5m]))", "load failures {{replica}}"),
            ("sum by (stage) (increase(lorabus_exporter_failures_total[5m]))", "export failures {{stage}}"),
        ],
        8,
    ),
]

DASHBOARDS = {
    "lorabus-overview": ("lorabus: versions, staleness, rewards", OVERVIEW),
    "lorabus-throughput": ("lorabus: throughput, latency, bus health", THROUGHPUT),
}


def panel(pid: int, x: int, y: int, title: str, kind: str, unit: str, targets, width: int) -> dict:
    height = 4 if kind == "stat" else 8
    out = {
        "id": pid,
        "type": kind,
        "title": title,
        "datasource": DATASOURCE,
        "gridPos": {"h": height, "w": width, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {},
        "targets": [
            {"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "range": True}
            for i, (expr, legend) in enumerate(targets)
        ],
    }
    if kind == "bargauge":
        out["targets"][0]["format"] = "heatmap"
        out["options"] = {"orientation": "vertical", "displayMode": "basic"}
    if kind == "stat":
        out["options"] = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}}
    return out


def dashboard(uid: str, title: str, panels) -> dict:
    built, x, y, row_height = [], 0, 0, 0
    for pid, (p_title, kind, unit, targets, width) in enumerate(panels, start=1):
        if x + width > 24:
            x, y = 0, y + row_height
            row_height = 0
        built.append(panel(pid, x, y, p_title, kind, unit, targets, width))
        row_height = max(row_height, built[-1]["gridPos"]["h"])
        x += width
    return {
        "uid": uid,
        "title": title,
        "tags": ["lorabus"],
        "timezone": "browser",
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "editable": True,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": []},
        "annotations": {"list": []},
        "panels": built,
    }


def render() -> dict[str, str]:
    return {
        f"{uid}.json": json.dumps(dashboard(uid, title, panels), indent=2) + "\n"
        for uid, (title, panels) in DASHBOARDS.items()
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true")
    args = p.parse_args(argv)
    files = render()
    if args.check:
        stale = [n for n, text in files.items() if not (OUT / n).is_file() or (OUT / n).read_text() != text]
        if stale:
            print(f"stale dashboards {stale}: run python deploy/grafana/make_dashboards.py", file=sys.stderr)
            return 1
        return 0
    OUT.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (OUT / name).write_text(text)
    print(f"wrote {sorted(files)} to {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
