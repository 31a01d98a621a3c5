"""`file://` objects: a directory on this machine (the embedded default).

Invariant: every path it touches is inside its root (keys are validated, and a symlink that
leads out is refused); writes are atomic (`objects.write_atomically`) and a disk that refuses
them is a `StoreUnwritable` naming the directory and `store.uri`."""

from __future__ import annotations

import hashlib
import io
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from services.common.store.errors import ObjectNotFound, StoreError, write_error
from services.common.store.objects import (
    TMP_SUFFIX,
    ObjectRef,
    copy_verified,
    file_chunks,
    key_in,
    validate_key,
    validate_prefix,
    write_atomically,
)

_READ_PART = 8 * 1024 * 1024
"""`LocalStore.read_into` reads parts of this size on several threads at once"""
_READERS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="store-read")


class LocalStore:
    """A directory. `file://./runs/store` (relative to the working directory) or
    `file:///abs/dir`; URIs it hands out are always absolute (`file:///abs/dir/key`)."""

    def __init__(self, root: str | os.PathLike, *, create: bool = True, max_bytes: int | None = None):
        self.root = Path(root).resolve()
        self.max_bytes = max_bytes
        """the most bytes `get_bytes`/`get_file` read of one object (None: no cap)"""
        if create:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise write_error(exc, "creating the store directory", self.root, "store.uri") from exc
        self.uri = f"file://{self.root}"

    @classmethod
    def from_uri(cls, uri: str, *, create: bool = True, max_bytes: int | None = None) -> LocalStore:
        if not uri.startswith("file://") or uri == "file://":
            raise StoreError(f"store.uri {uri!r}: expected file:///abs/dir or file://./rel/dir")
        return cls(uri[len("file://") :], create=create, max_bytes=max_bytes)

    def uri_for(self, key: str) -> str:
        return f"{self.uri}/{validate_key(key)}"

    def key_for(self, uri: str) -> str:
        return key_in(self.uri, uri)

    def _path(self, key: str) -> Path:
        path = self.root / validate_key(key)
        # a symlink inside the store must not lead out of it either
        if path.exists() and not path.resolve().is_relative_to(self.root):
            raise StoreError(f"{self.uri}/{key}: resolves outside the store ({path.resolve()})")
        return path

    def put_bytes(self, key: str, data: bytes | memoryview) -> ObjectRef:
        path = self._path(key)
        uri = self.uri_for(key)

        def fill(f: io.BufferedWriter) -> tuple[int, str]:
            f.write(data)
            return len(data), hashlib.sha256(data).hexdigest()

        try:
            n, sha = write_atomically(path, fill)
        except OSError as exc:
            raise write_error(exc, f"writing {uri}", path.parent, "store.uri") from exc
        return ObjectRef(uri=uri, bytes=n, sha256=sha)

    def put_file(self, key: str, path: str | os.PathLike) -> ObjectRef:
        dest = self._path(key)
        uri = self.uri_for(key)
        try:
            src = open(path, "rb")
        except OSError as exc:
            raise StoreError(f"{uri}: upload of {path} failed: {exc}") from exc
        try:
            with src:
                n, sha = write_atomically(dest, lambda f: copy_verified(file_chunks(src), f.write, uri, None, None))
        except OSError as exc:
            raise write_error(exc, f"writing {uri} from {path}", dest.parent, "store.uri") from exc
        return ObjectRef(uri=uri, bytes=n, sha256=sha)

    def get_bytes(self, uri: str, *, sha256: str | None = None, size: int | None = None) -> bytes:
        path = self._path(self.key_for(uri))
        out = bytearray()
        try:
            with open(path, "rb") as f:
                copy_verified(file_chunks(f), out.extend, uri, sha256, size, self.max_bytes)
        except FileNotFoundError:
            raise ObjectNotFound(f"{uri}: no such object") from None
        except OSError as exc:
            raise StoreError(f"{uri}: read failed: {exc}") from exc
        return bytes(out)

    def get_file(
        self, uri: str, dest: str | os.PathLike, *, sha256: str | None = None, size: int | None = None
    ) -> ObjectRef:
        path = self._path(self.key_for(uri))
        try:
            with open(path, "rb") as src:
                n, sha = write_atomically(
                    Path(dest), lambda f: copy_verified(file_chunks(src), f.write, uri, sha256, size, self.max_bytes)
                )
        except FileNotFoundError:
            raise ObjectNotFound(f"{uri}: no such object") from None
        except OSError as exc:
            raise StoreError(f"{uri}: download to {dest} failed: {exc}") from exc
        return ObjectRef(uri=uri, bytes=n, sha256=sha)

    def read_into(self, uri: str, out: memoryview) -> None:
        """The object's bytes into `out`, which must be exactly its size; NOT verified (the
        caller hashes them). Parts are read concurrently (`os.preadv` releases the GIL)."""
        path = self._path(self.key_for(uri))
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise ObjectNotFound(f"{uri}: no such object") from None
        except OSError as exc:
            raise StoreError(f"{uri}: read failed: {exc}") from exc
        try:
            size = os.fstat(fd).st_size
            if size != len(out):
                raise StoreError(f"{uri}: size mismatch: expected {len(out)} bytes, got {size}")

            def read(start: int) -> None:
                end = min(start + _READ_PART, size)
                while start < end:
                    n = os.preadv(fd, [out[start:end]], start)
                    if n == 0:
                        raise StoreError(f"{uri}: size mismatch: the object ended at byte {start} of {size}")
                    start += n

            list(_READERS.map(read, range(0, size, _READ_PART)))
        except OSError as exc:
            raise StoreError(f"{uri}: read failed: {exc}") from exc
        finally:
            os.close(fd)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def delete(self, key: str) -> None:
        """Idempotent, like S3: deleting a missing object is not an error."""
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise StoreError(f"{self.uri_for(key)}: delete failed: {exc}") from exc

    def list(self, prefix: str = "") -> list[str]:
        """Keys starting with `prefix` (a string prefix, as in S3), sorted."""
        validate_prefix(prefix)
        # only walk the directory the prefix pins down
        base = self.root / prefix.rpartition("/")[0] if "/" in prefix else self.root
        keys = []
        for dirpath, _, filenames in os.walk(base):
            for name in filenames:
                if name.endswith(TMP_SUFFIX):
                    continue
                key = Path(dirpath, name).relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)
