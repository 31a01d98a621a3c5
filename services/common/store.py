"""The object store: where adapters and exports live, addressed by URI.

Two backends with the same methods: `LocalStore` (`file:///dir`, one machine, the embedded
default) and `S3Store` (`s3://bucket/prefix` on MinIO, SeaweedFS or AWS through the `minio`
client). Everything is synchronous; async services call it with `asyncio.to_thread`.

A writer gets back an `ObjectRef` (URI, size, sha256) and puts it into an event; a reader opens
the store for that URI (`store_for_uri`) and reads it back with both checked, so a truncated or
swapped object is an error instead of a silently wrong adapter. The one exception is `read_into`,
which fills a caller's buffer unhashed (in parallel chunks, for a replica's fast load path): its
caller owns the sha256 check and must not use the bytes before it has passed. S3 credentials are read from
environment variables named in the config and never appear in URIs, events, errors or logs.
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import re
import tempfile
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

import msgspec

from services.config.schema import StoreConfig

PART_SIZE = 16 * 1024 * 1024
"""S3 multipart part size; also the size above which `put_file` uploads in parts."""
_CHUNK = 1024 * 1024
_READ_PART = 8 * 1024 * 1024
"""`LocalStore.read_into` reads parts of this size on several threads at once"""
_READERS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="store-read")
_TMP_SUFFIX = ".lorabus-tmp"
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


class ObjectRef(msgspec.Struct, frozen=True, kw_only=True):
    """What a writer publishes and a reader verifies against."""

    uri: str
    bytes: int
    sha256: str


class StoreError(Exception):
    """Any store failure; the message names the URI or key and the cause."""


class ObjectNotFound(StoreError):
    """The object does not exist (a reader may retry: the writer may not have finished)."""


class ObjectCorrupt(StoreError):
    """The object's bytes are not the ones its event names (size or sha256), or more than the
    config lets a reader read: reading it again gives the same, so a reader gives the version
    up instead of retrying."""


class StoreUnwritable(StoreError):
    """The disk under the store refuses writes: full (ENOSPC, EDQUOT), read-only (EROFS) or not
    this process's to write (EACCES, EPERM). The message names the directory and the fix.
    Objects appear whole or not at all, so what was written before is intact and the failed
    write left nothing behind; writing again helps only once someone frees space or fixes the
    mount (`full` says which kind a writer may wait out)."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code

    @property
    def full(self) -> bool:
        return self.code in (errno.ENOSPC, errno.EDQUOT)


_UNWRITABLE = {
    errno.ENOSPC: ("has no space left on its device", "free space there or point {setting} at a larger disk"),
    errno.EDQUOT: ("is over its disk quota", "raise the quota or point {setting} at another disk"),
    errno.EROFS: ("is on a read-only filesystem", "remount it read-write or point {setting} at a writable directory"),
    errno.EACCES: ("is not writable by this process", "give uid {uid} write access or point {setting} elsewhere"),
    errno.EPERM: ("is not writable by this process", "give uid {uid} write access or point {setting} elsewhere"),
}


def write_error(exc: OSError, what: str, directory: Path, setting: str) -> StoreError:
    """`exc`, raised while `what` into `directory`, as the error a user acts on: a
    `StoreUnwritable` naming the directory, the cause and the fix (`setting` is the config key
    that chose the directory) when the disk refuses writes, else a StoreError with the cause."""
    if exc.errno in _UNWRITABLE:
        problem, fix = _UNWRITABLE[exc.errno]
        name = errno.errorcode[exc.errno]
        return StoreUnwritable(
            f"{setting}: {directory} {problem} ({name}, {what}); "
            f"{fix.format(setting=setting, uid=os.getuid())}, then restart: nothing written before is lost",
            exc.errno,
        )
    return StoreError(f"{setting}: {what} into {directory} failed: {exc}")


class OutsideStore(StoreError):
    """A URI outside the run's store: never read, and retrying cannot change that."""


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


# --- keys and verification (shared by both backends) ----------------------------------------


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
        if segment.endswith(_TMP_SUFFIX):
            raise StoreError(f"{what} {key!r}: names ending in {_TMP_SUFFIX} are reserved")
    return key


def _validate_prefix(prefix: str) -> str:
    """A listing prefix: empty, a key, or a key with one trailing '/'."""
    if prefix == "":
        return prefix
    validate_key(prefix[:-1] if prefix.endswith("/") else prefix, "prefix")
    return prefix


def _check_size(uri: str, size: int | None, limit: int | None) -> None:
    if size is not None and limit is not None and size > limit:
        raise ObjectCorrupt(
            f"{uri}: {size} bytes is over store.max_object_bytes ({limit}); raise it in the config "
            "if adapters really are this large"
        )


def _copy_verified(
    chunks: Iterable[bytes],
    write: Callable[[bytes], object],
    uri: str,
    sha256: str | None,
    size: int | None,
    limit: int | None = None,
) -> tuple[int, str]:
    """Copy chunks to `write`, hashing on the way; raise if size or sha256 disagree, or once
    more than `limit` bytes came (whatever size the caller expects)."""
    _check_size(uri, size, limit)
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


