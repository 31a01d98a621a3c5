"""The decode loop and the sampler: prefill + KV-cache decode of a left-padded batch.

Torch and transformers only (the GPU benchmark imports this module alone).

Logprob definition (what the trainer must recompute): for a sampled token y at step t,
    logprob = log_softmax(logits_t / T)[y]      over the full vocabulary,
with T the request's temperature (T <= 0 means greedy decoding, and then T = 1 is used), taken
BEFORE top-p/top-k truncation. Truncation only restricts which tokens can be drawn; with
top_p = 1 and top_k = 0 the logprob is exactly that of the distribution sampled from. This is
the trainer's `log_softmax(logits / temperature)`, so behaviour and proximal logprobs agree.

Sampling is Gumbel-max over a counter-based hash of (row seed, step, token id), so a row's
tokens depend only on its seed and its logits: not on batch composition, row order or device
RNG state. That makes generation reproducible with a seed, also for rows batched differently.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ContextManager

import torch
from transformers import DynamicCache, PreTrainedModel

_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # < 2**27: (x < 2**32) * _MUL stays far below int64 overflow


@dataclass(frozen=True)
class Row:
    """One sequence to generate."""

    prompt: Sequence[int]
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_ids: tuple[int, ...] = ()
    seed: int = 0


@dataclass
class RowOutput:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "length"


def mix32(x: int) -> int:
    """The integer hash used for seeds, in plain Python (same function as `_mix32`)."""
    x &= _M32
    for _ in range(2):
        x = ((x ^ (x >> 16)) * _MUL) & _M32
    return x ^ (x >> 16)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    for _ in range(2):
        x = ((x ^ (x >> 16)) * _MUL) & _M32
    return x ^ (x >> 16)


def gumbel_noise(seeds: torch.Tensor, step: int, vocab_hash: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] standard Gumbel noise, a pure function of (seed, step, token)."""
    row_key = _mix32((seeds + step * 0x9E3779B1) & _M32)
    bits = _mix32(row_key[:, None] ^ vocab_hash[None, :])
    u = ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    return -torch.log(-torch.log(u))


def truncate(scaled: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Set logits outside each row's top-k / top-p nucleus to -inf (top-1 always survives)."""
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
    rank = torch.arange(scaled.shape[-1], device=scaled.device)[None, :]
    drop = (before > top_p[:, None]) | ((top_k[:, None] > 0) & (rank >= top_k[:, None]))
    drop[:, 0] = False
    return scaled.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    seeds: torch.Tensor,
    step: int,
    vocab_hash: torch.Tensor,
    needs_truncation: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and their logprobs (see the module docstring) for one decode step."""
    logits = logits.float()
    greedy = temperature <= 0
    scaled = logits / torch.where(greedy, 1.0, temperature)[:, None]
    logp = scaled.log_softmax(dim=-1)
    pool = truncate(scaled, top_p, top_k) if needs_truncation else scaled
    drawn = (pool + gumbel_noise(seeds, step, vocab_hash)).argmax(dim=-1)
    tokens = torch.where(greedy, scaled.argmax(dim=-1), drawn)
    return tokens, logp.gather(-1, tokens[:, None])[:, 0]


def _cache_kwarg(model: torch.nn.Module) -> str:
    """transformers renamed `past_key_values` to `cache` (5.2x); use what this one takes."""
    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            params = inspect.signature(module.forward).parameters
            return "cache" if "cache" in params else "past_key_values"
    return "past_key_values"


@torch.inference_mode()
def decode(
    model: torch.nn.Module,
    rows: Sequence[Row],
    *,
    pad_id: int = 0,
    step_context: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
    check_every: int = 8,
    forward_kwargs: dict[str, Any] | None = None,
) -> list[RowOutput]:
    """Generate every row in one batch. `step_context()` wraps each forward (the engine uses it
    to hold its lock and route rows to their LoRA versions)."""
    if not rows:
        return []
    for i, row in enumerate(rows):
        if not row.prompt:
            raise ValueError(f"rows[{i}].prompt: empty; a prompt needs at least one token")
        if row.max_new_tokens < 1:
            raise ValueError(f"rows[{i}].max_new_tokens: {row.max_new_tokens} must be >= 1")
    device = next(model.parameters()).device
    b, width = len(rows), max(len(r.prompt) for r in rows)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    mask = torch.zeros((b, width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row.prompt):] = torch.tensor(list(row.prompt), dtype=torch.long)
        mask[i, width - len(row.prompt):] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)

    temperature = torch.tensor([r.temperature for r in rows], dtype=torch.float32, device=device)
    top_p = torch.tensor([r.top_p for r in rows], dtype=torch.float32, device=device)
    top_k = torch.tensor([r.top_k for r in rows], dtype=torch.long, device=device)
    seeds = torch.tensor([r.seed & _M32 for r in rows], dtype=torch.long, device=device)
    max_new = torch.tensor([r.max_new_tokens for r in rows], dtype=torch.long, device=device)
    width_stop = max([len(r.stop_ids) for r in rows] + [1])
    stops = torch.full((b, width_stop), -1, dtype=torch.long)
    for i, row in enumerate(rows):
        stops[i, : len(row.stop_ids)] = torch.tensor(row.stop_ids, dtype=torch.long)
    stops = stops.to(device)
    needs_truncation = any(r.top_p < 1.0 or r.top_k > 0 for r in rows)
    steps = max(r.max_new_tokens for r in rows)

    cache_arg = {_cache_kwarg(model): DynamicCache(config=model.config)}
    extra = forward_kwargs or {}
    vocab_hash: torch.Tensor | None = None
    tokens = torch.zeros((b, steps), dtype=torch.long, device=device)
    logprobs = torch.zeros((b, steps), dtype=torch.float32, device=device)
    length = torch.zeros(b, dtype=torch.long, device=device)  # 0 = still running
    stopped = torch.zeros(b, dtype=torch.bool, device=device)
    step_ids, step_pos, attn = ids, positions, mask
    for t in range(steps):
        with step_context():
            out = model(
                input_ids=step_ids, attention_mask=attn, position_ids=step_pos,
                use_cache=True, logits_to_keep=1, **cache_arg, **extra,
            )
        logits = out.logits[:, -1]
        if vocab_hash is None:
            vocab_hash = _mix32(torch.arange(logits.shape[-1], dtype=torch.long, device=device))
        tok, lp = sample(logits, temperature, top_p, top_k, seeds, t, vocab_hash, needs_truncation)
        tokens[:, t], logprobs[:, t] = tok, lp
        running = length == 0
        hit_stop = (tok[:, None] == stops).any(-1) & running
        hit_len = (max_new == t + 1) & running
        stopped |= hit_stop
        length = torch.where(hit_stop | hit_len, t + 1, length)
        if (t + 1) % check_every == 0 or t + 1 == steps:
            if bool((length > 0).all()):
                break
        step_ids = tok[:, None]
        step_pos = step_pos[:, -1:] + 1
        attn = torch.cat([attn, attn.new_ones((b, 1))], dim=1)
    tokens_l, logprobs_l = tokens.tolist(), logprobs.tolist()
    lengths, stopped_l = length.tolist(), stopped.tolist()
    return [
        RowOutput(
            token_ids=tokens_l[i][: lengths[i]],
            logprobs=logprobs_l[i][: lengths[i]],
            finish_reason="stop" if stopped_l[i] else "length",
        )
        for i in range(b)
    ]
