"""Both object-store backends through one test set: a directory and a real S3 server."""

from __future__ import annotations

import hashlib
import os
import threading
import time

import msgspec
import pytest

from services.common.store import (
    PART_SIZE,
    LocalStore,
    ObjectNotFound,
    S3Store,
    StoreError,
    open_store,
    store_for_uri,
)
from services.config.schema import StoreConfig

BAD_KEYS = ["", "/abs/key", "a//b", "a/", "a\\b", "../x", "a/../b", "a/./b", "a/\x00b"]


@pytest.fixture(params=["local", "s3"])
def store(request):
    return request.getfixturevalue(f"{request.param}_store")


@pytest.fixture
def store_cfg(request, store, tmp_path) -> StoreConfig:
    """The config that opens `store` (what a reader service would have)."""
    if isinstance(store, S3Store):
        return request.getfixturevalue("s3_store_config")
    return StoreConfig(uri=store.uri)


def test_put_get_round_trip(store):
    data = os.urandom(1000)
    ref = store.put_bytes("run/adapters/v3/adapter_model.safetensors", data)
    assert ref.uri == store.uri_for("run/adapters/v3/adapter_model.safetensors")
    assert ref.uri.startswith(store.uri + "/")
    assert ref.bytes == 1000
    assert ref.sha256 == hashlib.sha256(data).hexdigest()
    assert store.get_bytes(ref.uri, sha256=ref.sha256, size=ref.bytes) == data
    assert store.exists("run/adapters/v3/adapter_model.safetensors")


def test_overwrite_replaces_content(store):
    store.put_bytes("k", b"old")
    ref = store.put_bytes("k", b"new!")
    assert store.get_bytes(ref.uri, sha256=ref.sha256, size=4) == b"new!"


def test_put_file_get_file_multipart(store, tmp_path):
    # one byte over a part: the S3 upload really goes in two parts
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(PART_SIZE + 1))
    ref = store.put_file("run/big.bin", src)
    assert ref.bytes == PART_SIZE + 1
    assert ref.sha256 == hashlib.sha256(src.read_bytes()).hexdigest()
    if isinstance(store, S3Store):  # a multipart ETag ends in -<number of parts>
        assert store._client.stat_object(store.bucket, "store/run/big.bin").etag.endswith("-2")
    dest = tmp_path / "out" / "big.bin"
    got = store.get_file(ref.uri, dest, sha256=ref.sha256, size=ref.bytes)
    assert got == ref
    assert dest.read_bytes() == src.read_bytes()
    assert sorted(p.name for p in dest.parent.iterdir()) == ["big.bin"]


def test_empty_object(store):
    ref = store.put_bytes("empty", b"")
    assert ref.bytes == 0
    assert store.get_bytes(ref.uri, sha256=ref.sha256, size=0) == b""


def test_sha256_mismatch_names_uri(store):
    ref = store.put_bytes("x/y", b"payload")
    wrong = hashlib.sha256(b"other").hexdigest()
    with pytest.raises(StoreError) as err:
        store.get_bytes(ref.uri, sha256=wrong, size=ref.bytes)
    assert ref.uri in str(err.value)
    assert "sha256 mismatch" in str(err.value) and wrong in str(err.value)


@pytest.mark.parametrize("delta", [-1, 1])
def test_size_mismatch_names_uri(store, delta):
    ref = store.put_bytes("x/y", b"payload")
    with pytest.raises(StoreError, match="size mismatch") as err:
        store.get_bytes(ref.uri, sha256=ref.sha256, size=ref.bytes + delta)
    assert ref.uri in str(err.value)


def test_get_file_mismatch_leaves_nothing(store, tmp_path):
    ref = store.put_bytes("x/y", b"payload")
    dest = tmp_path / "dl" / "y"
    with pytest.raises(StoreError, match="sha256 mismatch"):
        store.get_file(ref.uri, dest, sha256="0" * 64)
    assert not dest.exists()
    assert list(dest.parent.iterdir()) == []


def test_missing_object(store, tmp_path):
    uri = store.uri_for("no/such/key")
    with pytest.raises(ObjectNotFound, match="no such object") as err:
        store.get_bytes(uri)
    assert uri in str(err.value)
    with pytest.raises(ObjectNotFound):
        store.get_file(uri, tmp_path / "dest")
    assert not (tmp_path / "dest").exists()
    assert not store.exists("no/such/key")


