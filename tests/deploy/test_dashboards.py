"""Prometheus config, Grafana dashboards and docs/metrics.md against the metrics the services
really declare (imported from `services/*/metrics.py` and `services.common.bus`)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from tests.deploy.compose import DEPLOY, REPO

sys.path.insert(0, str(DEPLOY))
sys.path.insert(0, str(DEPLOY / "grafana"))
import make_dashboards
import metrics_catalog

DASHBOARDS = sorted((DEPLOY / "grafana" / "dashboards").glob("*.json"))
PROMQL_WORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
    "inf",
    "nan",
}


def promtool() -> str:
    path = shutil.which("promtool")
    if not path:
        pytest.fail("promtool missing: `make prometheus` (apt-get install prometheus) installs it")
    return path


def expressions() -> list[tuple[str, str, str]]:
    """(dashboard file, panel title, expr) for every query of every dashboard."""
    out = []
    for path in DASHBOARDS:
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel.get("targets", []):
                out.append((path.name, panel["title"], target["expr"]))
    return out


def concrete(expr: str) -> str:
    """Grafana's interval variables replaced, so that promtool can parse the expression."""
    return expr.replace("$__rate_interval", "1m").replace("$__range", "1h")


def metric_names_in(expr: str) -> set[str]:
    text = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)  # strings
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # ranges
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        word = m.group(0)
        following = text[m.end() :].lstrip()[:1]
        if following == "(" or word.lower() in PROMQL_WORDS:
            continue  # a function or a keyword
        names.add(word)
    return names


def grouping_labels(expr: str) -> set[str]:
    return {
        label.strip()
        for group in re.findall(r"\bby\s*\(([^)]*)\)", expr)
        for label in group.split(",")
        if label.strip()
    }


