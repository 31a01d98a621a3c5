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

Two ways to run the forward steps, same sampler and bookkeeping:
- dynamic (default): transformers' DynamicCache, one eager forward per step. Any model.
- static (`graphs=DecodeGraphs(model, ...)`): a preallocated StaticCache and fixed input
  buffers, so the one-token step has fixed shapes and addresses; on CUDA it is captured once
  per (batch, cache length, step variant) as a CUDA graph and replayed. A decode step of a
  1.5B model is ~1500 small kernels, so eager decoding is bound by Python/launch overhead,
  not by the GPU; a replay launches them all at once.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel, StaticCache

from proto.messages import FinishReason
from services.rollout import (
    decode_attention,
    decoder_layer,
    fused_norm,
    kv_write,
    lora_kernels,
    rope_kernel,
    sample_kernel,
    swiglu_kernel,
)

log = logging.getLogger(__name__)

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
    finish_reason: FinishReason = "length"


def mix32(x: int) -> int:
    """The integer hash used for seeds, in plain Python (same function as `_mix32`)."""
    x &= _M32
    for _ in range(2):
        x = ((x ^ (x >> 16)) * _MUL) & _M32
    return x ^ (x >> 16)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """`mix32` on int32 tensors holding uint32 bit patterns: the product wraps mod 2**32 as the
    hash needs, and the shifts are made logical by masking (int32 shifts are arithmetic). Half
    the bytes of int64 over [rows, vocab], which is what a decode step's sampling reads."""
    for _ in range(2):
        x = (x ^ ((x >> 16) & 0xFFFF)) * _MUL
    return x ^ ((x >> 16) & 0xFFFF)


def vocab_hashes(vocab: int, device: torch.device) -> torch.Tensor:
    """The per-token half of the noise's hash (computed once per decode)."""
    return _mix32(torch.arange(vocab, dtype=torch.int32, device=device))


def row_keys(seeds: torch.Tensor, step: int | torch.Tensor) -> torch.Tensor:
    """Each row's int32 half of the noise's hash; `step` is one for the batch or each row's own
    ([rows]: rows that started at different times)."""
    return _mix32(((seeds + step * 0x9E3779B1) & _M32).to(torch.int32))


def gumbel_noise(seeds: torch.Tensor, step: int | torch.Tensor, vocab_hash: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] standard Gumbel noise, a pure function of (seed, step, token)."""
    bits = _mix32(row_keys(seeds, step)[:, None] ^ vocab_hash[None, :])
    u = (((bits >> 8) & 0xFFFFFF).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
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
    step: int | torch.Tensor,
    vocab_hash: torch.Tensor,
    needs_truncation: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and their logprobs (see the module docstring) for one decode step; on a GPU without
    truncation, one fused pass over the logits (`sample_kernel`)."""
    if not needs_truncation and fused_sampler_available(logits.device):
        try:
            return sample_kernel.sample_fused(logits, temperature, row_keys(seeds, step))
        except Exception as exc:  # a Triton that cannot build it: torch's path, said once
            lora_kernels.give_up(_FUSED_BROKEN, exc, "fused sampler", "sampling in torch")
    logits = logits.float()
    greedy = temperature <= 0
    scaled = logits / torch.where(greedy, 1.0, temperature)[:, None]
    logp = scaled.log_softmax(dim=-1)
    pool = truncate(scaled, top_p, top_k) if needs_truncation else scaled
    drawn = (pool + gumbel_noise(seeds, step, vocab_hash)).argmax(dim=-1)
    tokens = torch.where(greedy, scaled.argmax(dim=-1), drawn)
    return tokens, logp.gather(-1, tokens[:, None])[:, 0]


def _cache_kwarg(model: PreTrainedModel) -> str:
    """transformers renamed `past_key_values` to `cache` (5.2x); use what this one takes."""
    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            params = inspect.signature(module.forward).parameters
            return "cache" if "cache" in params else "past_key_values"
    return "past_key_values"