def _file_chunks(f: io.BufferedIOBase) -> Iterable[bytes]:
    while chunk := f.read(_CHUNK):
        yield chunk


def _file_sha256(path: Path) -> tuple[int, str]:
    digest = hashlib.sha256()
    n = 0
    with open(path, "rb") as f:
        for chunk in _file_chunks(f):
            n += len(chunk)
            digest.update(chunk)
    return n, digest.hexdigest()


def _write_atomically(dest: Path, fill: Callable[[io.BufferedWriter], tuple[int, str]]) -> tuple[int, str]:
    """Write through a temp file in dest's directory, fsync, then rename over dest: a reader
    sees either no file or the whole file, never a partial one."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=_TMP_SUFFIX)
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


# --- file:// ----------------------------------------------------------------------------------


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
        """The key of a URI inside this store; an error for anything outside it."""
        if not uri.startswith(self.uri + "/"):
            raise StoreError(f"{uri}: outside this store ({self.uri}); open the store for it")
        return validate_key(uri[len(self.uri) + 1 :])

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
            n, sha = _write_atomically(path, fill)
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
                n, sha = _write_atomically(dest, lambda f: _copy_verified(_file_chunks(src), f.write, uri, None, None))
        except OSError as exc:
            raise write_error(exc, f"writing {uri} from {path}", dest.parent, "store.uri") from exc
        return ObjectRef(uri=uri, bytes=n, sha256=sha)

    def get_bytes(self, uri: str, *, sha256: str | None = None, size: int | None = None) -> bytes:
        path = self._path(self.key_for(uri))
        out = bytearray()
        try:
            with open(path, "rb") as f:
                _copy_verified(_file_chunks(f), out.extend, uri, sha256, size, self.max_bytes)
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
                n, sha = _write_atomically(
                    Path(dest), lambda f: _copy_verified(_file_chunks(src), f.write, uri, sha256, size, self.max_bytes)
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
        _validate_prefix(prefix)
        # only walk the directory the prefix pins down
        base = self.root / prefix.rpartition("/")[0] if "/" in prefix else self.root
        keys = []
        for dirpath, _, filenames in os.walk(base):
            for name in filenames:
                if name.endswith(_TMP_SUFFIX):
                    continue
                key = Path(dirpath, name).relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)


# --- s3:// ------------------------------------------------------------------------------------


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """`s3://bucket/some/prefix` -> ("bucket", "some/prefix"); the prefix may be empty."""
    if not uri.startswith("s3://"):
        raise StoreError(f"{uri!r}: not an s3:// URI")
    bucket, _, rest = uri[len("s3://") :].partition("/")
    if not _BUCKET.match(bucket) or ".." in bucket:
        raise StoreError(
            f"{uri!r}: bucket {bucket!r} is not a valid S3 bucket name (3-63 of lowercase letters, digits, '.', '-')"
        )
    if "@" in bucket or ":" in bucket:
        raise StoreError(f"{uri!r}: credentials or ports do not belong in the URI; use the config")
    rest = rest.rstrip("/")
    if rest:
        validate_key(rest, "prefix")
    return bucket, rest


class S3Store:
    """`s3://bucket/prefix` on an S3 endpoint; objects are `prefix/key` in the bucket."""

    def __init__(
        self,
        bucket: str,
        prefix: str,
        *,
        endpoint: str,
        access_key: str,
        secret_key: str,
        secure: bool = False,
        region: str | None = None,
        create_bucket: bool = True,
        max_bytes: int | None = None,
    ):
        from minio import Minio

        self.max_bytes = max_bytes
        """the most bytes `get_bytes`/`get_file` read of one object (None: no cap)"""
        self.bucket = bucket
        self.prefix = prefix
        self.endpoint = endpoint
        self.uri = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
        self._client = Minio(endpoint, access_key=access_key, secret_key=secret_key, secure=secure, region=region)
        if create_bucket:
            self._ensure_bucket(region)

    @classmethod
    def from_config(cls, cfg: StoreConfig, uri: str | None = None, **kwargs) -> S3Store:
        uri = uri or cfg.uri
        bucket, prefix = parse_s3_uri(uri)
        if not cfg.endpoint:
            raise StoreError(f"store.endpoint: required for {uri}; set it to the S3 host:port")
        keys = {}
        for env in (cfg.access_key_env, cfg.secret_key_env):
            value = os.environ.get(env)
            if not value:
                raise StoreError(
                    f"store: environment variable {env} is not set; it must hold the S3 "
                    f"{'access' if env == cfg.access_key_env else 'secret'} key for {uri}"
                )
            keys[env] = value
        return cls(
            bucket,
            prefix,
            endpoint=cfg.endpoint,
            access_key=keys[cfg.access_key_env],
            secret_key=keys[cfg.secret_key_env],
            secure=cfg.secure,
            region=cfg.region,
            max_bytes=cfg.max_object_bytes,
            **kwargs,
        )

    def _call(self, what: str, fn: Callable, *args, **kwargs):
        """Run one minio call, turning its errors into StoreErrors that name `what`."""
        from minio.error import MinioException, S3Error
        from urllib3.exceptions import HTTPError as TransportError

        try:
            return fn(*args, **kwargs)
        except S3Error as exc:
            if exc.code in ("NoSuchKey", "NoSuchObject", "ResourceNotFound"):
                raise ObjectNotFound(f"{what}: no such object") from None
            raise StoreError(f"{what}: S3 error {exc.code}: {exc.message}") from None
        except MinioException as exc:
            raise StoreError(f"{what}: S3 request failed: {exc}") from None
        except (TransportError, OSError) as exc:  # refused, reset, timed out after retries
            raise StoreError(f"{what}: cannot reach S3 endpoint {self.endpoint}: {exc}") from None

    def _ensure_bucket(self, region: str | None) -> None:
        what = f"s3://{self.bucket}"
        if not self._call(what, self._client.bucket_exists, self.bucket):
            self._call(what, self._client.make_bucket, self.bucket, location=region)

    def _object_name(self, key: str) -> str:
        key = validate_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def uri_for(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._object_name(key)}"

    def key_for(self, uri: str) -> str:
        """The key of a URI inside this store; an error for anything outside it."""
        if not uri.startswith(self.uri + "/"):
            raise StoreError(f"{uri}: outside this store ({self.uri}); open the store for it")
        return validate_key(uri[len(self.uri) + 1 :])

    def put_bytes(self, key: str, data: bytes | memoryview) -> ObjectRef:
        name = self._object_name(key)
        uri = self.uri_for(key)
        self._call(
            uri,
            self._client.put_object,
            self.bucket,
            name,
            io.BytesIO(data),
            len(data),
            part_size=PART_SIZE,
        )
        return ObjectRef(uri=uri, bytes=len(data), sha256=hashlib.sha256(data).hexdigest())

    def put_file(self, key: str, path: str | os.PathLike) -> ObjectRef:
        name = self._object_name(key)
        uri = self.uri_for(key)
        try:
            n, sha = _file_sha256(Path(path))
        except OSError as exc:
            raise StoreError(f"{uri}: cannot read {path}: {exc}") from exc
        # fput streams from disk in PART_SIZE parts: no whole-file copy in memory
        self._call(uri, self._client.fput_object, self.bucket, name, str(path), part_size=PART_SIZE)
        return ObjectRef(uri=uri, bytes=n, sha256=sha)

    def _stream(self, uri: str, write: Callable[[bytes], object], sha256, size) -> tuple[int, str]:
        name = self._object_name(self.key_for(uri))
        _check_size(uri, size, self.max_bytes)
        response = self._call(uri, self._client.get_object, self.bucket, name)
        try:
            return _copy_verified(response.stream(_CHUNK), write, uri, sha256, size, self.max_bytes)
        finally:
            response.close()
            response.release_conn()

    def get_bytes(self, uri: str, *, sha256: str | None = None, size: int | None = None) -> bytes:
        out = bytearray()
        self._stream(uri, out.extend, sha256, size)
        return bytes(out)

    def get_file(
        self, uri: str, dest: str | os.PathLike, *, sha256: str | None = None, size: int | None = None
    ) -> ObjectRef:
        self.key_for(uri)
        try:
            n, sha = _write_atomically(Path(dest), lambda f: self._stream(uri, f.write, sha256, size))
        except OSError as exc:
            raise StoreError(f"{uri}: download to {dest} failed: {exc}") from exc
        return ObjectRef(uri=uri, bytes=n, sha256=sha)

    def read_into(self, uri: str, out: memoryview) -> None:
        """The object's bytes into `out`, which must be exactly its size; NOT verified (the
        caller hashes them)."""
        name = self._object_name(self.key_for(uri))
        response = self._call(uri, self._client.get_object, self.bucket, name)
        n = 0
        try:
            for chunk in response.stream(_CHUNK):
                if n + len(chunk) > len(out):
                    raise StoreError(f"{uri}: size mismatch: expected {len(out)} bytes, got more")
                out[n : n + len(chunk)] = chunk
                n += len(chunk)
        finally:
            response.close()
            response.release_conn()
        if n != len(out):
            raise StoreError(f"{uri}: size mismatch: expected {len(out)} bytes, got {n}")

    def exists(self, key: str) -> bool:
        try:
            self._call(self.uri_for(key), self._client.stat_object, self.bucket, self._object_name(key))
        except ObjectNotFound:
            return False
        return True

    def delete(self, key: str) -> None:
        self._call(self.uri_for(key), self._client.remove_object, self.bucket, self._object_name(key))

    def list(self, prefix: str = "") -> list[str]:
        """Keys starting with `prefix` (a string prefix), sorted."""
        _validate_prefix(prefix)
        base = f"{self.prefix}/" if self.prefix else ""
        objects = self._call(
            f"{self.uri}/{prefix}",
            lambda: list(self._client.list_objects(self.bucket, prefix=base + prefix, recursive=True)),
        )
        return sorted(o.object_name[len(base) :] for o in objects if not o.is_dir)


# --- opening ----------------------------------------------------------------------------------


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