@pytest.mark.parametrize("config", ["prometheus/prometheus.yml", "roles/prometheus.yml"])
def test_prometheus_config_passes_promtool(config):
    result = subprocess.run(
        [promtool(), "check", "config", str(DEPLOY / config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_rejects_a_broken_config(tmp_path):
    bad = tmp_path / "prometheus.yml"
    bad.write_text(
        (DEPLOY / "prometheus" / "prometheus.yml").read_text().replace("scrape_interval", "scrape_intervall")
    )
    result = subprocess.run([promtool(), "check", "config", str(bad)], capture_output=True, text=True)
    assert result.returncode != 0


def test_dashboards_are_generated_and_current():
    assert [p.name for p in DASHBOARDS] == sorted(make_dashboards.render())
    assert make_dashboards.main(["--check"]) == 0


def test_dashboards_are_grafana_models_on_the_provisioned_datasource():
    datasources = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    uid = datasources["datasources"][0]["uid"]
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/lorabus.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/etc/grafana/dashboards"
    assert "./grafana/dashboards:/etc/grafana/dashboards:ro" in (DEPLOY / "docker-compose.yml").read_text()
    for path in DASHBOARDS:
        model = json.loads(path.read_text())
        assert model["uid"] == path.stem and model["title"] and isinstance(model["schemaVersion"], int)
        ids = [p["id"] for p in model["panels"]]
        assert len(ids) == len(set(ids)), f"{path.name}: duplicate panel ids"
        for panel in model["panels"]:
            grid = panel["gridPos"]
            assert grid["x"] + grid["w"] <= 24 and grid["h"] > 0, (path.name, panel["title"])
            assert panel["datasource"]["uid"] == uid
            refs = [t["refId"] for t in panel["targets"]]
            assert refs and len(refs) == len(set(refs))


def test_every_query_is_promql(tmp_path):
    rules = {
        "groups": [
            {
                "name": "dashboards",
                "rules": [
                    {"record": f"lorabus:check:{i}", "expr": concrete(expr)}
                    for i, (_, _, expr) in enumerate(expressions())
                ],
            }
        ]
    }
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(rules))
    result = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_query_uses_only_exported_metrics_and_their_labels():
    catalog = {s: m for m in metrics_catalog.catalog() for s in m.series}
    assert "lorabus_registry_head_version" in catalog and "lorabus_bus_dead_letters_total" in catalog
    for dashboard, title, expr in expressions():
        names = metric_names_in(expr)
        assert names, f"{dashboard} / {title}: no metric in {expr!r}"
        unknown = names - set(catalog)
        assert not unknown, f"{dashboard} / {title}: {sorted(unknown)} is not exported by any service"
        allowed = {"le"} | {label for n in names for label in catalog[n].labels}
        assert grouping_labels(expr) <= allowed, f"{dashboard} / {title}: groups by unknown label"


def selectors(expr: str) -> list[tuple[str, str]]:
    """(metric name, its label matchers as written) for every lorabus series an expression reads."""
    text = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", expr)  # grouping lists are no selectors
    return [(m.group(1), m.group(2) or "") for m in re.finditer(r"\b(lorabus_[a-z0-9_]+)(\{[^}]*\})?", text)]


def test_every_metric_of_every_service_is_per_run_but_the_listed_few():
    for metric in metrics_catalog.catalog():
        if metric.shown in metrics_catalog.NOT_PER_RUN:
            assert "run" not in metric.labels, f"{metric.shown} has a run label; take it off NOT_PER_RUN"
        else:
            assert metric.labels[:1] == ("run",), f"{metric.shown} {metric.labels}: a series about one run needs `run`"
    assert set(metrics_catalog.NOT_PER_RUN) <= {m.shown for m in metrics_catalog.catalog()}


def test_every_dashboard_has_a_run_variable():
    for path in DASHBOARDS:
        variables = {v["name"]: v for v in json.loads(path.read_text())["templating"]["list"]}
        run = variables.get("run")
        assert run, f"{path.name}: no `run` template variable"
        assert run["type"] == "query" and run["multi"] and run["includeAll"] and run["allValue"] == ".*"
        assert "run)" in run["definition"] and run["datasource"] == make_dashboards.DATASOURCE


def test_every_per_run_query_filters_by_the_run_variable():
    per_run = {s for m in metrics_catalog.catalog() if "run" in m.labels for s in m.series}
    checked = 0
    for dashboard, title, expr in expressions():
        for name, matchers in selectors(expr):
            if name in per_run:
                checked += 1
                assert 'run=~"$run"' in matchers, f"{dashboard} / {title}: {name} is not filtered by $run in {expr!r}"
            else:  # a process's or the fleet's series has no run to filter on: the filter would empty it
                assert "run" not in matchers, f"{dashboard} / {title}: {name} has no run label"
    assert checked > 30


def test_selectors_parser():
    expr = 'sum by (run, le) (rate(lorabus_x_bucket{run=~"$run", a="b"}[5m])) / on(x) lorabus_y'
    assert selectors(expr) == [("lorabus_x_bucket", '{run=~"$run", a="b"}'), ("lorabus_y", "")]


def test_metric_name_parser():
    expr = 'histogram_quantile(0.95, sum by (le, replica) (rate(lorabus_x_bucket{a="b c"}[5m]))) / on(x) lorabus_y'
    assert metric_names_in(expr) == {"lorabus_x_bucket", "lorabus_y"}


def test_dashboards_cover_what_the_issue_asks_for():
    text = " ".join(expr for _, _, expr in expressions())
    for needed in (
        "lorabus_registry_head_version",
        "lorabus_rollout_loaded_version",
        "lorabus_rollout_propagation_seconds",
        "lorabus_registry_staleness",
        "lorabus_registry_trajectories_total",
        "lorabus_trainer_reward_mean",
        "lorabus_trainer_step_seconds",
        "lorabus_trainer_tokens_per_second",
        "lorabus_rollout_tokens_total",
        "lorabus_bus_dead_letters_total",
        "lorabus_bus_reconnects_total",
    ):
        assert needed in text, needed


def test_metrics_doc_lists_exactly_the_registered_metrics():
    assert metrics_catalog.main(["--check"]) == 0, "docs/metrics.md is stale"
    doc = (REPO / "docs" / "metrics.md").read_text()
    listed = set(re.findall(r"^\| `(lorabus_[a-z0-9_]+)`", doc, re.M))
    expected = {m.name + ("_total" if m.type == "counter" else "") for m in metrics_catalog.catalog()}
    assert listed == expected
