"""What every rollout engine (embedded, vLLM server, SGLang server) offers the service.

The service owns version pinning and reference counting (`services.rollout.versions`); an
engine only holds named versions and generates with the one it is told to use.
"""

from __future__ import annotations

from typing import Protocol

import msgspec
from torch import Tensor

from proto.messages import FinishReason, LoraSpec


class GenRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One prompt and how to sample `n` completions of it."""

    prompt_token_ids: list[int]
    n: int = 1
    max_new_tokens: int = 16
    temperature: float = 1.0
    """<= 0: greedy"""
    top_p: float = 1.0
    top_k: int = 0
    """0: no top-k"""
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    """in addition to the model's eos ids"""
    seed: int | None = None
    """same seed, same prompt, same version -> same completions; None: random"""

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("prompt_token_ids: empty; a prompt needs at least one token")
        if self.n < 1:
            raise ValueError(f"n: {self.n} must be >= 1")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: {self.max_new_tokens} must be >= 1")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p: {self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k: {self.top_k} must be >= 0 (0 disables it)")


class GenResult(msgspec.Struct, frozen=True, kw_only=True):
    """One completion: sampled ids, their behaviour logprobs under the distribution sampled
    from (log_softmax(logits / temperature), see `services.rollout.sampling`), and why it ended."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason


class Engine(Protocol):
    async def load_version(self, version: int, weights: bytes | dict[str, Tensor], lora: LoraSpec) -> None: ...

    async def unload_version(self, version: int) -> None: ...

    async def generate(self, requests: list[GenRequest], version: int) -> list[list[GenResult]]:
        """One list of `request.n` results per request, in order."""
        ...

    async def loaded_versions(self) -> list[int]: ...

    async def health(self) -> bool: ...

    async def close(self) -> None: ...
