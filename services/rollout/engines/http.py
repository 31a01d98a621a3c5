"""What the vLLM and SGLang engines share: HTTP calls with retries, adapter directories, and
the per-replica bookkeeping of which version each server serves (`ServerEngine`).

Both servers read an adapter from a directory, so the sidecar writes each version into its own
directory (`<adapter_dir>/<lora_name>-v<N>/`) and tells the server the path as the server sees
it (`server_adapter_dir`, for a shared volume mounted elsewhere). A directory is removed only
after every replica has unloaded that version.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import shutil
from collections.abc import Awaitable, Callable, Collection, Sequence
from pathlib import Path, PurePosixPath
from typing import Any, Self, TypeVar

import httpx
import torch

from proto.messages import LoraSpec, adapter_name
from services.common import adapter_io
from services.common.store.objects import file_sha256
from services.rollout.engines.base import GenRequest, GenResult

T = TypeVar("T")

# 5xx from a proxy or a server that is starting or overloaded; a 500 is an engine failure
# (vLLM: "Call to add_lora method failed ..."), which the same request would only repeat.
TRANSIENT_STATUS = frozenset({502, 503, 504})


class ServerError(RuntimeError):
    """A server answered with an error, or could not be reached. `status` is the HTTP status
    (None: no answer); `message` is the server's own error text."""

    def __init__(self, url: str, status: int | None, message: str, body: Any = None):
        self.url = url
        self.status = status
        self.message = message
        self.body = body
        """the decoded JSON answer, when there was one (SGLang's carries loaded_adapters)"""
        where = f"HTTP {status}" if status is not None else "no answer"
        super().__init__(f"{url}: {where}: {message}")


class AdapterError(RuntimeError):
    """A version cannot be loaded, unloaded or used (the message says which and why)."""


class VersionNotLoaded(AdapterError):
    """The server does not serve this version (never loaded, evicted, or the server restarted);
    the service re-loads it if it is still admissible."""

    def __init__(self, version: int, url: str, message: str):
        self.version = version
        self.url = url
        super().__init__(f"v{version} is not loaded on {url}: {message}")


def error_message(response: httpx.Response) -> str:
    """The server's error text: vLLM `{"error": {"message"}}`, SGLang `{"error_message"}` or
    `{"error": {"message"}}`, FastAPI `{"detail"}`, else the body itself."""
    try:
        body = response.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return response.text.strip() or response.reason_phrase
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str) and err:
            return err
        for key in ("error_message", "message", "detail"):
            if body.get(key):
                return str(body[key])
    return response.text.strip()


def _json_or_none(response: httpx.Response) -> Any:
    try:
        return response.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None


async def with_retries(
    call: Callable[[], Awaitable[T]],
    *,
    attempts: int,
    backoff_s: float,
    retry_if: Callable[[BaseException], bool],
) -> T:
    """`call()` up to `attempts` times, sleeping backoff_s, 2*backoff_s, ... between tries."""
    for attempt in range(1, attempts + 1):
        try:
            return await call()
        except Exception as exc:
            if attempt == attempts or not retry_if(exc):
                raise
            await asyncio.sleep(backoff_s * 2 ** (attempt - 1))
    raise AssertionError("unreachable")


def is_transient(exc: BaseException) -> bool:
    return isinstance(exc, ServerError) and (exc.status is None or exc.status in TRANSIENT_STATUS)


class Http:
    """One `httpx.AsyncClient` for every replica, with retries on transient failures only."""

    def __init__(
        self,
        *,
        timeout_s: float,
        attempts: int = 3,
        backoff_s: float = 0.2,
        client: httpx.AsyncClient | None = None,
    ):
        if attempts < 1:
            raise ValueError(f"attempts: {attempts} must be >= 1")
        self.client = client or httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0))
        self.attempts = attempts
        self.backoff_s = backoff_s

    async def request(self, method: str, url: str, body: Any = None, *, retry: bool = True) -> httpx.Response:
        """The response of a 2xx answer; `ServerError` otherwise (after retries if transient)."""

        async def once() -> httpx.Response:
            try:
                response = await self.client.request(method, url, json=body)
            except httpx.HTTPError as exc:
                raise ServerError(url, None, f"{type(exc).__name__}: {exc}") from exc
            if response.is_success:
                return response
            raise ServerError(url, response.status_code, error_message(response), _json_or_none(response))

        if not retry:
            return await once()
        return await with_retries(once, attempts=self.attempts, backoff_s=self.backoff_s, retry_if=is_transient)

    async def post(self, url: str, body: Any, *, retry: bool = True) -> httpx.Response:
        return await self.request("POST", url, body, retry=retry)

    async def get(self, url: str, *, retry: bool = True) -> httpx.Response:
        return await self.request("GET", url, retry=retry)

    async def close(self) -> None:
        await self.client.aclose()