class DecodeGraphs:
    """Static KV caches and captured decode steps of one model, reused across `decode` calls.

    A state (cache + input buffers + graphs) is keyed by (batch, cache length); the cache
    length is rounded up to `length_multiple` so prompts of similar length share one. A state
    is used by one decode at a time. Idle ones are kept, the most recently used first, while
    their caches together take at most `max_idle_bytes`, and the last one released always: a
    state dropped is a capture to make again, and a fleet replica's rounds cycle through a
    dozen batch classes of small caches (with four kept, the H100 fleet of 8 runs made 162 in
    125 s), while one large batch repeated keeps its own however large.
    `capture=False` runs the same static steps eagerly (CPU; tests of this path).
    `grouped_attention` (default) switches the model to `decode_attention`, whose one-token step
    reads the cache without repeating K/V per query head; `fused_norms` (default) puts
    `fused_norm.RMSNorm` in place of the model's equal RMSNorms. False keeps the model's own.
    `fused_kv_write` (default) writes each layer's keys and values into the cache with
    `kv_write`'s kernel where Triton runs (a cache of this object's, not a change to the model);
    `fused_mlp` (default) computes each gated MLP's `silu(gate) * up` with `swiglu_kernel`'s;
    `fused_residual` (default) gives each decoder layer `decoder_layer`'s forward (its residual
    adds fused with the norm and the LoRA corrections around them).
    `pad_batches` (default: where graphs are captured) makes `batch_size` round a batch up to
    its size class.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        capture: bool,
        max_idle_bytes: int = 2 << 30,
        length_multiple: int = 64,
        grouped_attention: bool = True,
        fused_norms: bool = True,
        fused_rope: bool = True,
        fused_kv_write: bool = True,
        fused_mlp: bool = True,
        fused_residual: bool = True,
        pad_batches: bool | None = None,
    ):
        reason = static_unsupported(model)
        if reason:
            raise ValueError(f"static decoding: {reason}")
        if capture and not torch.cuda.is_available():
            raise ValueError("capture: CUDA graphs need a CUDA device; pass capture=False")
        prepare(
            model,
            grouped_attention=grouped_attention,
            fused_norms=fused_norms,
            fused_rope=fused_rope,
            fused_mlp=fused_mlp,
            fused_residual=fused_residual,
        )
        self.model = model
        self.capture = capture
        self.max_idle_bytes = max_idle_bytes
        self.length_multiple = length_multiple
        self.fused_kv_write = fused_kv_write
        self.pad_batches = capture if pad_batches is None else pad_batches
        self.captures = 0
        """graphs captured so far (for tests and metrics)"""
        self.caches_made = 0
        """static caches allocated so far (idle ones beyond `max_idle_bytes` are dropped)"""
        self._idle: list[_State] = []

    def batch_size(self, rows: int) -> int:
        """The batch that `rows` rows decode in: with `pad_batches` the smallest size class
        (2^k or 3 * 2^k) that holds them, so batches of nearby sizes share one static cache and
        its graphs instead of each size capturing its own (a graphed decode step reads the
        weights once for all its rows, so idle rows cost little, at most a third of the batch;
        the common batch_groups x n_samples products are classes themselves); else `rows`, as
        an eager step pays for every row."""
        if not self.pad_batches or rows <= 2:
            return rows
        power = 1 << (rows - 1).bit_length()
        return power * 3 // 4 if rows <= power * 3 // 4 else power

    def acquire(self, batch: int, need: int) -> _State:
        length = -(-need // self.length_multiple) * self.length_multiple
        for i, state in enumerate(self._idle):
            if state.key == (batch, length):
                return self._idle.pop(i)
        self.caches_made += 1
        # each new cache is captured afresh on a GPU: many of these mean batches that do not
        # share their size class (benchmarks/multi_run.py counts these lines)
        log.info("decode: static cache %d made, %d rows x %d positions", self.caches_made, batch, length)
        return _State(self.model, batch, length, fused_kv_write=self.fused_kv_write)

    def release(self, state: _State) -> None:
        self._idle.append(state)
        kept, total = 1, state.nbytes()
        for older in reversed(self._idle[:-1]):
            total += older.nbytes()
            if total > self.max_idle_bytes:
                break
            kept += 1
        del self._idle[: len(self._idle) - kept]


def prepare(
    model: PreTrainedModel,
    *,
    grouped_attention: bool = True,
    fused_norms: bool = True,
    fused_rope: bool = True,
    fused_mlp: bool = True,
    fused_residual: bool = True,
) -> None:
    """Make `model` ready for the static decode paths (this module's and `continuous`'s):
    `decode_attention` for the one-token step, `fused_norm` in place of its RMSNorms,
    `rope_kernel` for its rotary embedding, `swiglu_kernel` for its gated MLPs and
    `decoder_layer` for its residual adds where Triton runs."""
    if grouped_attention:
        decode_attention.use(model)
    if fused_norms:
        fused_norm.fuse(model)
    if fused_rope:
        rope_kernel.use(model)
    if fused_mlp:
        swiglu_kernel.use(model)
    if fused_residual:
        # after the norms: the fused add reads the weight of `fused_norm`'s module
        decoder_layer.use(model)


def static_unsupported(model: PreTrainedModel) -> str | None:
    """Why the static path cannot run this model, or None. It passes its own 4D additive
    mask, which transformers uses as is for full attention under sdpa/eager only."""
    cfg = model.config
    impl = getattr(cfg, "_attn_implementation", None) or "eager"
    if impl not in ("sdpa", "eager", decode_attention.NAME):
        return f"attention implementation {impl!r}; the static path needs 'sdpa' or 'eager'"
    kinds = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        return f"layer types {sorted(kinds)}; the static path supports full attention only"
    return None


class _State:
    def __init__(self, model: PreTrainedModel, batch: int, length: int, fused_kv_write: bool = False):
        device = next(model.parameters()).device
        self.key = (batch, length)
        # where the kernel cannot run (CPU) transformers' own cache, unchanged
        fused = fused_kv_write and kv_write.available(device)
        self.cache = (kv_write.FusedStaticCache if fused else StaticCache)(config=model.config, max_cache_len=length)
        self.ids = torch.zeros((batch, 1), dtype=torch.long, device=device)
        self.pos = torch.zeros((batch, 1), dtype=torch.long, device=device)
        self.mask = torch.zeros((batch, 1, 1, length), dtype=model.dtype, device=device)
        self.graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.first_step_s: dict[Hashable, float] = {}
        """each variant's first step, eager (it warms the kernels up before the capture), in seconds"""

    def nbytes(self) -> int:
        """What the cache's keys and values take (its layers allocate on their first write)."""
        tensors = (getattr(layer, name, None) for layer in self.cache.layers for name in ("keys", "values"))
        return sum(t.nbytes for t in tensors if isinstance(t, torch.Tensor))

    def rewind(self) -> None:
        """Empty the cache in place (its tensors keep their addresses for the graphs); stale
        keys and values stay, masked out."""
        for layer in self.cache.layers:
            # a StaticLayer's (static_unsupported admits full attention only); not named, as
            # transformers < 4.56 has no cache layers and does not reach here
            length = getattr(layer, "cumulative_length", None)
            if getattr(layer, "is_initialized", False) and length is not None:
                length.zero_()


