"""Issue 30, the exporter on a real full or read-only export disk: a tmpfs too small for the
adapter, or one mounted read-only, over the export directory in a private mount namespace
(`unshare --mount --map-root-user`: no root, no host mount), with a real nats-server.

The exporter stops with exit status 1 and one line naming the version, the directory, the cause
and the fix; the refused event is not acked or dead-lettered, so once the disk is fixed a
restarted exporter exports every version, each once."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from proto import subjects
from proto.messages import AdapterReady, LoraSpec, ObjectPayload
from services.common import adapter_io, streams
from services.common.bus import Bus
from services.common.store import open_store
from services.config.schema import BusConfig, StoreConfig
from tests.fixtures.service_process import ServiceProcess
from tests.fixtures.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
WEIGHTS = {
    "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(4, 2048),
    "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(2048, 4),
}
"""64 KiB of weights: more than the full disk's 16 KiB"""


def unshare_or_skip() -> str:
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("needs unshare (util-linux) to mount a small tmpfs in a private namespace")
    probe = subprocess.run([unshare, "--mount", "--map-root-user", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"needs user namespaces to mount a small tmpfs: {probe.stderr.strip()}")
    return unshare


def exporter_on(unshare: str, config: Path, export: Path, mount_options: str) -> subprocess.CompletedProcess:
    """The exporter with a tmpfs mounted (`mount_options`) over `export`, seen only by it."""
    script = f'mount -t tmpfs -o {mount_options} tmpfs "$1" && exec "$2" -m services.exporter --config "$3"'
    return subprocess.run(
        [unshare, "--mount", "--map-root-user", "sh", "-c", script, "sh", str(export), sys.executable, str(config)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


async def test_a_full_or_read_only_export_disk_stops_the_exporter_and_loses_no_version(tmp_path, nats_url):
    unshare = unshare_or_skip()
    run = f"exf{uuid.uuid4().hex[:8]}"
    export = tmp_path / "export"
    export.mkdir()
    store_cfg = StoreConfig(uri=f"file://{tmp_path}/store")
    config = tmp_path / "exporter.yaml"
    config.write_text(f"""
run: {run}
bus: {{url: "{nats_url}"}}
store: {{uri: "{store_cfg.uri}"}}
metrics: {{host: 127.0.0.1, port: 0}}
actor: {{path: "{tmp_path}/base"}}
train_dataset: {{path: "builtin:arith"}}
exporter: {{uri: "file://{export}"}}
""")
    bus = await Bus.connect(BusConfig(url=nats_url), run=run, service="tester")
    await bus.ensure_streams()
    store = open_store(store_cfg)
    lora = LoraSpec(rank=4, alpha=8.0, target_modules=["q_proj"], base_model="tiny")
    weights = adapter_io.to_bytes(WEIGHTS)
    try:

        async def publish(version: int) -> None:
            ref = store.put_bytes(f"{run}/adapters/v{version}/adapter_model.safetensors", weights)
            payload = ObjectPayload(uri=ref.uri, bytes=ref.bytes, sha256=ref.sha256, layout="hf-peft")
            event = AdapterReady(
                run=run, trainer_epoch="e0", lora_name="l", version=version, trainer_step=version,
                created_at=time.time(), lora=lora, payloads=[payload],
            )  # fmt: skip
            await bus.publish(subjects.adapter_ready(run, version), event, msg_id=f"adapter-v{version}")

        # v0 refused by a read-only disk, then v1 by a full one (v0, not acked, comes back to
        # the durable's next reader after ack_wait: the full disk's exporter is handed v1 first)
        await publish(0)
        read_only = await asyncio.to_thread(exporter_on, unshare, config, export, "ro,size=1m")
        await publish(1)
        full = await asyncio.to_thread(exporter_on, unshare, config, export, "size=16k")
        for done, version, code, fix in (
            (read_only, 0, "EROFS", "remount it read-write or point exporter.uri at a writable directory"),
            (full, 1, "ENOSPC", "free space there or point exporter.uri at a larger disk"),
        ):
            assert done.returncode == 1, (code, done.stderr[-3000:])
            line = done.stderr.strip().splitlines()[-1]
            stopped = f"lorabus exporter: exporter stopped at v{version}: exporter.uri: {export}/v{version} "
            assert line.startswith(stopped), line
            assert f"({code}, exporting v{version}); {fix}" in line, line
            assert f"(v{version} and later stay in the exporter's durable and are exported when it restarts)" in line
        assert not any(export.iterdir()), "the refused writes left something in the real directory"

        # the disk fixed (no tmpfs over the directory): both versions exported, none lost
        proc = ServiceProcess("services.exporter", config, tmp_path / "exporter.log")
        proc.start()
        try:

            async def exported() -> bool:
                assert proc.alive(), proc.log_text()[-3000:]
                return all((export / f"v{v}" / adapter_io.WEIGHTS_NAME).is_file() for v in (0, 1))

            await wait_until(exported, 60, lambda: f"v0 and v1 exported:\n{proc.log_text()[-3000:]}")
        finally:
            proc.stop()
        assert proc.proc is not None and proc.proc.returncode == 0, proc.log_text()[-3000:]
        for v in (0, 1):
            assert (export / f"v{v}" / adapter_io.WEIGHTS_NAME).read_bytes() == weights
        info = await bus.js.stream_info(streams.DEADLETTER(run))
        assert info.state.messages == 0, "a refused export was dead-lettered"
    finally:
        await bus.close()