def normalize_urls(urls: list[str], field: str = "rollout.server_urls") -> list[str]:
    out = [u.rstrip("/") for u in urls]
    if not out:
        raise ValueError(f"{field}: empty; give every server replica's base URL (http://host:port)")
    for u in out:
        if not u.startswith(("http://", "https://")):
            raise ValueError(f"{field}: {u!r} is not an http(s):// URL; write e.g. http://127.0.0.1:8000")
    if len(set(out)) != len(out):
        raise ValueError(f"{field}: {out} lists a replica twice; each replica is loaded individually")
    return out


# --- adapter directories ---------------------------------------------------------------------


class AdapterDirs:
    """Where version N's PEFT directory lives, for the sidecar and for the server."""

    def __init__(self, lora_name: str, adapter_dir: str | Path, server_adapter_dir: str | None = None):
        self.lora_name = lora_name
        self.local_root = Path(adapter_dir)
        # The server may run elsewhere (a container, another host): its path is text, not ours.
        self.server_root = str(server_adapter_dir or Path(adapter_dir).resolve()).rstrip("/")

    def name(self, version: int) -> str:
        return adapter_name(self.lora_name, version)

    def local(self, version: int) -> Path:
        return self.local_root / self.name(version)

    def server(self, version: int) -> str:
        return str(PurePosixPath(self.server_root) / self.name(version))

    def write(self, version: int, weights: bytes | dict[str, torch.Tensor], lora: LoraSpec) -> str:
        """Write version N's directory and return the path the server reads. Tensors (an XCCL
        broadcast) are streamed into the file, bytes (the object copy) written as they are.
        A directory that already holds different weights is an error: a name is never reused
        for other weights (vLLM keys its prefix cache by name and path)."""
        target = self.local(version)
        existing = target / adapter_io.WEIGHTS_NAME
        if existing.exists():
            data = weights if isinstance(weights, (bytes, bytearray)) else adapter_io.to_bytes(weights)
            if file_sha256(existing)[1] != adapter_io.sha256(bytes(data)):
                raise AdapterError(
                    f"v{version}: {target} already holds different weights under the name "
                    f"{self.name(version)!r}; a version name is never reused for other weights "
                    "(publish a new version, or clear rollout.adapter_dir of an old run)"
                )
        adapter_io.write_peft_dir(target, weights if isinstance(weights, dict) else bytes(weights), lora)
        return self.server(version)

    def remove(self, version: int) -> None:
        shutil.rmtree(self.local(version), ignore_errors=True)

    def same_server_path(self, a: str | None, b: str) -> bool:
        """Whether two server-side paths name the same directory; relative ones (possible
        only without server_adapter_dir, i.e. one filesystem) resolve against our cwd."""
        if a is None:
            return False

        def norm(p: str) -> str:
            return str(PurePosixPath(p)) if PurePosixPath(p).is_absolute() else str(Path(p).resolve())

        return norm(a.rstrip("/")) == norm(b.rstrip("/"))

    def exists(self, version: int) -> bool:
        return (self.local(version) / adapter_io.WEIGHTS_NAME).exists()


# --- what both server engines do the same way ------------------------------------------------


