"""Start a real nats-server with a copy of `deploy/nats/nats.conf`, or three with its
`cluster.conf` (helpers for the deploy tests).

The copy differs from the deployed file in one line: `store_dir` is dropped, because
`start_nats_server` passes `-sd` and nats-server refuses a store dir given twice. Ports need
no rewriting: the helper's `-p`/`-m` flags win over `listen`/`http`.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from services.local.nats_server import NatsCluster, NatsServer, start_nats_server

REPO = Path(__file__).resolve().parents[2]
NATS_DIR = REPO / "deploy" / "nats"
NATS_CONF = NATS_DIR / "nats.conf"

_STORE_DIR = re.compile(r"^\s*store_dir:.*$", re.M)
_PASSWORD_VAR = re.compile(r"password:\s*\$([A-Z0-9_]+)")


def users() -> dict[str, str]:
    """user name -> the environment variable holding its password, as the file declares them."""
    text = NATS_CONF.read_text()
    pairs = re.findall(r"user:\s*([A-Za-z0-9_-]+)\s*\n\s*password:\s*\$([A-Z0-9_]+)", text)
    return dict(pairs)


def password_vars() -> list[str]:
    return _PASSWORD_VAR.findall(NATS_CONF.read_text())


def deploy_config(tmp: Path, env: dict[str, str], tls_conf: Path | None = None) -> Path:
    """The deployed config files copied to `tmp/nats-conf` (nats.conf without its store_dir);
    `env` must hold every password variable (the caller sets it in os.environ too: the
    server reads the variables from its own environment)."""
    missing = [v for v in password_vars() if v not in env]
    if missing:
        raise ValueError(f"env: set {missing} before starting the deploy config")
    conf_dir = tmp / "nats-conf"
    conf_dir.mkdir(parents=True, exist_ok=True)
    text = NATS_CONF.read_text()
    if not _STORE_DIR.search(text):
        raise AssertionError("deploy/nats/nats.conf: no jetstream store_dir line")
    (conf_dir / "nats.conf").write_text(_STORE_DIR.sub("", text))
    shutil.copy(tls_conf or NATS_DIR / "tls-off.conf", conf_dir / "tls.conf")
    shutil.copy(NATS_DIR / "cluster.conf", conf_dir / "cluster.conf")
    return conf_dir


def start_with_deploy_config(tmp: Path, env: dict[str, str], tls_conf: Path | None = None) -> NatsServer:
    return start_nats_server(tmp / "nats-store", config_file=deploy_config(tmp, env, tls_conf) / "nats.conf")


def start_cluster_with_deploy_config(tmp: Path, env: dict[str, str]) -> NatsCluster:
    """Three nodes on `cluster.conf` (compose profile `cluster`), on loopback: the routes and
    names come from `NatsCluster`'s flags, which take precedence over the file's cluster block
    (its hosts are compose service names)."""
    return NatsCluster(tmp / "nats-store", config_file=deploy_config(tmp, env) / "cluster.conf").start()
