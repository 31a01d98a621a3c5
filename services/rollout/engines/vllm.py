"""The vLLM engine: drive one or more vLLM OpenAI servers over their HTTP API.

Version N is served under the name `<lora_name>-v<N>` from its own directory; the server loads
it with `POST /v1/load_lora_adapter` (needs `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`) and requests
pick it with `model=<name>` on `/v1/completions`. Each data-parallel replica is loaded on its
own: the load endpoint reaches only the replica that answers it.

Behaviour logprobs: vLLM returns raw logprobs (`log_softmax(logits)`, no temperature) unless the
server runs with `--logprobs-mode processed_logprobs`, which `server_cmd.vllm_command` sets; then
they are `log_softmax(logits / T)` like the trainer's (greedy: T = 1), renormalised over the
top-k/top-p nucleus when those are on.

What vLLM 0.32 answers (observed against the real server): successes are plain text
(`Success: LoRA adapter '<n>' added successfully.`); errors are JSON `{"error": {"message",
"type", "code"}}`: 400 "has already been loaded", 400 "Both 'lora_name' and 'lora_path' must be
provided.", 400 "Field required" (a missing field), 404 "Loading lora <n> failed: No adapter
found for <path>" (literally `<path>`), 404 "The lora adapter '<n>' cannot be found." (unload),
500 "Call to add_lora method failed: ... 'LoRA rank 32 is greater than max_lora_rank 16.'",
404 "The model `<n>` does not exist." (generation with an unknown name).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from proto.messages import FinishReason
from services.rollout.engines.base import GenRequest, GenResult
from services.rollout.engines.http import (
    AdapterError,
    ServerEngine,
    ServerError,
    VersionNotLoaded,
)

_TOKEN_ID = re.compile(r"^token_id:(\d+)$")
_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


class VllmEngine(ServerEngine):
    name = "vllm"

    # --- versions ---
    async def _load_on(self, url: str, version: int, path: str) -> None:
        if self._on[url].get(version) == path:
            return
        name = self.dirs.name(version)
        try:
            await self.http.post(f"{url}/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
        except ServerError as e:
            if not (e.status == 400 and "has already been loaded" in e.message):
                raise AdapterError(f"v{version}: loading {name!r} from {path} on {url} failed: {e}") from e
            # Loaded before: by us (a retried request whose answer was lost, or `--lora-modules`
            # for v0) if the server reads it from our path; anything else is another adapter
            # under our name, which we must not serve as this version.
            served = (await self._served(url)).get(name)
            if not self.dirs.same_server_path(served, path):
                raise AdapterError(
                    f"v{version}: {url} already serves {name!r} from {served}, not from {path}; "
                    "a name is never reused for other weights (restart that server, or use a "
                    "new lora_name)"
                ) from e
        self._on[url][version] = path

    async def _unload_on(self, url: str, version: int, _: None) -> None:
        name = self.dirs.name(version)
        try:
            await self.http.post(f"{url}/v1/unload_lora_adapter", {"lora_name": name})
        except ServerError as e:
            # 404 "cannot be found": already gone (a restarted server); the goal is reached.
            if e.status != 404:
                raise AdapterError(f"v{version}: unloading {name!r} on {url} failed: {e}") from e
        self._on[url].pop(version, None)

    # --- servers that forgot ---
    async def _served(self, url: str) -> dict[str, str]:
        """name -> path of every adapter the replica lists in /v1/models."""
        body = (await self.http.get(f"{url}/v1/models")).json()
        return {m["id"]: m.get("root") for m in body.get("data", []) if m.get("parent") is not None}

    async def missing_versions(self) -> dict[int, list[str]]:
        """Versions we loaded that a replica no longer lists (it restarted), with those replicas.
        They are forgotten for those replicas, so `loaded_versions` and routing stop using them."""
        missing: dict[int, list[str]] = {}
        for url in self.urls:
            before = list(self._on[url])
            served = await self._listing(url, self._served)
            if served is None:  # no answer: all of it is missing there (`_listing`)
                for version in before:
                    missing.setdefault(version, []).append(url)
                continue
            for version in list(self._on[url]):
                if self.dirs.name(version) not in served:
                    del self._on[url][version]
                    missing.setdefault(version, []).append(url)
        return missing

    async def health(self) -> bool:
        try:
            for url in self.urls:
                await self.http.get(f"{url}/health", retry=False)
                await self._served(url)
        except (ServerError, ValueError, KeyError):
            return False
        return True

    # --- generation ---
    async def _generate_on(self, url: str, req: GenRequest, version: int) -> list[GenResult]:
        name = self.dirs.name(version)
        body = completion_body(name, req)
        try:
            answer = (await self.http.post(f"{url}/v1/completions", body)).json()
        except ServerError as e:
            if e.status == 404 and "does not exist" in e.message:
                self._on[url].pop(version, None)
                raise VersionNotLoaded(version, url, e.message) from e
            raise
        return parse_completion(answer, req.n, url)


def completion_body(model: str, req: GenRequest) -> dict:
    body = {
        "model": model,
        "prompt": list(req.prompt_token_ids),
        "n": req.n,
        "max_tokens": req.max_new_tokens,
        "temperature": max(req.temperature, 0.0),
        "top_p": req.top_p,
        "top_k": req.top_k if req.top_k > 0 else -1,
        "stop_token_ids": list(req.stop_token_ids),
        "logprobs": 1,
        "return_tokens_as_token_ids": True,
        "skip_special_tokens": False,
    }
    if req.seed is not None:
        body["seed"] = req.seed
    return body


def parse_completion(answer: dict, n: int, url: str) -> list[GenResult]:
    """`/v1/completions` choices -> results in index order; token ids from `token_id:<n>`."""
    choices = sorted(answer.get("choices") or [], key=lambda c: c["index"])
    if len(choices) != n:
        raise ServerError(url, 200, f"asked for n={n} completions, the answer has {len(choices)}")
    out = []
    for c in choices:
        lp = c.get("logprobs") or {}
        tokens, logprobs = lp.get("tokens"), lp.get("token_logprobs")
        if tokens is None or logprobs is None or len(tokens) != len(logprobs):
            raise ServerError(url, 200, f"choice {c['index']} has no per-token logprobs: {lp!r:.200}")
        ids = []
        for t in tokens:
            m = _TOKEN_ID.match(t)
            if not m:
                raise ServerError(url, 200, f"token {t!r} is not 'token_id:<n>' (return_tokens_as_token_ids)")
            ids.append(int(m.group(1)))
        out.append(
            GenResult(
                token_ids=ids,
                logprobs=[float(x) for x in logprobs],
                finish_reason=_FINISH.get(c.get("finish_reason"), "abort"),
            )
        )
    return out


def from_config(cfg, urls: Sequence[str] | None = None) -> VllmEngine:
    """What `lorabus rollout --engine vllm` builds (`rollout.server_urls` unless `urls`)."""
    return VllmEngine.from_config(cfg, urls)
