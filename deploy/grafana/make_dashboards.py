"""Write the Grafana dashboards (JSON models) under deploy/grafana/dashboards/.

    python deploy/grafana/make_dashboards.py           # rewrite the JSON files
    python deploy/grafana/make_dashboards.py --check   # exit 1 if they are stale

The panels are data here and the JSON is derived, so every panel has the same shape and the
tests can read the queries back. Queries use only metrics from docs/metrics.md, and every
selector of a per-run metric (one with a `run` label) filters by the dashboards' `run` variable
(`by_run(...)`), so one fleet's dashboard shows the runs picked and lines are told apart by run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent / "dashboards"
DATASOURCE = {"type": "prometheus", "uid": "lorabus-prometheus"}
SCHEMA_VERSION = 39
RATE = "$__rate_interval"
RUN = 'run=~"$run"'
"""the matcher of the `run` variable (multi-value, `All` = `.*`)"""


def by_run(metric: str, matchers: str = "") -> str:
    """`metric` filtered by the run variable (and `matchers`, PromQL label matchers)."""
    return f"{metric}{{{RUN}{', ' + matchers if matchers else ''}}}"


def q95(metric: str, by: str = "") -> str:
    """The 95th percentile of a per-run histogram, one line per run (and per `by`)."""
    group = f"le, run{', ' + by if by else ''}"
    return f"histogram_quantile(0.95, sum by ({group}) (rate({by_run(metric + '_bucket')}[{RATE}])))"


def q50(metric: str, by: str = "") -> str:
    return q95(metric, by).replace("0.95", "0.5", 1)


def run_variable() -> dict:
    """The `run` template variable: every run seen on a lorabus series, several at once."""
    query = 'label_values({__name__=~"lorabus_.+"}, run)'
    return {
        "name": "run",
        "label": "run",
        "type": "query",
        "datasource": DATASOURCE,
        "definition": query,
        "query": {"qryType": 1, "query": query, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
        "refresh": 2,  # on time range change: runs are submitted while the fleet runs
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "options": [],
        "regex": "",
        "sort": 1,
        "hide": 0,
        "skipUrlSync": False,
    }


# (title, panel type, unit, [(expr, legend)], width)
OVERVIEW = [
    ("Head version (registry)", "stat", "none", [(by_run("lorabus_registry_head_version"), "{{run}}")], 6),
    ("Trainer version", "stat", "none", [(by_run("lorabus_trainer_version"), "{{run}}")], 6),
    ("Last exported version", "stat", "none", [(by_run("lorabus_exporter_last_version"), "{{run}}")], 6),
    ("Grants in flight", "stat", "none", [(by_run("lorabus_registry_in_flight"), "{{run}}")], 6),
    (
        "Loaded version per replica",
        "timeseries",
        "none",
        [
            (by_run("lorabus_rollout_loaded_version"), "{{run}} {{replica}} (rollout)"),
            (by_run("lorabus_registry_replica_loaded_version"), "{{run}} {{replica}} (registry's view)"),
            (by_run("lorabus_registry_head_version"), "{{run}} head"),
        ],
        12,
    ),
    (
        "Adapter propagation latency (publish -> loaded)",
        "timeseries",
        "s",
        [
            (q50("lorabus_rollout_propagation_seconds", "replica"), "p50 {{run}} {{replica}}"),
            (q95("lorabus_rollout_propagation_seconds", "replica"), "p95 {{run}} {{replica}}"),
        ],
        12,
    ),
    (
        "Staleness at decision (H - v)",
        "bargauge",
        "none",
        [
            ("sum by (le) (increase(%s[$__range]))" % by_run("lorabus_registry_staleness_bucket"), "<= {{le}}"),
        ],
        8,
    ),
    (
        "Trajectories by verdict",
        "timeseries",
        "ops",
        [
            (
                "sum by (run, verdict) (rate(%s[%s]))" % (by_run("lorabus_registry_trajectories_total"), RATE),
                "{{run}} {{verdict}}",
            ),
        ],
        8,
    ),
    (
        "Admission: grants and denials by reason",
        "timeseries",
        "ops",
        [
            ("sum by (run) (rate(%s[%s]))" % (by_run("lorabus_registry_grants_total"), RATE), "{{run}} granted"),
            (
                "sum by (run, reason) (rate(%s[%s]))" % (by_run("lorabus_registry_denials_total"), RATE),
                "{{run}} denied: {{reason}}",
            ),
        ],
        8,
    ),
    (
        "Reward per version",
        "timeseries",
        "none",
        [
            (by_run("lorabus_trainer_reward_mean"), "{{run}} trainer: mean reward of the step"),
            (by_run("lorabus_trainer_version"), "{{run}} version"),
            (
                "sum by (run, replica) (rate(%s[5m])) / sum by (run, replica) (rate(%s[5m]))"
                % (by_run("lorabus_rollout_reward_sum"), by_run("lorabus_rollout_reward_count")),
                "{{run}} rollout {{replica}}: mean reward",
            ),
        ],
        12,
    ),
    ("Trainer loss", "timeseries", "none", [(by_run("lorabus_trainer_loss"), "{{run}} loss")], 12),
    (
        "Train/inference mismatch (per-token KL, k3)",
        "timeseries",
        "none",
        [
            (
                by_run("lorabus_trainer_mismatch_kl", 'stat="mean", tokens="on_policy"'),
                "{{run}} KL mean (on-policy tokens)",
            ),
            (
                by_run("lorabus_trainer_mismatch_kl", 'stat="max", tokens="on_policy"'),
                "{{run}} KL max (on-policy tokens)",
            ),
            (by_run("lorabus_trainer_mismatch_kl", 'stat="mean", tokens="all"'), "{{run}} KL mean (all tokens)"),
            (
                by_run("lorabus_trainer_mismatch_logprob_diff", 'stat="mean", tokens="on_policy"'),
                "{{run}} |Δ logprob| mean (on-policy)",
            ),
            (
                q95("lorabus_rollout_canary_gap", "replica"),
                "{{run}} canary |Δ logprob| p95 {{replica}} (at each load)",
            ),
        ],
        12,
    ),
    (
        "Policy identity: rejected, refused, load failures (canary withdrawals among them)",
        "timeseries",
        "short",
        [
            (
                "sum by (run, reason) (increase(%s[5m]))" % by_run("lorabus_registry_rejections_total"),
                "{{run}} registry rejected: {{reason}}",
            ),
            (
                "sum by (run, reason) (increase(%s[5m]))" % by_run("lorabus_trainer_refused_groups_total"),
                "{{run}} trainer refused: {{reason}}",
            ),
            (
                "sum by (run, replica) (increase(%s[5m]))" % by_run("lorabus_rollout_load_failures_total"),
                "{{run}} load failures {{replica}}",
            ),
        ],
        12,
    ),
    (
        "Eval score per version",
        "timeseries",
        "none",
        [
            (by_run("lorabus_eval_score"), "{{run}} {{evaluator}} {{metric}}"),
            (by_run("lorabus_eval_version"), "{{run}} {{evaluator}}: version scored"),
        ],
        12,
    ),
    # the fleet: how the runs share it (the run table's states are the fleet's, not one run's)
    ("Fleet: runs by state", "timeseries", "none", [("lorabus_fleet_runs", "{{state}}")], 8),
    (
        "Fleet: groups in flight and share by run",
        "timeseries",
        "none",
        [
            (by_run("lorabus_fleet_running"), "{{run}} in flight"),
            (by_run("lorabus_fleet_share"), "{{run}} share"),
        ],
        8,
    ),
    (
        "Fleet: trainer adapter memory by run (quota)",
        "timeseries",
        "bytes",
        [
            (by_run("lorabus_fleet_adapter_memory_bytes"), "{{run}}"),
            ("sum(%s)" % by_run("lorabus_fleet_adapter_memory_bytes"), "runs picked, together"),
            ("lorabus_fleet_adapter_memory_budget_bytes", "fleet.max_adapter_memory_gib"),
        ],
        12,
    ),
    (
        "Fleet: admissions by run, denials",
        "timeseries",
        "ops",
        [
            ("sum by (run) (rate(%s[%s]))" % (by_run("lorabus_fleet_grants_total"), RATE), "{{run}} granted"),
            ("sum by (reason) (rate(lorabus_fleet_denials_total[%s]))" % RATE, "fleet denied: {{reason}}"),
        ],
        8,
    ),
]

THROUGHPUT = [
    (
        "Trainer step time",
        "timeseries",
        "s",
        [
            (q50("lorabus_trainer_step_seconds"), "p50 {{run}}"),
            (q95("lorabus_trainer_step_seconds"), "p95 {{run}}"),
        ],
        12,
    ),
    (
        "Runs per trainer step (a fleet's ready runs step together)",
        "timeseries",
        "none",
        [
            (q50("lorabus_trainer_step_runs"), "p50 {{run}}"),
        ],
        12,
    ),
    (
        "Trainer tokens/s",
        "timeseries",
        "none",
        [
            (by_run("lorabus_trainer_tokens_per_second"), "{{run}} tokens/s (last step)"),
        ],
        12,
    ),
    (
        "Rollout tokens/s",
        "timeseries",
        "none",
        [
            (
                "sum by (run, replica) (rate(%s[%s]))" % (by_run("lorabus_rollout_tokens_total"), RATE),
                "{{run}} {{replica}}",
            ),
            ("sum(rate(%s[%s]))" % (by_run("lorabus_rollout_tokens_total"), RATE), "all replicas, runs picked"),
        ],
        12,
    ),
    (
        "Trajectories published",
        "timeseries",
        "ops",
        [
            (
                "sum by (run, replica) (rate(%s[%s]))" % (by_run("lorabus_rollout_trajectories_total"), RATE),
                "{{run}} {{replica}}",
            ),
        ],
        12,
    ),
    (
        "Adapter load time",
        "timeseries",
        "s",
        [
            (q95("lorabus_rollout_adapter_load_seconds", "replica"), "p95 {{run}} {{replica}}"),
        ],
        8,
    ),
    (
        "Adapter publish time (trainer)",
        "timeseries",
        "s",
        [
            (q95("lorabus_trainer_publish_seconds"), "p95 {{run}}"),
        ],
        8,
    ),
    ("Export time", "timeseries", "s", [(q95("lorabus_exporter_export_seconds"), "p95 {{run}}")], 8),
    (
        "Canary time (part of time to servable)",
        "timeseries",
        "s",
        [
            (q95("lorabus_trainer_canary_seconds"), "p95 {{run}} trainer"),
            (q95("lorabus_rollout_canary_seconds", "replica"), "p95 {{run}} {{replica}}"),
        ],
        8,
    ),
    (
        "Registry decision latency",
        "timeseries",
        "s",
        [
            (q95("lorabus_registry_decision_seconds"), "p95 {{run}}"),
        ],
        8,
    ),
    (
        "Bus messages",
        "timeseries",
        "ops",
        [
            (
                "sum by (run, service, direction) (rate(%s[%s]))" % (by_run("lorabus_bus_messages_total"), RATE),
                "{{run}} {{service}} {{direction}}",
            ),
        ],
        8,
    ),
    (
        "Bus errors and dead letters",
        "timeseries",
        "short",
        [
            (
                "sum by (run, service, reason) (increase(%s[5m]))" % by_run("lorabus_bus_dead_letters_total"),
                "{{run}} dead letters {{service}}: {{reason}}",
            ),
            # a connection's, whichever runs it carries
            ("sum by (service) (increase(lorabus_bus_reconnects_total[5m]))", "reconnects {{service}}"),
            (
                "sum by (run, replica) (increase(%s[5m]))" % by_run("lorabus_rollout_load_failures_total"),
                "{{run}} load failures {{replica}}",
            ),
            (
                "sum by (run, stage) (increase(%s[5m]))" % by_run("lorabus_exporter_failures_total"),
                "{{run}} export failures {{stage}}",
            ),
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
    out: dict[str, Any] = {
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
        "templating": {"list": [run_variable()]},
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
