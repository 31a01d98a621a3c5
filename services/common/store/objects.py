"""What both backends share: the `ObjectRef` a writer hands out, the `ObjectStore` methods,
object keys, and the verified copy and the atomic write.

Invariant: a key means the same on a filesystem and in S3 (relative, `/`-separated, no `.`,
`..` or empty segments, nothing ending in the temp suffix); bytes reach a caller only through
`copy_verified`, which raises on a size or sha256 that disagrees with the event; a file is
written through a temp file and a rename, so a reader sees it whole or not at all."""

from __future__ import annotations

import hashlib
import io
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol

import msgspec

from services.common.store.errors import ObjectCorrupt, StoreError

CHUNK = 1024 * 1024
TMP_SUFFIX = ".lorabus-tmp"


class ObjectRef(msgspec.Struct, frozen=True, kw_only=True):
    """What a writer publishes and a reader verifies against."""

    uri: str
    bytes: int
    sha256: str


class ObjectStore(Protocol):
    uri: str

    def uri_for(self, key: str) -> str: ...
    def put_bytes(self, key: str, data: bytes | memoryview) -> ObjectRef: ...
    def put_file(self, key: str, path: str | os.PathLike) -> ObjectRef: ...
    def get_bytes(self, uri: str, *, sha256: str | None = None, size: int | None = None) -> bytes: ...
    def get_file(
        self, uri: str, dest: str | os.PathLike, *, sha256: str | None = None, size: int | None = None
    ) -> ObjectRef: ...
    def read_into(self, uri: str, out: memoryview) -> None: ...
    def exists(self, key: str) -> bool: ...
    def delete(self, key: str) -> None: ...
    def list(self, prefix: str = "") -> list[str]: ...


def validate_key(key: str, what: str = "key") -> str:
    """A relative, `/`-separated object key that means the same on a filesystem and in S3."""
    if not isinstance(key, str) or not key:
        raise StoreError(f"{what} {key!r}: must be a non-empty string like 'run/adapters/v0/x'")
    if key.startswith("/"):
        raise StoreError(f"{what} {key!r}: must be relative; drop the leading '/'")
    if "\\" in key:
        raise StoreError(f"{what} {key!r}: contains a backslash; separate segments with '/'")
    if any(ord(c) < 32 or ord(c) == 127 for c in key):
        raise StoreError(f"{what} {key!r}: contains a control character")
    if len(key.encode()) > 1024:
        raise StoreError(f"{what} {key[:40]!r}...: longer than 1024 bytes")
    for segment in key.split("/"):
        if segment == "":
            raise StoreError(f"{what} {key!r}: has an empty segment ('//' or a trailing '/')")
        if segment in (".", ".."):
            raise StoreError(f"{what} {key!r}: '{segment}' segments are not allowed")
        if segment.endswith(TMP_SUFFIX):
            raise StoreError(f"{what} {key!r}: names ending in {TMP_SUFFIX} are reserved")
    return key


def key_in(store_uri: str, uri: str) -> str:
    """The key of `uri` inside the store at `store_uri`; an error for anything outside it."""
    if not uri.startswith(store_uri + "/"):
        raise StoreError(f"{uri}: outside this store ({store_uri}); open the store for it")
    return validate_key(uri[len(store_uri) + 1 :])


def validate_prefix(prefix: str) -> str:
    """A listing prefix: empty, a key, or a key with one trailing '/'."""
    if prefix == "":
        return prefix
    validate_key(prefix[:-1] if prefix.endswith("/") else prefix, "prefix")
    return prefix


def check_size(uri: str, size: int | None, limit: int | None) -> None:
    if size is not None and limit is not None and size > limit:
        raise ObjectCorrupt(
            f"{uri}: {size} bytes is over store.max_object_bytes ({limit}); raise it in the config "
            "if adapters really are this large"
        )


def copy_verified(
    chunks: Iterable[bytes],
    write: Callable[[bytes], object],
    uri: str,
    sha256: str | None,
    size: int | None,
    limit: int | None = None,
) -> tuple[int, str]:
    """Copy chunks to `write`, hashing on the way; raise if size or sha256 disagree, or once
    more than `limit` bytes came (whatever size the caller expects)."""
    check_size(uri, size, limit)
    digest = hashlib.sha256()
    n = 0
    for chunk in chunks:
        n += len(chunk)
        if size is not None and n > size:
            raise ObjectCorrupt(f"{uri}: size mismatch: expected {size} bytes, got more")
        if limit is not None and n > limit:
            raise ObjectCorrupt(f"{uri}: larger than store.max_object_bytes ({limit}); not read further")
        digest.update(chunk)
        write(chunk)
    if size is not None and n != size:
        raise ObjectCorrupt(f"{uri}: size mismatch: expected {size} bytes, got {n}")
    actual = digest.hexdigest()
    if sha256 is not None and actual != sha256:
        raise ObjectCorrupt(f"{uri}: sha256 mismatch: expected {sha256}, got {actual}")
    return n, actual


def file_chunks(f: io.BufferedIOBase) -> Iterable[bytes]:
    while chunk := f.read(CHUNK):
        yield chunk


def file_sha256(path: Path) -> tuple[int, str]:
    digest = hashlib.sha256()
    n = 0
    with open(path, "rb") as f:
        for chunk in file_chunks(f):
            n += len(chunk)
            digest.update(chunk)
    return n, digest.hexdigest()


def write_atomically(dest: Path, fill: Callable[[io.BufferedWriter], tuple[int, str]]) -> tuple[int, str]:
    """Write through a temp file in dest's directory, fsync, then rename over dest: a reader
    sees either no file or the whole file, never a partial one."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=TMP_SUFFIX)
    try:
        with os.fdopen(fd, "wb") as f:
            result = fill(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dest)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    dir_fd = os.open(dest.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)
    return result
