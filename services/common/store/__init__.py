"""The object store: where adapters and exports live, addressed by URI.

Two backends with the same methods: `LocalStore` (`file:///dir`, one machine, the embedded
default; `local.py`) and `S3Store` (`s3://bucket/prefix` on MinIO, SeaweedFS or AWS through the
`minio` client; `s3.py`). What they share (keys, the verified copy, the atomic write) is in
`objects.py`, what they raise in `errors.py`. Everything is synchronous; async services call it
with `asyncio.to_thread`.

A writer gets back an `ObjectRef` (URI, size, sha256) and puts it into an event; a reader opens
the store for that URI (`store_for_uri`) and reads it back with both checked, so a truncated or
swapped object is an error instead of a silently wrong adapter. The one exception is `read_into`,
which fills a caller's buffer unhashed (in parallel chunks, for a replica's fast load path): its
caller owns the sha256 check and must not use the bytes before it has passed. S3 credentials are
read from environment variables named in the config and never appear in URIs, events, errors or
logs. A full or read-only disk is a `StoreUnwritable` naming the directory and the fix; a slow S3
is waited for within bounds and its transient failures tried again (`s3.py`).
"""

from __future__ import annotations

from services.common.store.errors import (
    ObjectCorrupt,
    ObjectNotFound,
    OutsideStore,
    StoreError,
    StoreUnwritable,
    write_error,
)
from services.common.store.local import LocalStore
from services.common.store.objects import ObjectRef, ObjectStore, validate_key
from services.common.store.s3 import PART_SIZE, S3Store, parse_s3_uri
from services.config.schema import StoreConfig

__all__ = [
    "PART_SIZE",
    "LocalStore",
    "ObjectCorrupt",
    "ObjectNotFound",
    "ObjectRef",
    "ObjectStore",
    "OutsideStore",
    "S3Store",
    "StoreError",
    "StoreUnwritable",
    "open_store",
    "parse_s3_uri",
    "store_for_uri",
    "validate_key",
    "write_error",
]


def open_store(cfg: StoreConfig) -> LocalStore | S3Store:
    """The store named by `cfg.uri`; an S3 bucket is created if it does not exist."""
    if cfg.uri.startswith("file://"):
        return LocalStore.from_uri(cfg.uri)
    if cfg.uri.startswith("s3://"):
        return S3Store.from_config(cfg)
    raise StoreError(f"store.uri {cfg.uri!r}: must start with file:// or s3://")


def store_for_uri(uri: str, cfg: StoreConfig) -> LocalStore | S3Store:
    """The run's own store, for reading `uri` (taken from an event): only a URI inside it
    (under the local root, or the bucket and prefix of `store.uri`) is read, with reads capped
    by `store.max_object_bytes`; anything else (`file:///etc/passwd`, another bucket) is a
    StoreError, and opening it creates nothing."""
    if uri.startswith("file://") and cfg.uri.startswith("file://"):
        store: LocalStore | S3Store = LocalStore.from_uri(cfg.uri, create=False, max_bytes=cfg.max_object_bytes)
    elif uri.startswith("s3://") and cfg.uri.startswith("s3://"):
        parse_s3_uri(uri)
        bucket, prefix = parse_s3_uri(cfg.uri)
        own = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
        if not uri.startswith(own + "/"):
            raise OutsideStore(f"{uri}: outside the run's store {own}; readers only read the run's own objects")
        return S3Store.from_config(cfg, create_bucket=False)
    else:
        raise StoreError(
            f"{uri!r}: not an object of the run's store {cfg.uri}; readers only read the run's own objects"
        )
    try:
        store.key_for(uri)
    except StoreError as exc:
        raise StoreError(f"{exc} (readers only read the run's own objects)") from None
    return store
