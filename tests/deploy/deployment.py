"""What the compose-up tests read from a running deployment, as its operator would from the host:
the bus as the `operator` NATS user, the bucket with the S3 keys, Prometheus' HTTP API, and
the project's containers."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from minio import Minio

from proto import messages as m
from proto import subjects
from services.common.bus import Bus, MsgMeta
from services.config.loader import load_config
from services.config.schema import LorabusConfig
from tests.deploy.compose import DEPLOY, Project
from tests.fixtures.waiting import wait_until


@dataclass
class Observed:
    """The run's events as the operator sees them live."""

    exported: dict[int, str] = field(default_factory=dict)
    """version -> the export's URI"""
    evals: dict[int, float] = field(default_factory=dict)
    verdicts: dict[str, int] = field(default_factory=dict)
    max_accepted_staleness: int = 0
    loaded: dict[str, int] = field(default_factory=dict)
    """replica -> the newest version it loaded"""
    steps: int = 0

    def line(self) -> str:
        return (
            f"{self.steps} steps, exported {sorted(self.exported)}, evaluated {sorted(self.evals)}, "
            f"verdicts {self.verdicts}, loaded {self.loaded}"
        )


async def observe(cfg: LorabusConfig) -> tuple[Bus, Observed]:
    """Core subscriptions (the operator may not create consumers): start before the run does."""
    bus = await Bus.connect(cfg.bus, run=cfg.run, service="operator")
    seen = Observed()

    async def on_export(msg: m.ExportDone, _meta: MsgMeta) -> None:
        seen.exported[msg.version] = msg.uri

    async def on_eval(msg: m.EvalResult, _meta: MsgMeta) -> None:
        seen.evals[msg.version] = msg.score

    async def on_step(_msg: m.TrainerStep, _meta: MsgMeta) -> None:
        seen.steps += 1

    async def on_decision(msg: m.TrajectoryDecision, _meta: MsgMeta) -> None:
        seen.verdicts[msg.verdict] = seen.verdicts.get(msg.verdict, 0) + 1
        if msg.verdict == "accepted" and msg.oldest_version is not None:
            seen.max_accepted_staleness = max(seen.max_accepted_staleness, msg.head_version - msg.oldest_version)

    async def on_report(msg: m.RolloutReport, _meta: MsgMeta) -> None:
        if isinstance(msg, m.AdapterLoaded):
            seen.loaded[msg.replica] = max(seen.loaded.get(msg.replica, -1), msg.version)

    run = cfg.run
    await bus.subscribe(subjects.export_done_all(run), m.ExportDone, on_export)
    await bus.subscribe(subjects.eval_result_all(run), m.EvalResult, on_eval)
    await bus.subscribe(subjects.trainer_step(run), m.TrainerStep, on_step)
    await bus.subscribe(subjects.decision_all(run), m.TrajectoryDecision, on_decision)
    await bus.subscribe(subjects.rollout_report_all(run), m.RolloutReport, on_report)
    return bus, seen


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


async def wait_for_end(project: Project, seen: Observed, steps: int, timeout_s: float, evaluated: bool) -> dict:
    """Until the trainer's container has exited and the last version is exported (and
    evaluated); returns the trainer's container state."""

    async def done() -> dict:
        trainer = (await asyncio.to_thread(project.containers)).get("trainer", {})
        if trainer.get("State") != "exited":
            return {}
        if trainer.get("ExitCode") != 0:
            raise AssertionError(f"trainer exited {trainer.get('ExitCode')}:\n{project.logs('trainer')}")
        if steps in seen.exported and (not evaluated or steps in seen.evals):
            return trainer
        return {}

    def what() -> str:
        return f"the run to finish ({seen.line()}); logs:\n{project.logs(tail=15)}"

    return await wait_until(done, timeout_s, what, interval=3.0)


async def tear_down(bus: Bus | None, projects: list[Project], log_dir: Path) -> dict[str, str]:
    """Close the operator's connection and bring every project down with its volumes, whatever
    fails on the way; their logs are kept in `log_dir`. Returns project -> what its engine still
    holds (empty lists: nothing) and the `down` command's errors where something stayed."""
    if bus is not None:
        try:
            await asyncio.wait_for(bus.close(), 30)
        except Exception as exc:  # the projects go down regardless
            print(f"closing the operator's bus: {exc!r}")
    problems = {}
    for project in projects:
        (log_dir / f"{project.name}.log").write_text(project.logs(tail=400))
        down = await asyncio.to_thread(project.down)
        left = project.leftovers()
        if any(left.values()):
            problems[project.name] = f"{left}\n{down.stderr[-3000:]}"
    return problems