class ServerEngine:
    """An engine driving one or more inference servers over HTTP, each data-parallel replica
    loaded on its own. Subclasses say how one replica loads, unloads, generates and reports
    what it forgot (`_load_on`, `_unload_on`, `_generate_on`, `missing_versions`, `health`)."""

    name: str

    def __init__(self, urls: Sequence[str], dirs: AdapterDirs, *, http: Http):
        self.urls = normalize_urls(list(urls))
        self.dirs = dirs
        self.http = http
        self._on: dict[str, dict[int, str]] = {u: {} for u in self.urls}
        """replica -> version -> server path it was loaded from (what we know it serves)"""
        self._next = itertools.count()
        self._locks: dict[int, asyncio.Lock] = {}

    @classmethod
    def from_config(cls, cfg, urls: Sequence[str] | None = None) -> Self:
        ro = cfg.rollout
        dirs = AdapterDirs(ro.lora_name, ro.adapter_dir, ro.server_adapter_dir)
        return cls(urls or ro.server_urls, dirs, http=Http(timeout_s=ro.request_timeout_s))

    def _lock(self, version: int) -> asyncio.Lock:
        return self._locks.setdefault(version, asyncio.Lock())

    async def _load_on(self, url: str, version: int, path: str) -> None:
        raise NotImplementedError

    async def _unload_on(self, url: str, version: int, _: None) -> None:
        raise NotImplementedError

    async def _generate_on(self, url: str, req: GenRequest, version: int) -> list[GenResult]:
        raise NotImplementedError

    async def missing_versions(self) -> dict[int, list[str]]:
        raise NotImplementedError

    async def _listing(self, url: str, listing: Callable[[str], Awaitable[T]]) -> T | None:
        """`listing(url)` (what the replica serves), or None when the replica does not answer:
        then everything we believed it serves is forgotten. A server that died or hangs comes
        back, if at all, as a new process without our adapters (`lorabus up` restarts a lost
        one), so nothing may be routed to it as loaded until a load answered again; a replica
        that only paused answers "already loaded" from our own path, which `_load_on` takes."""
        try:
            return await listing(url)
        except ServerError as e:
            if e.status is not None and e.status not in TRANSIENT_STATUS:
                raise
            self._on[url].clear()
            return None

    # --- versions ---
    async def load_version(self, version: int, weights: bytes | dict[str, torch.Tensor], lora: LoraSpec) -> None:
        async with self._lock(version):
            path = await asyncio.to_thread(self.dirs.write, version, weights, lora)
            await self._on_every_replica(self._load_on, version, path, what="load")

    async def unload_version(self, version: int) -> None:
        async with self._lock(version):
            await self._on_every_replica(self._unload_on, version, None, what="unload")
            # Only now: a replica that still served it might reload it from there (LRU).
            await asyncio.to_thread(self.dirs.remove, version)

    async def _on_every_replica(self, step, version: int, arg, *, what: str) -> None:
        results = await asyncio.gather(*(step(url, version, arg) for url in self.urls), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if len(failed) == 1:
            raise failed[0]
        if failed:
            raise AdapterError(
                f"v{version}: {what} failed on {len(failed)} of {len(self.urls)} replicas: "
                + "; ".join(map(str, failed))
            ) from failed[0]

    async def loaded_versions(self) -> list[int]:
        """Versions every replica serves, as far as we know (see `missing_versions`)."""
        sets = [set(v) for v in self._on.values()]
        return sorted(set.intersection(*sets)) if sets else []

    async def reload_missing(self, admissible: Collection[int]) -> list[int]:
        """Re-load, from their directories, the admissible versions a replica forgot; the rest
        are unloaded everywhere (their directories removed). Returns the versions re-loaded."""
        reloaded = []
        for version, urls in sorted((await self.missing_versions()).items()):
            if version in admissible and self.dirs.exists(version):
                async with self._lock(version):
                    for url in urls:
                        await self._load_on(url, version, self.dirs.server(version))
                reloaded.append(version)
            else:
                await self.unload_version(version)
        return reloaded

    # --- generation ---
    async def generate(self, requests: list[GenRequest], version: int) -> list[list[GenResult]]:
        """Each request on one replica that serves `version`, round-robin."""
        urls = [u for u in self.urls if version in self._on[u]]
        if not urls:
            raise VersionNotLoaded(version, ",".join(self.urls), "not loaded by this engine")
        start = next(self._next)
        return list(
            await asyncio.gather(
                *(self._generate_on(urls[(start + i) % len(urls)], r, version) for i, r in enumerate(requests))
            )
        )

    async def close(self) -> None:
        await self.http.close()
