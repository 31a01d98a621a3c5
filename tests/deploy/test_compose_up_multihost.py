"""The role files (deploy/roles/) run one job over two "hosts": two compose projects on one engine,
each on its own network, joined only where the role files say.

- project "control": roles/control.yml (NATS, S3, registry, exporter, Prometheus);
- project "workers": roles/trainer.yml + roles/rollout.yml with the `cpu` profile (the trainer
  and two embedded-engine replicas).
Both take their services from docker-compose.cpu.yml (LORABUS_ROLES_BASE), as GPU hosts take
them from docker-compose.yml. The "LAN" between the hosts is the engine's default bridge address
(docker0): control publishes NATS and S3 there, the workers publish their metrics ports there,
and the workers' .env names it as LORABUS_CONTROL_HOST. Nothing else connects the projects: a
worker container cannot even resolve the control project's service names.

Asserted: the trainer exits 0 after STEPS steps, every version is in the control host's bucket,
both replicas of the other project generated for the run (they loaded the head and trajectories
were accepted), the control host's Prometheus scraped the workers through its target files, and
`down -v` of both projects leaves nothing behind. The held-out rise is test_compose_up's.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import uuid

import pytest

from services.local.ports import free_ports
from tests.deploy.compose import ROLES, Project, env_file_with_fresh_secrets
from tests.deploy.deployment import (
    exported_versions,
    observe,
    operator_config,
    tear_down,
    wait_for_end,
    wait_for_scrape,
)

STEPS = 8
# the workers' metrics ports (trainer, rollout-cpu-0, rollout-cpu-1), published on the "LAN"
WORKER_METRICS = (9102, 9107, 9108)

pytestmark = [
    pytest.mark.timeout(1800),
]


def bridge_gateway() -> str:
    """The host's address on the engine's default bridge (docker0): every container reaches it,
    nothing outside this machine does."""
    bridge = subprocess.run(
        ["docker", "network", "inspect", "bridge", "--format", '{{index .Options "com.docker.network.bridge.name"}}'],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout.strip()
    addr = subprocess.run(["ip", "-4", "-o", "addr", "show", "dev", bridge], capture_output=True, text=True, timeout=30)
    match = re.search(r"inet (\d+\.\d+\.\d+\.\d+)/", addr.stdout)
    assert match, f"no IPv4 address on the engine's bridge {bridge!r}: {addr.stdout}{addr.stderr}"
    return match.group(1)


def networks_of(project: Project) -> dict[str, set[str]]:
    """service -> the networks its container is attached to."""
    found = {}
    for service, row in project.containers().items():
        out = subprocess.run(
            ["docker", "inspect", "--format", "{{json .NetworkSettings.Networks}}", row["ID"]],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        )
        found[service] = set(json.loads(out.stdout))
    return found


async def test_roles_run_one_job_over_two_projects(tmp_path, monkeypatch, cpu_images):
    lan = bridge_gateway()
    nats_port, s3_port, prometheus_port = free_ports(3)
    hosts = tmp_path / "prometheus-hosts"
    hosts.mkdir()
    # the worker host's metrics, as its operator would list them for the control host
    (hosts / "workers.json").write_text(
        json.dumps(
            [
                {"targets": [f"{lan}:{WORKER_METRICS[0]}"], "labels": {"component": "trainer"}},
                {"targets": [f"{lan}:{p}" for p in WORKER_METRICS[1:]], "labels": {"component": "rollout"}},
            ]
        )
    )
    env = env_file_with_fresh_secrets(
        tmp_path / ".env",
        NATS_PORT=nats_port,
        S3_PORT=s3_port,
        PROMETHEUS_PORT=prometheus_port,
        LORABUS_CPU_TOTAL_STEPS=STEPS,
        LORABUS_TRIAL=f"t{uuid.uuid4().hex[:6]}",
        LORABUS_CONTROL_HOST=lan,
        LORABUS_PUBLISH_ADDR=lan,
        LORABUS_PROMETHEUS_HOSTS=hosts,
    )
    tag = uuid.uuid4().hex[:8]
    roles_base = {"LORABUS_ROLES_BASE": "../docker-compose.cpu.yml"}
    control = Project(f"lorabus-control-{tag}", [ROLES / "control.yml"], tmp_path / ".env", roles_base)
    workers = Project(
        f"lorabus-workers-{tag}",
        [ROLES / "trainer.yml", ROLES / "rollout.yml"],
        tmp_path / ".env",
        roles_base,
        profiles=("cpu",),
    )
    cfg = operator_config(env, monkeypatch, bus_host=lan)
    bus = None
    try:
        await asyncio.to_thread(control.up)
        bus, seen = await observe(cfg)
        # the trainer first: until the rollouts deliver it waits at v0, so the control host's
        # Prometheus sees it before it finishes
        prometheus = f"http://127.0.0.1:{prometheus_port}"
        await asyncio.to_thread(workers.up, "trainer", wait=False)
        await wait_for_scrape(prometheus, {f"{lan}:{WORKER_METRICS[0]}"})
        await asyncio.to_thread(workers.up, wait=False)

        control_nets, worker_nets = networks_of(control), networks_of(workers)
        assert set(worker_nets) == {"trainer", "rollout-cpu-0", "rollout-cpu-1"}, worker_nets
        shared = set().union(*control_nets.values()) & set().union(*worker_nets.values())
        assert not shared, f"the projects share networks {shared}"
        resolve = workers.run(
            "exec", "-T", "trainer", "python", "-c", "import socket; socket.gethostbyname('nats')", check=False
        )
        assert resolve.returncode != 0, "a worker resolved the control project's `nats`"

        await wait_for_end(workers, seen, STEPS, 900, evaluated=False)
        print(seen.line())
        exported = await asyncio.to_thread(exported_versions, env, cfg.run, lan)
        assert all(
            {"adapter_config.json", "adapter_model.safetensors"} <= exported.get(v, set()) for v in range(STEPS + 1)
        ), exported
        assert {"cpu-0", "cpu-1"} <= set(seen.loaded), seen.loaded
        assert seen.verdicts.get("accepted", 0) >= STEPS * cfg.rollout.consumer_batch_size

        # the trainer's scrape is already in (above); the others are still up, and on a loaded
        # machine one of them may not have had its first successful scrape yet
        wanted = {f"{lan}:{port}" for port in WORKER_METRICS} | {"registry:9101", "exporter:9103"}
        await wait_for_scrape(prometheus, wanted, timeout_s=60)
    finally:
        left = await tear_down(bus, [workers, control], tmp_path)
    assert not left, f"`down -v` left {left}"
