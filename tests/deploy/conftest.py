"""Fixtures of the deploy tier that need a Docker engine: the engine itself and the images."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.deploy.compose import CPU_COMPOSE_FILE, ENV_EXAMPLE
from tests.deploy.engine import EngineError, ensure_engine


@pytest.fixture(scope="session")
def docker_engine(tmp_path_factory) -> Iterator[str]:
    """A running engine (started here if none runs, stopped after); yields its storage driver."""
    try:
        engine = ensure_engine(tmp_path_factory.mktemp("dockerd"))
    except EngineError as exc:
        pytest.fail(str(exc))
    yield engine.storage_driver
    engine.stop()


@pytest.fixture(scope="session")
def cpu_images(docker_engine) -> float:
    """Every image of docker-compose.cpu.yml (and so of the role files), built by
    deploy/localimages.py as a user without Docker Hub would; returns the seconds it took."""
    from localimages import LocalImagesError, build  # on sys.path through tests.deploy.compose

    try:
        seconds = build([CPU_COMPOSE_FILE], ENV_EXAMPLE)
    except LocalImagesError as exc:
        pytest.fail(str(exc))
    print(f"\nlocalimages: built in {seconds:.0f} s")
    return seconds
