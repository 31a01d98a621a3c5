"""Start a real nats-server with a copy of `deploy/nats/nats.conf` (helpers for the deploy tests).

The copy differs from the deployed file in one line: `store_dir` is dropped, because
`start_nats_server` passes `-sd` and nats-server refuses a store dir given twice. Ports need
no rewriting: the helper's `-p`/`-m` flags win over `listen`/`http`.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from services.local.nats_server import NatsServer, start_nats_server

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


def start_with_deploy_config(tmp: Path, env: dict[str, str], tls_conf: Path | None = None) -> NatsServer:
    """`env` must hold every password variable (the caller sets it in os.environ too: the
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
    return start_nats_server(tmp / "nats-store", config_file=conf_dir / "nats.conf")