def _forward(model, cache_arg: dict, extra: dict, **inputs) -> torch.Tensor:
    out = model(**inputs, use_cache=True, logits_to_keep=1, **cache_arg, **extra)
    return out.logits[:, -1]


_FUSED_BROKEN: list[str] = []
"""why the fused sampler failed in this process (then it is not tried again)"""


def fused_sampler_available(device: torch.device) -> bool:
    """Triton on a CUDA device, or Triton's interpreter (TRITON_INTERPRET=1: tests on CPU);
    LORABUS_FUSED_SAMPLER=0 turns it off."""
    if sample_kernel.triton is None or _FUSED_BROKEN or os.environ.get("LORABUS_FUSED_SAMPLER") == "0":
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


@torch.inference_mode()
def decode(
    model: PreTrainedModel,
    rows: Sequence[Row],
    *,
    pad_id: int = 0,
    step_context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    check_every: int = 8,
    forward_kwargs: dict[str, Any] | None = None,
    graphs: DecodeGraphs | None = None,
) -> list[RowOutput]:
    """Generate every row in one batch. `step_context()` wraps each forward (the engine uses it
    to hold its lock and route rows to their LoRA versions); what it yields names the step's
    variant (e.g. "LoRA correction on"): the static path keeps one graph per variant."""
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
        ids[i, width - len(row.prompt) :] = torch.tensor(list(row.prompt), dtype=torch.long)
        mask[i, width - len(row.prompt) :] = 1
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

    extra = forward_kwargs or {}
    cache_kw = _cache_kwarg(model)
    if graphs is None:
        stepper: _Dynamic | _Static = _Dynamic(model, {cache_kw: DynamicCache(config=model.config)}, extra, mask)
    else:
        stepper = _Static(graphs, graphs.acquire(b, width + steps), cache_kw, extra, mask)
    vocab_hash: torch.Tensor | None = None
    tokens = torch.zeros((b, steps), dtype=torch.long, device=device)
    logprobs = torch.zeros((b, steps), dtype=torch.float32, device=device)
    length = torch.zeros(b, dtype=torch.long, device=device)  # 0 = still running
    stopped = torch.zeros(b, dtype=torch.bool, device=device)
    tok = ids
    try:
        for t in range(steps):
            with step_context() as variant:
                logits = stepper.prefill(ids, positions) if t == 0 else stepper.step(tok, variant)
            if vocab_hash is None:
                vocab_hash = vocab_hashes(logits.shape[-1], device)
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
    finally:
        stepper.close()
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


