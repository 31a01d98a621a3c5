"""A real Prometheus scrapes a running registry (own process, logged in to a nats-server that
runs the deploy auth config) and its HTTP API returns the series the dashboards read."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import uuid

import pytest
import yaml

from proto import subjects
from services.common.bus import Bus
from services.config.schema import BusConfig
from services.local.ports import free_port
from tests.deploy.natsauth import REPO, password_vars, start_with_deploy_config
from tests.deploy.test_nats_permissions import adapter_event
from tests.fixtures.waiting import until

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]


def query(prom_port: int, promql: str) -> list[dict]:
    url = f"http://127.0.0.1:{prom_port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=5) as resp:
        body = json.load(resp)
    assert body["status"] == "success", body
    return body["data"]["result"]


def wait_for_series(prom_port: int, promql: str, predicate, timeout: float = 40.0) -> list[dict]:
    def series() -> list[dict] | None:
        try:
            result = query(prom_port, promql)
        except OSError:
            return None  # Prometheus still starting
        return result if result and predicate(result) else None

    return until(series, timeout, f"{promql} in Prometheus", interval=0.5)


@pytest.fixture
def stack(tmp_path):
    if not shutil.which("prometheus"):
        pytest.fail("prometheus missing: `make prometheus` (apt-get install prometheus) installs it")
    passwords = {var: uuid.uuid4().hex for var in password_vars()}
    old = {k: os.environ.get(k) for k in passwords}
    os.environ.update(passwords)
    procs: list[subprocess.Popen] = []
    server = start_with_deploy_config(tmp_path, passwords)
    try:
        run = f"prom{uuid.uuid4().hex[:8]}"
        metrics_port = free_port()
        config = tmp_path / "registry.yaml"
        config.write_text(f"""
experiment_name: {run}
trial_name: t
run: {run}
bus: {{url: "{server.url}", user: registry, password_env: NATS_REGISTRY_PASSWORD}}
actor: {{path: examples/tiny/model}}
train_dataset: {{path: "builtin:arith"}}
""")
        registry_log = open(tmp_path / "registry.log", "wb")
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "services.registry",
                    "--config",
                    str(config),
                    f"metrics.port={metrics_port}",
                    "metrics.host=127.0.0.1",
                ],
                cwd=REPO,
                stdout=registry_log,
                stderr=subprocess.STDOUT,
            )
        )
        registry_log.close()

        # the deploy scrape config, with its registry target pointed at this process
        scrape = yaml.safe_load((REPO / "deploy/prometheus/prometheus.yml").read_text())
        lorabus_job = next(j for j in scrape["scrape_configs"] if j["job_name"] == "lorabus")
        registry_target = next(s for s in lorabus_job["static_configs"] if s["targets"] == ["registry:9101"])
        registry_target["targets"] = [f"127.0.0.1:{metrics_port}"]
        scrape["global"]["scrape_interval"] = "1s"
        prom_config = tmp_path / "prometheus.yml"
        prom_config.write_text(yaml.safe_dump(scrape))
        prom_port = free_port()
        prom_log = open(tmp_path / "prometheus.log", "wb")
        procs.append(
            subprocess.Popen(
                [
                    "prometheus",
                    f"--config.file={prom_config}",
                    f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{prom_port}",
                ],
                stdout=prom_log,
                stderr=subprocess.STDOUT,
            )
        )
        prom_log.close()
        yield server, passwords, run, prom_port, tmp_path
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        server.close()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


async def test_prometheus_scrapes_the_registry(stack):
    server, passwords, run, prom_port, tmp = stack
    started = time.monotonic()
    up = await asyncio.to_thread(
        wait_for_series, prom_port, 'up{component="registry"}', lambda r: r[0]["value"][1] == "1"
    )
    first_scrape_s = time.monotonic() - started
    assert up[0]["metric"]["job"] == "lorabus"

    trainer = await Bus.connect(
        BusConfig(url=server.url, user="trainer", password=passwords["NATS_TRAINER_PASSWORD"]),
        run=run,
        service="trainer",
    )
    try:
        deadline = time.monotonic() + 20
        while True:  # the registry creates the streams shortly after it starts
            try:
                await trainer.js.stream_info(f"LORABUS_{run}_ADAPTERS")
                break
            except Exception:
                assert time.monotonic() < deadline, (tmp / "registry.log").read_text()[-3000:]
                await asyncio.sleep(0.2)
        await trainer.publish(subjects.adapter_ready(run, 3), adapter_event(run, 3), msg_id=f"{run}-v3")
    finally:
        await trainer.close()

    head = await asyncio.to_thread(
        wait_for_series, prom_port, "lorabus_registry_head_version", lambda r: r[0]["value"][1] == "3"
    )
    assert head[0]["metric"]["component"] == "registry"
    consumed = await asyncio.to_thread(
        wait_for_series,
        prom_port,
        'lorabus_bus_messages_total{service="registry",direction="consumed"}',
        lambda r: float(r[0]["value"][1]) >= 1,
    )
    assert consumed
    print(f"first scrape after {first_scrape_s:.1f}s")