@pytest.mark.parametrize("key", BAD_KEYS)
def test_bad_keys_rejected_with_key_named(store, key):
    with pytest.raises(StoreError) as err:
        store.put_bytes(key, b"x")
    assert repr(key) in str(err.value)
    with pytest.raises(StoreError):
        store.exists(key)


def test_uri_outside_store_rejected(store):
    ref = store.put_bytes("a", b"x")
    outside = ref.uri.replace(store.uri, store.uri + "-other")
    with pytest.raises(StoreError, match="outside this store"):
        store.get_bytes(outside)
    scheme_swapped = "file:///tmp/a" if ref.uri.startswith("s3://") else "s3://bucket/a"
    with pytest.raises(StoreError, match="outside this store"):
        store.get_bytes(scheme_swapped)
    with pytest.raises(StoreError):
        store.get_bytes(store.uri + "/../a")


def test_list_and_delete(store):
    for key in ["r/adapters/v0/w", "r/adapters/v1/w", "r/adapters/v10/w", "r/exports/v0/w", "s/x"]:
        store.put_bytes(key, key.encode())
    assert store.list() == sorted(["r/adapters/v0/w", "r/adapters/v1/w", "r/adapters/v10/w", "r/exports/v0/w", "s/x"])
    assert store.list("r/adapters/") == ["r/adapters/v0/w", "r/adapters/v1/w", "r/adapters/v10/w"]
    assert store.list("r/adapters/v1") == ["r/adapters/v1/w", "r/adapters/v10/w"]
    assert store.list("nothing/") == []
    store.delete("r/adapters/v1/w")
    assert not store.exists("r/adapters/v1/w")
    assert "r/adapters/v1/w" not in store.list("r/")
    store.delete("r/adapters/v1/w")  # idempotent, as S3 is
    with pytest.raises(StoreError, match="prefix"):
        store.list("../")


def test_store_for_uri_reads_event_uri(store, store_cfg):
    ref = store.put_bytes("run/adapters/v0/adapter_model.safetensors", b"weights")
    reader = store_for_uri(ref.uri, store_cfg)
    assert type(reader) is type(store)
    assert reader.get_bytes(ref.uri, sha256=ref.sha256, size=ref.bytes) == b"weights"


def test_store_for_uri_refuses_what_is_outside_the_runs_store(store, store_cfg, tmp_path):
    """Issue 17: an event's URI is read only inside the run's own store (local root, or bucket
    and prefix); another prefix, another bucket, `file:///etc/passwd` are refused, and
    refusing them creates nothing."""
    ref = store.put_bytes("run/w", b"weights")
    other = msgspec.structs.replace(store_cfg, uri=store_cfg.uri + "-elsewhere")
    with pytest.raises(StoreError, match="run's"):
        store_for_uri(ref.uri, other)
    if isinstance(store, S3Store):
        outside = ["s3://another-bucket/run/w", "file:///etc/passwd"]
    else:
        outside = ["file:///etc/passwd", f"{store.uri}/../../etc/passwd", "s3://lorabus/run/w"]
    for uri in outside:
        with pytest.raises(StoreError):
            store_for_uri(uri, store_cfg).get_bytes(uri)
    missing = tmp_path / "never-created"
    with pytest.raises(ObjectNotFound):  # a reader of a store that is not there yet
        store_for_uri(f"file://{missing}/x", StoreConfig(uri=f"file://{missing}")).get_bytes(f"file://{missing}/x")
    assert not missing.exists()


def test_reads_are_capped_by_the_config_not_by_the_event(store, store_cfg):
    """Issue 17: the size an event names does not set how much is read."""
    ref = store.put_bytes("run/big", b"x" * 5000)
    capped = msgspec.structs.replace(store_cfg, max_object_bytes=4096)
    reader = store_for_uri(ref.uri, capped)
    with pytest.raises(StoreError, match="max_object_bytes"):
        reader.get_bytes(ref.uri, size=2**40)  # the event's claim is refused before reading
    with pytest.raises(StoreError, match="max_object_bytes"):
        reader.get_bytes(ref.uri)  # and without one, the read stops at the cap
    assert store_for_uri(ref.uri, store_cfg).get_bytes(ref.uri, size=5000) == b"x" * 5000


# --- local only -------------------------------------------------------------------------------


