"""Issue 30, a slow, silent or overloaded S3 (an `S3Proxy` in front of the real S3 test server):
a store seconds per request away is served; a silent one is a `StoreError` naming
store.endpoint and the fix within the store's bounds; a transient answer (503 SlowDown) is tried
again with backoff and a final one names its code; an answer that cannot change (bad keys) is
not tried again."""

from __future__ import annotations

import os
import time

import pytest

from services.common.store import S3Store, StoreError, open_store
from services.common.store.s3 import ATTEMPTS
from services.config.schema import StoreConfig
from tests.fixtures.s3 import S3Proxy

ADAPTER = os.urandom(1 << 20)


def through(proxy: S3Proxy, cfg: StoreConfig, **kwargs) -> S3Store:
    """The test's bucket (made directly), then a store reaching it only through `proxy`, its
    region given so that each store call is one request (no region lookup first)."""
    open_store(cfg)
    fields = {f: getattr(cfg, f) for f in cfg.__struct_fields__}
    return S3Store.from_config(
        StoreConfig(**{**fields, "endpoint": proxy.endpoint, "region": "us-east-1"}), create_bucket=False, **kwargs
    )


def test_a_store_seconds_per_request_away_is_waited_for(s3_proxy: S3Proxy, s3_store_config: StoreConfig) -> None:
    store = through(s3_proxy, s3_store_config, read_timeout_s=5.0)
    s3_proxy.delay_s = 1.5
    started = time.monotonic()
    ref = store.put_bytes("run/adapters/v1/adapter_model.safetensors", ADAPTER)
    assert store.get_bytes(ref.uri, sha256=ref.sha256, size=ref.bytes) == ADAPTER
    assert s3_proxy.requests == 2 and time.monotonic() - started >= 3.0, s3_proxy.requests


def test_a_silent_store_is_an_error_naming_the_endpoint_within_its_bounds(
    s3_proxy: S3Proxy, s3_store_config: StoreConfig
) -> None:
    store = through(s3_proxy, s3_store_config, read_timeout_s=0.5)
    s3_proxy.stall = True
    started = time.monotonic()
    with pytest.raises(StoreError) as caught:
        store.get_bytes(store.uri_for("run/adapters/v1/adapter_model.safetensors"))
    took = time.monotonic() - started
    message = str(caught.value)
    assert message.startswith(f"store.endpoint: {s3_proxy.endpoint} did not answer s3://"), message
    assert f"tried {ATTEMPTS} times over 10 s to connect, 0.5 s per read" in message
    assert "check that the S3 server is up and reachable from here" in message
    # four reads of 0.5 s and pauses of 0, 1 and 2 s between them (minio alone: 6 x 300 s)
    assert s3_proxy.requests == ATTEMPTS and 5.0 <= took < 15.0, (s3_proxy.requests, took)


def test_transient_answers_are_tried_again_and_lasting_ones_are_not(
    s3_proxy: S3Proxy, s3_store_config: StoreConfig
) -> None:
    store = through(s3_proxy, s3_store_config)
    s3_proxy.unavailable = ATTEMPTS - 1
    ref = store.put_bytes("run/adapters/v1/adapter_model.safetensors", ADAPTER)
    assert s3_proxy.requests == ATTEMPTS
    assert store.get_bytes(ref.uri, sha256=ref.sha256) == ADAPTER

    s3_proxy.requests, s3_proxy.unavailable = 0, ATTEMPTS
    with pytest.raises(StoreError, match=rf"S3 error SlowDown \(answered {ATTEMPTS} times\): Please reduce"):
        store.get_bytes(ref.uri)
    assert s3_proxy.requests == ATTEMPTS

    s3_proxy.requests, s3_proxy.unavailable = 0, 0
    wrong = S3Store(
        store.bucket, store.prefix, endpoint=s3_proxy.endpoint, access_key=os.environ[s3_store_config.access_key_env],
        secret_key="not-the-secret", region="us-east-1", create_bucket=False,
    )  # fmt: skip
    with pytest.raises(StoreError, match="S3 error") as caught:
        wrong.get_bytes(ref.uri)
    assert "answered" not in str(caught.value) and s3_proxy.requests == 1, (str(caught.value), s3_proxy.requests)