class _Dynamic:
    """DynamicCache, 2D padding mask grown by one column per step, eager forwards."""

    def __init__(self, model, cache_arg: dict, extra: dict, mask: torch.Tensor):
        self.model, self.cache_arg, self.extra, self.attn = model, cache_arg, extra, mask
        self.pos: torch.Tensor  # set by prefill, which comes first

    def prefill(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.pos = positions[:, -1:]
        return _forward(
            self.model, self.cache_arg, self.extra, input_ids=ids, attention_mask=self.attn, position_ids=positions
        )

    def step(self, tok: torch.Tensor, variant: Hashable) -> torch.Tensor:
        self.pos = self.pos + 1
        self.attn = torch.cat([self.attn, self.attn.new_ones((self.attn.shape[0], 1))], dim=1)
        return _forward(
            self.model,
            self.cache_arg,
            self.extra,
            input_ids=tok[:, None],
            attention_mask=self.attn,
            position_ids=self.pos,
        )

    def close(self) -> None:
        pass


class _Static:
    """StaticCache and fixed buffers: ids [b, 1], positions [b, 1], additive mask [b, 1, 1, L].
    The first step of each variant runs eagerly (it warms the kernels up); later steps of that
    variant replay its graph, captured on first need."""

    def __init__(self, graphs: DecodeGraphs, state: _State, cache_kw: str, extra: dict, mask: torch.Tensor):
        self.graphs, self.state = graphs, state
        self.cache_arg, self.extra = {cache_kw: state.cache}, extra
        self.width = mask.shape[1]
        self.t = 0
        state.rewind()
        neg = torch.finfo(state.mask.dtype).min
        keep = torch.zeros_like(state.mask[:, 0, 0], dtype=torch.bool)
        keep[:, : self.width] = mask.bool()
        self.keep = keep
        # key j is visible to query i of the prompt if j <= i and j is not padding
        causal = torch.ones(self.width, keep.shape[1], dtype=torch.bool, device=keep.device).tril()
        self.prefill_mask = torch.where(causal[None] & keep[:, None, :], 0.0, neg).to(state.mask.dtype)[:, None]
        state.mask.copy_(torch.where(keep, 0.0, neg)[:, None, None, :])

    def prefill(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.state.pos.copy_(positions[:, -1:])
        return _forward(
            self.graphs.model,
            self.cache_arg,
            self.extra,
            input_ids=ids,
            attention_mask=self.prefill_mask,
            position_ids=positions,
        )

    def step(self, tok: torch.Tensor, variant: Hashable) -> torch.Tensor:
        st = self.state
        self.t += 1
        st.ids.copy_(tok[:, None])
        st.pos.add_(1)
        st.mask[:, :, :, self.width + self.t - 1] = 0.0
        if not self.graphs.capture:
            return self._eager()
        if variant not in st.first_step_s:
            t0 = time.perf_counter()
            logits = self._eager()
            torch.cuda.synchronize(logits.device)  # once per state and variant
            st.first_step_s[variant] = time.perf_counter() - t0
            return logits
        if variant not in st.graphs:
            t0 = time.perf_counter()
            st.graphs[variant] = self._capture()
            self.graphs.captures += 1
            # the first step's time holds what the kernels compiled for this shape: a fleet's
            # start-up is made of these (benchmarks/multi_run.py keeps the replicas' logs)
            log.info(
                "decode: graph %d captured for %d rows x %d positions in %.0f ms; first step %.0f ms eager",
                self.graphs.captures, *st.key, (time.perf_counter() - t0) * 1e3, st.first_step_s[variant] * 1e3,
            )  # fmt: skip
        graph, logits = st.graphs[variant]
        graph.replay()
        return logits

    def _eager(self) -> torch.Tensor:
        st = self.state
        return _forward(
            self.graphs.model, self.cache_arg, self.extra, input_ids=st.ids, attention_mask=st.mask, position_ids=st.pos
        )

    def _capture(self) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Capture records without running, so the cache is not advanced here; the caller
        # replays right after. thread_local: another decode thread's sampling kernels may run
        # meanwhile (this one holds the engine lock, so no weight or slot changes can).
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            logits = self._eager()
        return graph, logits

    def close(self) -> None:
        self.graphs.release(self.state)