def test_local_partial_write_never_visible(local_store, tmp_path):
    """While a put is half done, the final name does not exist and list() does not show it."""
    fifo = tmp_path / "source.fifo"
    os.mkfifo(fifo)
    half_written = threading.Event()
    checked = threading.Event()
    seen: dict[str, object] = {}

    def writer():
        with open(fifo, "wb") as f:
            f.write(b"a" * 4096)
            f.flush()
            half_written.set()
            checked.wait(10)
            f.write(b"b" * 4096)

    t = threading.Thread(target=writer)
    t.start()
    result: dict[str, object] = {}
    putter = threading.Thread(target=lambda: result.setdefault("ref", local_store.put_file("k/v", fifo)))
    putter.start()
    assert half_written.wait(10)
    deadline = time.monotonic() + 10  # the put has opened its temp file and is inside the copy
    while not (local_store.root / "k").is_dir() or not any((local_store.root / "k").iterdir()):
        assert time.monotonic() < deadline, "put_file never created its temp file"
        time.sleep(0.01)
    seen["exists"] = local_store.exists("k/v")
    seen["list"] = local_store.list()
    seen["files"] = sorted(p.name for p in (local_store.root / "k").iterdir())
    checked.set()
    t.join(10)
    putter.join(10)
    assert seen["exists"] is False and seen["list"] == []
    assert len(seen["files"]) == 1 and seen["files"][0] != "v"  # only the temp file
    assert result["ref"].bytes == 8192
    assert (local_store.root / "k" / "v").read_bytes() == b"a" * 4096 + b"b" * 4096
    assert sorted(p.name for p in (local_store.root / "k").iterdir()) == ["v"]


def test_local_relative_uri_resolves_to_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store = open_store(StoreConfig(uri="file://./runs/store"))
    assert isinstance(store, LocalStore)
    assert store.uri == f"file://{tmp_path.resolve()}/runs/store"
    ref = store.put_bytes("a/b", b"x")
    assert ref.uri.startswith("file:///")


# --- s3 only ----------------------------------------------------------------------------------


def test_s3_wrong_secret_key(s3_server, s3_store, s3_store_config, monkeypatch):
    monkeypatch.setenv(s3_store_config.secret_key_env, "not-the-secret")
    with pytest.raises(StoreError, match="SignatureDoesNotMatch") as err:
        open_store(s3_store_config)
    assert "not-the-secret" not in str(err.value)
    assert s3_server.admin.secret_key not in str(err.value)


def test_s3_readonly_identity_cannot_put(s3_server, s3_store, s3_store_config, monkeypatch):
    if s3_server.readonly is None:
        pytest.skip(f"{s3_server.backend} fixture has no read-only identity")
    ref = s3_store.put_bytes("run/w", b"weights")
    monkeypatch.setenv(s3_store_config.access_key_env, s3_server.readonly.access_key)
    monkeypatch.setenv(s3_store_config.secret_key_env, s3_server.readonly.secret_key)
    reader = open_store(s3_store_config)  # the bucket exists: nothing to create
    assert reader.get_bytes(ref.uri, sha256=ref.sha256, size=ref.bytes) == b"weights"
    assert reader.list("run/") == ["run/w"]
    with pytest.raises(StoreError, match="AccessDenied") as err:
        reader.put_bytes("run/w2", b"x")
    assert reader.uri_for("run/w2") in str(err.value)
    assert not s3_store.exists("run/w2")


def test_s3_missing_env_var_named(s3_store_config, monkeypatch):
    monkeypatch.delenv(s3_store_config.secret_key_env)
    with pytest.raises(StoreError, match=s3_store_config.secret_key_env):
        open_store(s3_store_config)


def test_s3_config_errors():
    with pytest.raises(StoreError, match="store.endpoint"):
        open_store(StoreConfig(uri="s3://bucket/prefix"))
    with pytest.raises(StoreError, match="bucket"):
        open_store(StoreConfig(uri="s3://Bad_Bucket/prefix", endpoint="127.0.0.1:1"))
    with pytest.raises(StoreError, match="file:// or s3://"):
        open_store(StoreConfig(uri="gs://bucket/prefix"))


def test_s3_refs_carry_no_credentials(s3_server, s3_store):
    ref = s3_store.put_bytes("k", b"x")
    text = repr(ref) + repr(s3_store) + s3_store.uri
    assert s3_server.admin.access_key not in text
    assert s3_server.admin.secret_key not in text
