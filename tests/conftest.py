"""Shared fixtures (a real nats-server, a real S3 server) and the test tiers.

A test's tier is the folder it lives in: `unit`, `integration`, `deploy`, `e2e` or `chaos`, each a
marker (`pytest -m unit` is `make test-fast`). Deploy, e2e and chaos tests are also `slow`. A test file placed
directly under tests/ would get no tier, so none is.

`make test` runs on two pytest-xdist workers, a test module at a time (`--dist loadfile`), the
modules handed out in `testpaths` order (unit first): a module's fixtures (an interpreter child,
a Megatron model, a vLLM CPU server) are built once, not once per worker. The whole suite took
18.6 min here that way against about 22.5 min one test at a time (2 cores), with the deployment tiers
sharing the machine two at a time: their waits are gated on the run's state, not on the clock.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures.nats import *  # noqa: F403
from tests.fixtures.s3 import *  # noqa: F403

TESTS = Path(__file__).resolve().parent
TIERS = ("unit", "integration", "deploy", "e2e", "chaos")
SLOW_TIERS = ("deploy", "e2e", "chaos")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        tier = Path(item.path).resolve().relative_to(TESTS).parts[0]
        if tier in TIERS:
            item.add_marker(tier)
            if tier in SLOW_TIERS:
                item.add_marker("slow")
