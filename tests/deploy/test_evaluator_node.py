"""The Node evaluator example (examples/evaluator_node) against a real nats-server running the
deploy auth config, logged in as the read-only `watcher`: it prints a real AdapterReady as
valid and a malformed one as invalid (its schema check is real)."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import uuid

import pytest

from proto import codec, subjects
from services.common.bus import Bus
from services.config.schema import BusConfig
from tests.deploy.natsauth import REPO, password_vars, start_with_deploy_config
from tests.deploy.test_nats_permissions import adapter_event

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

EXAMPLE = REPO / "examples" / "evaluator_node"


@pytest.fixture(scope="session")
def node_example(tmp_path_factory):
    """The example copied to a temp dir with its pinned dependencies installed (npm's own
    cache makes a second run offline-safe)."""
    if not (shutil.which("node") and shutil.which("npm")):
        pytest.fail("node and npm are needed for the second-language evaluator example")
    work = tmp_path_factory.mktemp("evaluator-node")
    for name in ("package.json", "evaluator.mjs"):
        shutil.copy(EXAMPLE / name, work / name)
    result = subprocess.run(
        ["npm", "install", "--no-audit", "--no-fund", "--prefer-offline", "--ignore-scripts"],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return work


async def read_line(proc: asyncio.subprocess.Process, timeout: float = 20.0) -> str:
    line = await asyncio.wait_for(proc.stdout.readline(), timeout)
    if not line:
        err = await proc.stderr.read()
        raise AssertionError(f"evaluator exited: {err.decode()[-2000:]}")
    return line.decode().strip()


async def test_node_evaluator_validates_real_events(node_example, tmp_path, monkeypatch):
    passwords = {var: uuid.uuid4().hex for var in password_vars()}
    for var, value in passwords.items():
        monkeypatch.setenv(var, value)
    server = start_with_deploy_config(tmp_path, passwords)
    run = f"node{uuid.uuid4().hex[:8]}"
    env = dict(
        os.environ,
        NATS_URL=server.url,
        NATS_USER="watcher",
        NATS_PASSWORD=passwords["NATS_WATCHER_PASSWORD"],
        LORABUS_RUN=run,
        LORABUS_SCHEMA_DIR=str(REPO / "proto" / "schema"),
    )
    proc = await asyncio.create_subprocess_exec(
        "node",
        "evaluator.mjs",
        cwd=node_example,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    trainer = None
    try:
        assert await read_line(proc) == "ready"
        # the registry creates a run's streams (no other role may)
        registry = await Bus.connect(
            BusConfig(url=server.url, user="registry", password=passwords["NATS_REGISTRY_PASSWORD"]),
            run=run,
            service="registry",
        )
        await registry.ensure_streams()
        await registry.close()
        trainer = await Bus.connect(
            BusConfig(url=server.url, user="trainer", password=passwords["NATS_TRAINER_PASSWORD"]),
            run=run,
            service="trainer",
        )
        await trainer.publish(subjects.adapter_ready(run, 4), adapter_event(run, 4), msg_id=f"{run}-v4")
        line = await read_line(proc)
        assert line == f"{subjects.adapter_ready(run, 4)} v4 valid", line

        # the same event with a broken field: the schema check must say so
        broken = codec.encode(adapter_event(run, 5)).replace(b'"rank":8', b'"rank":0')
        await trainer.nc.publish(subjects.adapter_ready(run, 5), broken)
        line = await read_line(proc)
        assert line.startswith(f"{subjects.adapter_ready(run, 5)} v5 INVALID") and "rank" in line, line
    finally:
        if trainer is not None:
            await trainer.close()
        proc.terminate()
        await proc.wait()
        server.close()
