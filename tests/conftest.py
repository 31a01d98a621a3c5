"""Shared fixtures: real nats-server (tests/fixtures/nats.py) and real S3 (tests/fixtures/s3.py)."""

from tests.fixtures.nats import *  # noqa: F401,F403

try:
    from tests.fixtures.s3 import *  # noqa: F401,F403
except ModuleNotFoundError as exc:  # s3.py not written yet; any other import error is real
    if exc.name != "tests.fixtures.s3":
        raise
