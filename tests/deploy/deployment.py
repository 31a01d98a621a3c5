"""What the compose-up tests read from a running deployment, as its operator would from the host:
the bus as the `operator` NATS user, the bucket with the S3 keys, Prometheus' HTTP API, and
the project's containers."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from minio import Minio

from services.common.config import load_config
from services.common.config_schema import LorabusConfig
from services.local.launcher import Progress
from tests.deploy.compose import DEPLOY, Project
from tests.fixtures.waiting import wait_until


def operator_config(env: dict[str, str], monkeypatch: pytest.MonkeyPatch, bus_host: str = "127.0.0.1") -> LorabusConfig:
    """The run's config as the operator sees it from the host."""
    monkeypatch.setenv("NATS_OPERATOR_PASSWORD", env["NATS_OPERATOR_PASSWORD"])
    return load_config(
        DEPLOY / "lorabus.cpu.yaml",
        overrides=[
            f"bus.url=nats://{bus_host}:{env['NATS_PORT']}",
            "bus.user=operator",
            "bus.password_env=NATS_OPERATOR_PASSWORD",
            "bus.connect_timeout_s=30",
            f"total_train_steps={env['LORABUS_CPU_TOTAL_STEPS']}",
            f"trial_name={env['LORABUS_TRIAL']}",
        ],
    )


def exported_versions(env: dict[str, str], run: str, s3_host: str = "127.0.0.1") -> dict[int, set[str]]:
    """version -> file names under the bucket's export/<run>/v<N>/, read from S3 itself."""
    client = Minio(
        f"{s3_host}:{env['S3_PORT']}",
        access_key=env["MINIO_ROOT_USER"],
        secret_key=env["MINIO_ROOT_PASSWORD"],
        secure=False,
    )
    found: dict[int, set[str]] = {}
    for obj in client.list_objects(env["MINIO_BUCKET"], prefix=f"export/{run}/", recursive=True):
        version, _, name = obj.object_name.removeprefix(f"export/{run}/").partition("/")
        if version.startswith("v") and version[1:].isdigit():
            found.setdefault(int(version[1:]), set()).add(name)
    return found


def scraped(prometheus_url: str) -> set[str]:
    """`host:port` of every target of job `lorabus` that Prometheus scraped successfully at least
    once (the trainer's is gone once it has finished)."""
    query = 'max_over_time(up{job="lorabus"}[1h])'
    result = httpx.get(f"{prometheus_url}/api/v1/query", params={"query": query}, timeout=10).json()
    return {r["metric"]["instance"] for r in result["data"]["result"] if r["value"][1] == "1"}


async def wait_for_scrape(prometheus_url: str, targets: set[str], timeout_s: float = 300) -> None:
    def missing() -> set[str]:
        try:
            return targets - scraped(prometheus_url)
        except httpx.HTTPError:  # Prometheus still starting
            return targets

    await wait_until(lambda: not missing(), timeout_s, lambda: f"Prometheus to scrape {sorted(missing())}", 2.0)


async def wait_for_end(project: Project, progress: Progress, steps: int, timeout_s: float, evaluated: bool) -> dict:
    """Until the trainer's container has exited and the last version is exported (and
    evaluated); returns the trainer's container state."""

    async def done() -> dict:
        trainer = (await asyncio.to_thread(project.containers)).get("trainer", {})
        if trainer.get("State") != "exited":
            return {}
        if trainer.get("ExitCode") != 0:
            raise AssertionError(f"trainer exited {trainer.get('ExitCode')}:\n{project.logs('trainer')}")
        if steps in progress.exported and (not evaluated or steps in progress.evals):
            return trainer
        return {}

    def what() -> str:
        return f"the run to finish ({progress.line()}); logs:\n{project.logs(tail=15)}"

    return await wait_until(done, timeout_s, what, interval=3.0)
