"""`s3://bucket/prefix` objects on an S3 endpoint (MinIO, SeaweedFS, AWS) through `minio`.

Invariant: every request has a bound, and only a transient failure is tried again. A request
waits at most `CONNECT_TIMEOUT_S` to connect and `READ_TIMEOUT_S` for each read (a slow store,
seconds per request, is served; a silent one is an error); a refused or reset connection, a
timeout or a 5xx/429 answer is tried `ATTEMPTS` times in all with exponential backoff (honouring
Retry-After); anything else (access denied, no such bucket or key) is raised at once. Every
failure is a `StoreError` naming the URI, the endpoint and the fix."""

from __future__ import annotations

import hashlib
import io
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path

from services.common.store.errors import ObjectNotFound, StoreError
from services.common.store.objects import (
    CHUNK,
    ObjectRef,
    check_size,
    copy_verified,
    file_sha256,
    key_in,
    validate_key,
    validate_prefix,
    write_atomically,
)
from services.config.schema import StoreConfig

PART_SIZE = 16 * 1024 * 1024
"""S3 multipart part size; also the size above which `put_file` uploads in parts."""
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 60.0
"""a store that answers in seconds is slow and served; one silent for a minute is stalled"""
ATTEMPTS = 4
BACKOFF_S = 0.5
"""urllib3's backoff_factor: the pauses between the attempts are 0, 1 and 2 s"""
TRANSIENT_STATUS = (429, 500, 502, 503, 504)
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


def http_client(read_timeout_s: float = READ_TIMEOUT_S):
    """The connection pool every S3Store's requests go through: the module's bounds and
    retry policy, with the certificates minio's own default would use."""
    import certifi
    import urllib3

    retry = urllib3.Retry(
        total=ATTEMPTS - 1,
        backoff_factor=BACKOFF_S,
        status_forcelist=TRANSIENT_STATUS,
        # the last transient answer reaches minio, whose S3Error names its code (SlowDown, ...)
        raise_on_status=False,
    )
    return urllib3.PoolManager(
        timeout=urllib3.Timeout(connect=CONNECT_TIMEOUT_S, read=read_timeout_s),
        maxsize=10,
        cert_reqs="CERT_REQUIRED",
        ca_certs=os.environ.get("SSL_CERT_FILE") or certifi.where(),
        retries=retry,
    )


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
        read_timeout_s: float = READ_TIMEOUT_S,
    ):
        from minio import Minio

        self.max_bytes = max_bytes
        """the most bytes `get_bytes`/`get_file` read of one object (None: no cap)"""
        self.bucket = bucket
        self.prefix = prefix
        self.endpoint = endpoint
        self.read_timeout_s = read_timeout_s
        self.uri = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
        self._client = Minio(
            endpoint,
            access_key=access_key,
            secret_key=secret_key,
            secure=secure,
            region=region,
            http_client=http_client(read_timeout_s),
        )
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
        """Run one minio call (its transient failures already tried again by the pool), turning
        its errors into StoreErrors that name `what`."""
        from minio.error import MinioException, S3Error

        try:
            return fn(*args, **kwargs)
        except S3Error as exc:
            if exc.code in ("NoSuchKey", "NoSuchObject", "ResourceNotFound"):
                raise ObjectNotFound(f"{what}: no such object") from None
            tried = f" (answered {ATTEMPTS} times)" if exc.response.status in TRANSIENT_STATUS else ""
            raise StoreError(f"{what}: S3 error {exc.code}{tried}: {exc.message}") from None
        except MinioException as exc:
            raise StoreError(f"{what}: S3 request failed: {exc}") from None
        except Exception as exc:
            if _transport_error(exc):
                raise self._unreachable(what, exc) from None
            raise

    def _unreachable(self, what: str, exc: BaseException) -> StoreError:
        return StoreError(
            f"store.endpoint: {self.endpoint} did not answer {what} ({type(exc).__name__}: {exc}), "
            f"tried {ATTEMPTS} times over {self._timeouts()}; check that the S3 server is up and "
            "reachable from here, then restart: nothing stored before is lost"
        )

    def _timeouts(self) -> str:
        return f"{CONNECT_TIMEOUT_S:g} s to connect, {self.read_timeout_s:g} s per read"

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
        return key_in(self.uri, uri)

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
            n, sha = file_sha256(Path(path))
        except OSError as exc:
            raise StoreError(f"{uri}: cannot read {path}: {exc}") from exc
        # fput streams from disk in PART_SIZE parts: no whole-file copy in memory
        self._call(uri, self._client.fput_object, self.bucket, name, str(path), part_size=PART_SIZE)
        return ObjectRef(uri=uri, bytes=n, sha256=sha)

    def _stream(self, uri: str, write: Callable[[bytes], object], sha256, size) -> tuple[int, str]:
        name = self._object_name(self.key_for(uri))
        check_size(uri, size, self.max_bytes)
        response = self._call(uri, self._client.get_object, self.bucket, name)
        try:
            return copy_verified(self._body(uri, response), write, uri, sha256, size, self.max_bytes)
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
            n, sha = write_atomically(Path(dest), lambda f: self._stream(uri, f.write, sha256, size))
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
            for chunk in self._body(uri, response):
                if n + len(chunk) > len(out):
                    raise StoreError(f"{uri}: size mismatch: expected {len(out)} bytes, got more")
                out[n : n + len(chunk)] = chunk
                n += len(chunk)
        finally:
            response.close()
            response.release_conn()
        if n != len(out):
            raise StoreError(f"{uri}: size mismatch: expected {len(out)} bytes, got {n}")

    def _body(self, uri: str, response) -> Iterator[bytes]:
        """The response's chunks; a connection that stalls or breaks mid-body is a StoreError
        (not tried again here: the caller has consumed part of it)."""
        try:
            yield from response.stream(CHUNK)
        except Exception as exc:
            if _transport_error(exc):
                raise self._unreachable(f"{uri} (mid-body)", exc) from None
            raise

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
        validate_prefix(prefix)
        base = f"{self.prefix}/" if self.prefix else ""
        objects = self._call(
            f"{self.uri}/{prefix}",
            lambda: list(self._client.list_objects(self.bucket, prefix=base + prefix, recursive=True)),
        )
        return sorted(o.object_name[len(base) :] for o in objects if not o.is_dir)


def _transport_error(exc: BaseException) -> bool:
    """A refused, reset or timed-out connection (urllib3's, or the socket's own)."""
    from urllib3.exceptions import HTTPError as TransportError

    return isinstance(exc, TransportError | OSError)
