"""A real Prometheus scrapes a whole local deployment (`lorabus up`) and finds the key series.

The launcher gives every service a fixed metrics port and writes them as a file_sd target list;
Prometheus follows that file. Queries use `max_over_time` because once the run has stopped its
targets go down and Prometheus marks their series stale.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest
import yaml

from services.local.ports import free_port
from tests.e2e.test_up import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
STEPS = 10

# series a dashboard cannot do without, one per service, and a value each must have reached in
# a scrape. Versions move every ~0.3 s here and a service exits right after its last change, so
# the bar is "seen progressing", not "seen at the final version".
KEY_SERIES = {
    "lorabus_registry_head_version": 2,
    "lorabus_trainer_version": 1,
    "lorabus_exporter_last_version": 1,
    'lorabus_rollout_loaded_version{process="rollout-0"}': 1,
    'lorabus_rollout_loaded_version{process="rollout-1"}': 1,
    "lorabus_eval_version": 1,
    "lorabus_eval_score": 0.0,
    'sum(lorabus_registry_trajectories_total{verdict="accepted"})': 8,
    "sum(lorabus_rollout_tokens_total)": 1,
    "sum(lorabus_trainer_steps_total)": 1,
    "sum(lorabus_bus_messages_total)": 1,
}


def query_max(prom_port: int, series: str) -> float | None:
    promql = f"max(max_over_time(({series})[10m:1s]))"
    url = f"http://127.0.0.1:{prom_port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=5) as resp:
        body = json.load(resp)
    result = body["data"]["result"]
    return float(result[0]["value"][1]) if result else None


def test_prometheus_scrapes_a_running_local_deployment(tmp_path):
    if not shutil.which("prometheus"):
        pytest.fail("prometheus missing: `make prometheus` (apt-get install prometheus) installs it")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    targets = run_dir / "prometheus_targets.json"
    targets.write_text("[]")
    prom_config = tmp_path / "prometheus.yml"
    prom_config.write_text(
        yaml.safe_dump(
            {
                "global": {"scrape_interval": "1s"},
                "scrape_configs": [
                    {
                        "job_name": "lorabus",
                        "file_sd_configs": [{"files": [str(targets)], "refresh_interval": "1s"}],
                    }
                ],
            }
        )
    )
    prom_port = free_port()
    prom = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={prom_config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{prom_port}",
        ],
        stdout=open(tmp_path / "prometheus.log", "wb"),
        stderr=subprocess.STDOUT,
    )
    try:
        up = subprocess.run(
            [
                sys.executable,
                "-m",
                "services.local.launcher",
                "--config",
                "examples/tiny.yaml",
                "--timeout",
                "240",
                f"run_dir={run_dir}",
                f"total_train_steps={STEPS}",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=280,
        )
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        time.sleep(2)  # the last samples before the services stopped
        found = {series: query_max(prom_port, series) for series in KEY_SERIES}
        missing = {s: v for s, v in found.items() if v is None or v < KEY_SERIES[s]}
        assert not missing, f"series missing or short of their value: {missing}\nall: {found}"
    finally:
        prom.terminate()
        prom.wait(timeout=15)
