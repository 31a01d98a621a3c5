"""The SGLang engine: drive SGLang servers over their native HTTP API (0.5.23).

Version N is registered as `<lora_name>-v<N>` from its own directory with `POST
/load_lora_adapter {lora_name, lora_path, pinned}`; `/generate` requests name it in `lora_path`.
SGLang has no in-place reload, answers every LoRA call with `{success, error_message,
loaded_adapters}` (400 on failure), lets dynamic loading run only with dp_size 1 (so each
data-parallel replica is its own server here, loaded on its own), and waits for in-flight
requests before an unload completes.

Behaviour logprobs: SGLang's `meta_info.output_token_logprobs` are `[logprob, token_id, text]`
with logprob = log_softmax(logits / T) over the full vocabulary (greedy: T = 1), what the
trainer computes; nothing to configure.

Verified against the protocol server in tests/fixtures/sglang_server.py, not a real SGLang
(which needs CUDA).
"""

from __future__ import annotations

from collections.abc import Sequence

from proto.messages import FinishReason
from services.rollout.engines.base import GenRequest, GenResult
from services.rollout.engines.http import (
    AdapterError,
    ServerEngine,
    ServerError,
    VersionNotLoaded,
)

_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}
_NOT_LOADED = "not loaded"


class SglangEngine(ServerEngine):
    name = "sglang"

    # --- versions ---
    async def _load_on(self, url: str, version: int, path: str) -> None:
        if self._on[url].get(version) == path:
            return
        name = self.dirs.name(version)
        try:
            await self.http.post(f"{url}/load_lora_adapter", {"lora_name": name, "lora_path": path, "pinned": False})
        except ServerError as e:
            # Every failure is a 400; the answer's loaded_adapters tells "already loaded" (by
            # us, from this path: a retry whose first answer was lost, or --lora-paths for v0)
            # apart from everything else.
            served = _loaded_adapters(e.body).get(name)
            if served is None or not self.dirs.same_server_path(served, path):
                where = f" (it serves {name!r} from {served})" if served else ""
                raise AdapterError(f"v{version}: loading {name!r} from {path} on {url} failed: {e}{where}") from e
        self._on[url][version] = path

    async def _unload_on(self, url: str, version: int, _: None) -> None:
        name = self.dirs.name(version)
        try:
            # SGLang answers only after the requests holding the adapter have finished.
            await self.http.post(f"{url}/unload_lora_adapter", {"lora_name": name})
        except ServerError as e:
            if e.body is None or name in _loaded_adapters(e.body):
                raise AdapterError(f"v{version}: unloading {name!r} on {url} failed: {e}") from e
            # not registered there (a restarted server): the goal is reached
        self._on[url].pop(version, None)

    # --- servers that forgot ---
    async def missing_versions(self) -> dict[int, list[str]]:
        """Versions we loaded that a replica no longer has registered (it restarted). SGLang has
        no adapter listing; a one-token `/generate` naming the version is the probe (an evicted
        adapter is still registered: SGLang reloads it from its path, as for any request)."""
        missing: dict[int, list[str]] = {}
        for url in self.urls:
            for version in list(self._on[url]):
                body = {
                    "input_ids": [0],
                    "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                    "lora_path": self.dirs.name(version),
                }
                try:
                    await self.http.post(f"{url}/generate", body)
                except ServerError as e:
                    if e.status == 400 and _NOT_LOADED in e.message:
                        del self._on[url][version]
                        missing.setdefault(version, []).append(url)
                    else:
                        raise
        return missing

    async def health(self) -> bool:
        try:
            for url in self.urls:
                await self.http.get(f"{url}/health", retry=False)
        except ServerError:
            return False
        return True

    # --- generation ---
    async def _generate_on(self, url: str, req: GenRequest, version: int) -> list[GenResult]:
        name = self.dirs.name(version)
        try:
            answer = (await self.http.post(f"{url}/generate", generate_body(name, req))).json()
        except ServerError as e:
            if e.status == 400 and _NOT_LOADED in e.message:
                self._on[url].pop(version, None)
                raise VersionNotLoaded(version, url, e.message) from e
            raise
        return parse_generate(answer, req.n, url)


def generate_body(name: str, req: GenRequest) -> dict:
    """One batch of `n` copies of the prompt, completion i seeded with seed + i (SGLang's
    `sampling_seed`), all on adapter `name`."""
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


def _loaded_adapters(body) -> dict[str, str]:
    if isinstance(body, dict) and isinstance(body.get("loaded_adapters"), dict):
        return body["loaded_adapters"]
    return {}


def from_config(cfg, urls: Sequence[str] | None = None) -> SglangEngine:
    """What `lorabus rollout --engine sglang` builds (`rollout.server_urls` unless `urls`)."""
    return SglangEngine.from_config(cfg, urls)
