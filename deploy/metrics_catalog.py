"""The Prometheus metrics lorabus services export, read from the code, and docs/metrics.md.

    python deploy/metrics_catalog.py            # rewrite docs/metrics.md
    python deploy/metrics_catalog.py --check    # exit 1 if docs/metrics.md is stale

Every service declares its metrics in `services/<svc>/metrics.py` (and the bus client in
the `BUS_CLIENT` modules) on prometheus-client's default registry; importing those modules is
all it takes to see every name, type, label and help text.

Every series about one run carries a `run` label (a fleet's processes serve several runs); the
few that are not about one run are listed in `NOT_PER_RUN` with the reason, and tests/deploy
checks that the two agree with the code.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "metrics.md"
# the modules below the Bus that every service imports, so every service exports their metrics
BUS_CLIENT = ("services.common.bus", "services.common.nats_client")

# the metrics (as exposed: counters with `_total`) without a `run` label, and what they are about instead
NOT_PER_RUN = {
    "lorabus_bus_reconnects_total": "the process: one connection carries every run it serves",
    "lorabus_fleet_runs": "the fleet: its run table, counted by state",
    "lorabus_fleet_denials_total": "the fleet: admission requests that no run could take",
    "lorabus_fleet_adapter_memory_budget_bytes": "the fleet: the trainer memory all live runs' adapters may hold",
}

# the series each metric type puts on /metrics (prometheus-client adds `_created` too,
# which dashboards have no use for)
SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("_sum", "_count", ""),
    "info": ("_info",),
}


@dataclass(frozen=True)
class Metric:
    name: str
    type: str
    labels: tuple[str, ...]
    help: str
    module: str

    @property
    def service(self) -> str:
        return "every service (bus client)" if self.module in BUS_CLIENT else self.module.split(".")[1]

    @property
    def shown(self) -> str:
        """the name as /metrics and the docs show it (a counter with `_total`)"""
        return self.name + "_total" if self.type == "counter" else self.name

    @property
    def series(self) -> tuple[str, ...]:
        return tuple(self.name + s for s in SUFFIXES[self.type])


def metric_modules() -> list[str]:
    found = sorted(f"services.{p.parent.name}.metrics" for p in (REPO / "services").glob("*/metrics.py"))
    return [m for m in found if m != "services.common.metrics"] + list(BUS_CLIENT)


def catalog() -> list[Metric]:
    """Every lorabus_* metric declared by the service modules."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from prometheus_client.metrics import MetricWrapperBase

    out: dict[str, Metric] = {}
    for module_name in metric_modules():
        module = importlib.import_module(module_name)
        for value in vars(module).values():
            if not isinstance(value, MetricWrapperBase):
                continue
            # prometheus-client keeps a counter's name without `_total`
            name = value._name
            if not name.startswith("lorabus_"):
                continue
            out[name] = Metric(name, str(value._type), tuple(value._labelnames), value._documentation, module_name)
    return sorted(out.values(), key=lambda m: m.name)


def series_names() -> set[str]:
    return {s for metric in catalog() for s in metric.series}


def markdown(metrics: list[Metric]) -> str:
    lines = [
        "# Metrics",
        "",
        "Every lorabus service serves Prometheus metrics on `/metrics` (port `metrics.port`; in",
        "docker-compose 9101 registry, 9102 trainer, 9103 exporter, 9104/9105 rollout sidecars).",
        "Names follow `lorabus_<service>_<thing>_<unit>`. Counters are exposed with `_total`,",
        "histograms as `_bucket`/`_sum`/`_count`. The Grafana dashboards in",
        "`deploy/grafana/dashboards/` use only these names (tests/deploy checks it).",
        "",
        "A fleet's processes serve several runs, so every series about one run carries a `run`",
        "label (the Grafana dashboards' `run` variable filters on it). These are not about one run:",
        "",
        *[f"- `{name}`: {why}" for name, why in sorted(NOT_PER_RUN.items())],
        "",
        "Generated from the code by `python deploy/metrics_catalog.py`; do not edit by hand.",
        "",
        "| metric | type | labels | service | meaning |",
        "|---|---|---|---|---|",
    ]
    for m in metrics:
        labels = ", ".join(f"`{label}`" for label in m.labels) or "-"
        meaning = " ".join(m.help.split()).replace("|", "\\|")
        lines.append(f"| `{m.shown}` | {m.type} | {labels} | {m.service} | {meaning} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="fail if docs/metrics.md is out of date")
    args = p.parse_args(argv)
    metrics = catalog()
    text = markdown(metrics)
    if args.check:
        if not DOC.is_file() or DOC.read_text() != text:
            print(f"{DOC} is out of date: run python deploy/metrics_catalog.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC} ({len(metrics)} metrics)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
