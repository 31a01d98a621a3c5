"""The SGLang engine: drive SGLang servers over their native HTTP API (0.5.17).

Version N is registered as `<lora_name>-v<N>` from its own directory with `POST
/load_lora_adapter {lora_name, lora_path, pinned}`; `/generate` requests name it in `lora_path`.
SGLang has no in-place reload, answers every LoRA call with `{success, error_message,
loaded_adapters}` (400 on failure), lets dynamic loading run only with dp_size 1 (so each
data-parallel replica is its own server here, loaded on its own), and lists what it has
registered in `GET /v1/models`.

Invariants, against what SGLang 0.5.17 does on its own:
- No version is unloaded while a request of ours uses it, and none of ours names a version that
  is being or has been unloaded. SGLang itself waits for in-flight requests before an unload,
  but it also re-registers an unloaded name that a request names (from the path it remembers,
  "Reloading evicted adapter"), which would bring back a version we dropped, count it against
  `--max-loaded-loras` and push out another one. So `unload_version` first closes the version
  to new requests, waits until our requests on it have finished, then unloads.
- A request of ours that is cancelled, or whose answer never came, is aborted by rid
  (`/abort_request`), so the server stops it and releases its hold on the adapter at once
  instead of running it to the end (SGLang notices a vanished client only every few seconds,
  and a timed-out request would otherwise be retried next to its still-running first try).
  Rids are uuid4 hex, never a prefix of one another: SGLang aborts every rid that *starts with*
  the one given.
- `--max-loaded-loras` is never reached by a load of ours: past it SGLang would unload its least
  recently used adapter itself, a version in our keep window or another run's. A server whose
  limit is below the keep window (`rollout.lora_keep_versions + 1`) is a configuration error
  at its first load; a load that would pass the limit (several runs on one server) is refused.
- n > 1 is one batch of n copies of the prompt (each with its own seed and rid): n results,
  each with its own token ids and logprobs, n holds taken and n released.

Behaviour logprobs: SGLang's `meta_info.output_token_logprobs` are `[logprob, token_id, text]`
with logprob = log_softmax(logits / T) over the full vocabulary (greedy: T = 1), what the
trainer computes; nothing to configure.

Verified against the protocol server in tests/fixtures/sglang_server.py; the real server runs
only on a GPU (benchmarks/device/sglang_smoke.py).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Sequence
from typing import Self

import httpx

from proto.messages import FinishReason
from services.rollout.engines.base import GenRequest, GenResult
from services.rollout.engines.http import (
    AdapterDirs,
    AdapterError,
    Http,
    ServerEngine,
    ServerError,
    VersionNotLoaded,
    is_transient,
    with_retries,
)

log = logging.getLogger(__name__)

_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}
# 400s of /generate that mean "this server does not have the adapter": never loaded there (a
# restarted server), unregistered between lookup and acquire, or its implicit reload failed.
_NOT_LOADED = ("never been loaded", "are not loaded", "Failed to implicitly load")


class SglangEngine(ServerEngine):
    name = "sglang"

    def __init__(self, urls: Sequence[str], dirs: AdapterDirs, *, http: Http, slots: int | None = None):
        super().__init__(urls, dirs, http=http)
        if slots is not None and slots < 1:
            raise ValueError(f"slots: {slots} must be >= 1 (rollout.lora_keep_versions + 1)")
        self.slots = slots
        """versions this engine keeps loaded at most (keep window + the one being loaded)"""
        self._limits: dict[str, int | None] = {}
        """replica -> its --max-loaded-loras (None: unlimited), read at the first load"""
        self._holds: dict[int, int] = {}
        self._closed: set[int] = set()
        self._idle = asyncio.Condition()

    @classmethod
    def from_config(cls, cfg, urls: Sequence[str] | None = None) -> Self:
        engine = super().from_config(cfg, urls)
        engine.slots = cfg.rollout.keep_versions + 1
        return engine

    # --- versions ---
    async def _load_on(self, url: str, version: int, path: str) -> None:
        if self._on[url].get(version) == path:
            return
        name = self.dirs.name(version)
        await self._check_room(url, name)
        try:
            answer = await self.http.post(
                f"{url}/load_lora_adapter", {"lora_name": name, "lora_path": path, "pinned": False}
            )
        except ServerError as e:
            # Every failure is a 400; the answer's loaded_adapters tells "already loaded" (by
            # us, from this path: a retry whose first answer was lost, or --lora-paths for v0)
            # apart from everything else.
            served = _loaded_adapters(e.body).get(name)
            if served is None or not self.dirs.same_server_path(served, path):
                where = f" (it serves {name!r} from {served})" if served else ""
                raise AdapterError(f"v{version}: loading {name!r} from {path} on {url} failed: {e}{where}") from e
        else:
            self._forget_evicted(url, _loaded_adapters(_json(answer)), keep=name)
        self._on[url][version] = path

    async def _check_room(self, url: str, name: str) -> None:
        """Refuse a load that would make SGLang unload an adapter on its own."""
        if url not in self._limits:
            info = _json(await self.http.get(f"{url}/server_info"))
            if not info.get("enable_lora", True):
                raise AdapterError(f"{url}: runs without --enable-lora; start it with --enable-lora")
            self._limits[url] = info.get("max_loaded_loras")
        limit = self._limits[url]
        if limit is None:
            return
        if self.slots is not None and limit < self.slots:
            raise AdapterError(
                f"sglang.max_loaded_loras: {url} runs with --max-loaded-loras {limit}, below "
                f"rollout.lora_keep_versions + 1 = {self.slots}; past it SGLang unloads the least "
                f"recently used adapter itself, a version still in the keep window; restart it with "
                f"--max-loaded-loras {self.slots} or more (sglang.max_loaded_loras), or lower "
                "rollout.lora_keep_versions"
            )
        registered = await self.registered(url)
        if name not in registered and len(registered) >= limit:
            raise AdapterError(
                f"sglang.max_loaded_loras: {url} already holds {len(registered)} adapters "
                f"({sorted(registered)}), its --max-loaded-loras {limit}; loading {name!r} would make "
                "SGLang unload the least recently used one itself; several runs or clients on one "
                "server need --max-loaded-loras of (rollout.lora_keep_versions + 1) per run"
            )

    async def registered(self, url: str) -> dict[str, str]:
        """name -> path of every adapter the replica has registered (`/v1/models`)."""
        body = _json(await self.http.get(f"{url}/v1/models"))
        return {m["id"]: m.get("root") for m in body.get("data", []) if m.get("parent") is not None}

    def _forget_evicted(self, url: str, loaded: dict[str, str], keep: str) -> None:
        """Versions of ours missing from a load's answer were unloaded by SGLang (its LRU,
        when another client filled the server between our check and our load)."""
        for version in list(self._on[url]):
            name = self.dirs.name(version)
            if name != keep and name not in loaded:
                log.warning("sglang %s: %s was unloaded by the server (--max-loaded-loras)", url, name)
                del self._on[url][version]

    async def unload_version(self, version: int) -> None:
        """Close the version to new requests, wait for ours on it to finish, then unload it."""
        async with self._idle:
            self._closed.add(version)
            await self._idle.wait_for(lambda: not self._holds.get(version))
        try:
            await super().unload_version(version)
        finally:
            self._closed.discard(version)

    async def _unload_on(self, url: str, version: int, _: None) -> None:
        name = self.dirs.name(version)
        try:
            # SGLang answers only after the requests holding the adapter have finished.
            await self.http.post(f"{url}/unload_lora_adapter", {"lora_name": name})
        except ServerError as e:
            if not (e.status == 400 and "does not exist" in e.message):
                raise AdapterError(f"v{version}: unloading {name!r} on {url} failed: {e}") from e
            # not registered there (a restarted server, or its LRU took it): the goal is reached
        self._on[url].pop(version, None)

    # --- servers that forgot ---
    async def missing_versions(self) -> dict[int, list[str]]:
        """Versions we loaded that a replica no longer has registered (it restarted)."""
        missing: dict[int, list[str]] = {}
        for url in self.urls:
            if not self._on[url]:
                continue
            before = list(self._on[url])
            registered = await self._listing(url, self.registered)
            gone = before if registered is None else [v for v in before if self.dirs.name(v) not in registered]
            for version in gone:
                self._on[url].pop(version, None)
                missing.setdefault(version, []).append(url)
            if gone:
                self._limits.pop(url, None)  # a restarted server may run with other limits
        return missing

    async def health(self) -> bool:
        try:
            for url in self.urls:
                await self.http.get(f"{url}/health", retry=False)
        except ServerError:
            return False
        return True

    # --- generation ---
    async def generate(self, requests: list[GenRequest], version: int) -> list[list[GenResult]]:
        async with self._idle:
            if version in self._closed:
                raise VersionNotLoaded(version, ",".join(self.urls), "being unloaded by this engine")
            self._holds[version] = self._holds.get(version, 0) + 1
        try:
            return await super().generate(requests, version)
        finally:
            async with self._idle:
                self._holds[version] -= 1
                if not self._holds[version]:
                    del self._holds[version]
                self._idle.notify_all()

    async def _generate_on(self, url: str, req: GenRequest, version: int) -> list[GenResult]:
        name = self.dirs.name(version)

        async def once() -> httpx.Response:
            rids = [uuid.uuid4().hex for _ in range(req.n)]
            try:
                return await self.http.post(f"{url}/generate", generate_body(name, req, rids), retry=False)
            except ServerError as e:
                if e.status is None:  # no answer: the server may still be running them
                    await self._abort(url, rids)
                raise
            except asyncio.CancelledError:
                await asyncio.shield(self._abort(url, rids))
                raise

        try:
            answer = await with_retries(
                once, attempts=self.http.attempts, backoff_s=self.http.backoff_s, retry_if=is_transient
            )
        except ServerError as e:
            if e.status == 400 and any(m in e.message for m in _NOT_LOADED):
                self._on[url].pop(version, None)
                raise VersionNotLoaded(version, url, e.message) from e
            raise
        return parse_generate(_json(answer), req.n, url)

    async def _abort(self, url: str, rids: list[str]) -> None:
        """Best effort: a server that does not answer has no request of ours left to hold."""
        for rid in rids:
            try:
                await self.http.post(f"{url}/abort_request", {"rid": rid}, retry=False)
            except ServerError as e:
                log.warning("sglang %s: could not abort request %s: %s", url, rid, e)
                return


def generate_body(name: str, req: GenRequest, rids: list[str]) -> dict:
    """One batch of `n` copies of the prompt, completion i seeded with seed + i (SGLang's
    `sampling_seed`) and named `rids[i]`, all on adapter `name`."""
    params = []
    for i in range(req.n):
        sp = {
            "max_new_tokens": req.max_new_tokens,
            "temperature": max(req.temperature, 0.0),
            "top_p": req.top_p,
            "top_k": req.top_k if req.top_k > 0 else -1,
            "stop_token_ids": list(req.stop_token_ids),
            "skip_special_tokens": False,
        }
        if req.seed is not None:
            sp["sampling_seed"] = (req.seed + i) & 0x7FFFFFFF
        params.append(sp)
    return {
        "input_ids": [list(req.prompt_token_ids)] * req.n,
        "sampling_params": params,
        "lora_path": [name] * req.n,
        "rid": list(rids),
        "return_logprob": True,
    }


def parse_generate(answer, n: int, url: str) -> list[GenResult]:
    outs = answer if isinstance(answer, list) else [answer]
    if len(outs) != n:
        raise ServerError(url, 200, f"asked for {n} completions, the answer has {len(outs)}")
    results = []
    for i, out in enumerate(outs):
        meta = out.get("meta_info") or {}
        lps = meta.get("output_token_logprobs")
        if lps is None:
            raise ServerError(url, 200, f"completion {i} has no meta_info.output_token_logprobs")
        ids = [int(t[1]) for t in lps]
        if out.get("output_ids") is not None and list(out["output_ids"][-len(ids) :] if ids else []) != ids:
            raise ServerError(url, 200, f"completion {i}: output_ids and output_token_logprobs disagree")
        finish = meta.get("finish_reason") or {}
        kind = finish.get("type") if isinstance(finish, dict) else finish
        results.append(
            GenResult(token_ids=ids, logprobs=[float(t[0]) for t in lps], finish_reason=_FINISH.get(str(kind), "abort"))
        )
    return results


def _json(response: httpx.Response):
    try:
        return response.json()
    except ValueError:
        return {}


def _loaded_adapters(body) -> dict[str, str]:
    if isinstance(body, dict) and isinstance(body.get("loaded_adapters"), dict):
        return body["loaded_adapters"]
    return {}


def from_config(cfg, urls: Sequence[str] | None = None) -> SglangEngine:
    """What `lorabus rollout --engine sglang` builds (`rollout.server_urls` unless `urls`)."""
    return SglangEngine.from_config(cfg, urls)
