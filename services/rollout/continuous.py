"""Continuous batching: one decode loop over a fixed slab of rows, groups admitted as rows free up.

`decode` (sampling.py) runs a batch until its longest row ends; a row that stops early idles in
it, and a request that arrives meanwhile waits for the whole batch. Here a decoder thread owns a
`SlabCache` of `rows` rows and repeats: admit waiting groups into free rows (one prefill per
group, its prompt's keys and values copied to the group's other rows; a prompt longer than
`prefill_chunk` is prefilled a chunk per turn, so the rows already decoding are not stalled for
its whole prefill), run one decode step of
the whole slab (fixed shapes: one CUDA graph per routing variant, as in `DecodeGraphs`), sample
every row, and every `check_every` steps hand back the groups whose rows have all finished and
free their rows. A group is what one request is: a prompt, its n rows (own seeds), one version.

Invariants: a row's tokens are those `decode` gives it alone, whatever shares the slab and
whenever it was admitted (the sampler's noise is a function of the row's seed and its own step,
and every row attends to its own keys only); a group is answered once, with its results or with
the error that stopped the loop; rows of a finished row are never read (its length freezes);
a prompt prefilled in chunks leaves the same keys and values as one prefill (each chunk's
queries see every earlier position of the prompt and their own causal prefix).

`step_context(versions)` wraps every forward, as in `decode` (the engine holds its lock and
routes each row to its LoRA version there; what it yields names the graph variant).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel

from services.rollout.sampling import (
    _M32,
    Row,
    RowOutput,
    _cache_kwarg,
    prepare,
    sample,
    static_unsupported,
    vocab_hashes,
)
from services.rollout.slab_cache import SlabCache

log = logging.getLogger(__name__)

StepContext = Callable[[Sequence[int]], contextlib.AbstractContextManager[Any]]


@dataclass
class Group:
    """One request's rows (same prompt) on one version, and where its answer goes (called on
    the decoder thread: with the outputs in row order, or with the exception)."""

    rows: Sequence[Row]
    version: int
    done: Callable[[list[RowOutput] | BaseException], None]


@dataclass
class Prefill:
    """A group admitted into its rows whose prompt is not all in the cache yet."""

    group: Group
    slots: list[int]
    done: int = 0
    """prompt tokens in the first slot's cache so far"""


class ContinuousDecoder:
    def __init__(
        self,
        model: PreTrainedModel,
        *,
        rows: int,
        length: int,
        step_context: StepContext,
        free_version: Callable[[], int],
        capture: bool,
        check_every: int = 4,
        prefill_chunk: int = 0,
    ):
        if rows < 1 or length < 2:
            raise ValueError(f"rows: {rows}, length: {length}; a slab needs rows >= 1 and length >= 2")
        if prefill_chunk < 0:
            raise ValueError(
                f"rollout.prefill_chunk: {prefill_chunk} must be >= 0 (0: a prompt is prefilled in one forward)"
            )
        reason = static_unsupported(model)
        if reason:
            raise ValueError(f"continuous batching: {reason}")
        if capture and not torch.cuda.is_available():
            raise ValueError("capture: CUDA graphs need a CUDA device; pass capture=False")
        prepare(model)
        device = next(model.parameters()).device
        self.model, self.rows, self.length = model, rows, length
        self.step_context, self.free_version = step_context, free_version
        self.capture, self.check_every, self.prefill_chunk = capture, check_every, prefill_chunk
        self.cache = SlabCache(model.config, rows, length, device, model.dtype)
        self._cache_arg = {_cache_kwarg(model): self.cache}
        z = torch.zeros(rows, device=device)
        self.temperature, self.top_p = z.clone(), z.clone()
        self.top_k, self.seeds, self.steps, self.max_new = (z.long() for _ in range(4))
        self.stops = torch.full((rows, 1), -1, dtype=torch.long, device=device)
        self.running = torch.zeros(rows, dtype=torch.bool, device=device)
        """admitted and not finished: these rows advance"""
        self.stopped = torch.zeros(rows, dtype=torch.bool, device=device)
        self.tokens = torch.zeros((rows, length), dtype=torch.long, device=device)
        self.logprobs = torch.zeros((rows, length), dtype=torch.float32, device=device)
        self.ids = torch.zeros((rows, 1), dtype=torch.long, device=device)
        self.pos = torch.zeros((rows, 1), dtype=torch.long, device=device)
        self.mask = torch.zeros((rows, 1, 1, length), dtype=model.dtype, device=device)
        self.vocab_hash: torch.Tensor | None = None
        self.graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.warm: set[Hashable] = set()
        self.captures = 0
        self.steps_run = 0
        """decode steps of the slab so far (for tests and metrics)"""
        self._owner: list[tuple[Group, int] | None] = [None] * rows  # (group, its row index)
        self._outputs: dict[int, list[RowOutput | None]] = {}
        self._truncating: set[int] = set()  # rows that need top-p/top-k
        self._pending: Prefill | None = None
        self.prefill_forwards = 0
        """prefill forwards so far, a chunk each (for tests and metrics)"""
        self._queue: deque[Group] = deque()
        self._wake = threading.Condition()
        self._closed = False

    # --- the caller's side (any thread) ---
    def submit(self, group: Group) -> None:
        """Queue a group; raises ValueError when it can never fit the slab."""
        rows = group.rows
        if not rows:
            raise ValueError("rows: empty; a group needs at least one row")
        if len(rows) > self.rows:
            raise ValueError(f"n: {len(rows)} rows, more than the slab's {self.rows}; lower n or raise the slab")
        for i, row in enumerate(rows):
            if not row.prompt:
                raise ValueError(f"rows[{i}].prompt: empty; a prompt needs at least one token")
            if row.max_new_tokens < 1:
                raise ValueError(f"rows[{i}].max_new_tokens: {row.max_new_tokens} must be >= 1")
            if list(row.prompt) != list(rows[0].prompt):
                raise ValueError(f"rows[{i}].prompt: differs from rows[0]; a group shares one prompt")
            need = len(row.prompt) + row.max_new_tokens
            if need > self.length:
                raise ValueError(
                    f"rows[{i}]: prompt {len(row.prompt)} + max_new_tokens {row.max_new_tokens} = {need} "
                    f"tokens, more than the slab's length {self.length}; shorten them or raise the length"
                )
        with self._wake:
            if self._closed:
                raise RuntimeError("the decoder is closed")
            self._queue.append(group)
            self._wake.notify()

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()

    # --- the decoder thread ---
    def run(self) -> None:
        """The loop: until `close`, then it answers every group left with an error."""
        while True:
            with self._wake:
                while not self._closed and not self._queue and not self._busy():
                    self._wake.wait()
                if self._closed:
                    break
            try:
                with torch.inference_mode():
                    self._admit()
                    for _ in range(self.check_every):
                        if not self._busy():
                            break
                        self._step()
                    self._retire()
            except Exception as exc:  # every waiting caller hears it; the loop goes on
                log.exception("continuous decoder: a step failed; failing the groups it held")
                self._fail_all(exc)
        self._fail_all(RuntimeError("the decoder was closed before this group finished"))

    def _busy(self) -> bool:
        return any(owner is not None for owner in self._owner)

    def _free_rows(self) -> list[int]:
        return [r for r, owner in enumerate(self._owner) if owner is None]

    def _pending_row(self, owner: tuple[Group, int] | None) -> bool:
        return owner is not None and self._pending is not None and owner[0] is self._pending.group

    def _decoding(self) -> bool:
        """Whether rows other than the pending prefill's are held (so decode steps are due)."""
        return any(owner is not None and not self._pending_row(owner) for owner in self._owner)

    def _admit(self) -> None:
        """Admit waiting groups while their rows are free. A chunked prompt takes one chunk per
        turn while other rows decode, and its chunks back to back when none do."""
        while True:
            if self._pending is not None:
                self._prefill_chunk(self._pending)
                if self._pending is not None and self._decoding():
                    return
                continue
            with self._wake:
                if not self._queue or len(self._queue[0].rows) > len(self._free_rows()):
                    return
                group = self._queue.popleft()
            slots = self._free_rows()[: len(group.rows)]
            for j, s in enumerate(slots):  # held from now on: later groups take other rows
                self._owner[s] = (group, j)
            self._outputs[id(group)] = [None] * len(slots)
            self._pending = Prefill(group, slots)

    def _prefill_chunk(self, pending: Prefill) -> None:
        """The next chunk of `pending`'s prompt into its first row; once the prompt is all in,
        the group's other rows copy it and every row samples its first token."""
        group, slots = pending.group, pending.slots
        prompt = group.rows[0].prompt
        p, start, device = len(prompt), pending.done, self.ids.device
        end = min(p, start + self.prefill_chunk) if self.prefill_chunk else p
        ids = torch.tensor([list(prompt[start:end])], dtype=torch.long, device=device)
        # query i stands at position start + i and sees keys 0 .. start + i
        neg = torch.finfo(self.mask.dtype).min
        mask = torch.full((end - start, end), neg, dtype=self.mask.dtype, device=device).triu(start + 1)[None, None]
        self.cache.row_mode(slots[0], start)
        try:
            with self.step_context([group.version]):
                out = self.model(
                    input_ids=ids, position_ids=torch.arange(start, end, device=device)[None], attention_mask=mask,
                    use_cache=True, logits_to_keep=1, **self._cache_arg,
                )  # fmt: skip
        finally:
            self.cache.row_mode(None)
        self.prefill_forwards += 1
        pending.done = end
        # a decode step in between writes every row at its length: here, where the next chunk starts
        self.cache.lengths[slots[0]] = end
        if end < p:
            return
        self._pending = None
        for s in slots[1:]:
            self.cache.copy_prefix(slots[0], s, p)
        index = torch.tensor(slots, dtype=torch.long, device=device)
        self._set_rows(index, group.rows)
        self.cache.lengths[index] = p
        self._sample(out.logits[:, -1].expand(len(slots), -1), index)

    def _set_rows(self, index: torch.Tensor, rows: Sequence[Row]) -> None:
        width = max(len(r.stop_ids) for r in rows)
        if width > self.stops.shape[1]:
            grown = torch.full((self.rows, width), -1, dtype=torch.long, device=self.stops.device)
            grown[:, : self.stops.shape[1]] = self.stops
            self.stops = grown
        stops = torch.full((len(rows), self.stops.shape[1]), -1, dtype=torch.long)
        for j, row in enumerate(rows):
            stops[j, : len(row.stop_ids)] = torch.tensor(row.stop_ids, dtype=torch.long)
        dev = index.device
        self.stops[index] = stops.to(dev)
        self.temperature[index] = torch.tensor([r.temperature for r in rows], dtype=torch.float32, device=dev)
        self.top_p[index] = torch.tensor([r.top_p for r in rows], dtype=torch.float32, device=dev)
        self.top_k[index] = torch.tensor([r.top_k for r in rows], dtype=torch.long, device=dev)
        self.seeds[index] = torch.tensor([r.seed & _M32 for r in rows], dtype=torch.long, device=dev)
        self.max_new[index] = torch.tensor([r.max_new_tokens for r in rows], dtype=torch.long, device=dev)
        self.steps[index] = 0
        self.running[index] = True
        self.stopped[index] = False
        for s, row in zip(index.tolist(), rows):
            if row.top_p < 1.0 or row.top_k > 0:
                self._truncating.add(s)

    def _sample(self, logits: torch.Tensor, index: torch.Tensor | None = None) -> None:
        """Sample the rows `index` (None: the whole slab) from their logits and advance them."""
        if self.vocab_hash is None:
            self.vocab_hash = vocab_hashes(logits.shape[-1], logits.device)
        sel: Any = slice(None) if index is None else index
        running, steps = self.running[sel], self.steps[sel]
        tok, lp = sample(
            logits, self.temperature[sel], self.top_p[sel], self.top_k[sel], self.seeds[sel], steps,
            self.vocab_hash, bool(self._truncating),
        )  # fmt: skip
        rows = torch.arange(self.rows, device=logits.device)[sel]
        self.tokens[rows, steps] = torch.where(running, tok, self.tokens[rows, steps])
        self.logprobs[rows, steps] = torch.where(running, lp, self.logprobs[rows, steps])
        hit_stop = (tok[:, None] == self.stops[sel]).any(-1) & running
        steps = steps + running.long()
        self.steps[sel] = steps
        self.stopped[sel] = self.stopped[sel] | hit_stop
        self.running[sel] = running & ~hit_stop & (steps < self.max_new[sel])
        self.ids[sel] = tok[:, None]

    def _step(self) -> None:
        versions = [owner[0].version if owner else self.free_version() for owner in self._owner]
        # running rows write their next token at their length; finished and free rows rewrite
        # the position they stand at (hidden from every row that is read)
        self.pos.copy_(self.cache.lengths[:, None])
        self.cache.decode_mask(self.mask)
        with self.step_context(versions) as variant:
            logits = self._forward(variant)
        self.cache.lengths += self.running.long()
        self._sample(logits)
        self.steps_run += 1

    def _forward(self, variant: Hashable) -> torch.Tensor:
        if not self.capture or variant not in self.warm:
            self.warm.add(variant)
            return self._eager()
        if variant not in self.graphs:
            graph = torch.cuda.CUDAGraph()
            # records without running: the step is replayed right after (see sampling._Static)
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                logits = self._eager()
            self.graphs[variant] = (graph, logits)
            self.captures += 1
        graph, logits = self.graphs[variant]
        graph.replay()
        return logits

    def _eager(self) -> torch.Tensor:
        out = self.model(
            input_ids=self.ids, position_ids=self.pos, attention_mask=self.mask, use_cache=True, logits_to_keep=1,
            **self._cache_arg,
        )  # fmt: skip
        return out.logits[:, -1]

    def _retire(self) -> None:
        """Hand back every group whose rows have all finished; free their rows."""
        held = [r for r, owner in enumerate(self._owner) if owner is not None and not self._pending_row(owner)]
        if not held:
            return
        running = self.running.tolist()
        finished = [r for r in held if not running[r]]
        if not finished:
            return
        index = torch.tensor(finished, dtype=torch.long, device=self.ids.device)
        steps, stopped = self.steps[index].tolist(), self.stopped[index].tolist()
        tokens, logprobs = self.tokens[index].tolist(), self.logprobs[index].tolist()
        done: list[Group] = []
        for k, r in enumerate(finished):
            owner = self._owner[r]
            assert owner is not None
            group, j = owner
            n = steps[k]
            self._outputs[id(group)][j] = RowOutput(
                token_ids=tokens[k][:n], logprobs=logprobs[k][:n], finish_reason="stop" if stopped[k] else "length"
            )
            self._owner[r] = None
            self._truncating.discard(r)
            if all(o is not None for o in self._outputs[id(group)]):
                done.append(group)
        self.cache.lengths[index] = 0
        for group in done:
            outputs = self._outputs.pop(id(group))
            group.done(outputs)  # type: ignore[arg-type]

    def _fail_all(self, exc: BaseException) -> None:
        groups = {id(o[0]): o[0] for o in self._owner if o is not None}
        with self._wake:
            groups.update((id(g), g) for g in self._queue)
            self._queue.clear()
        self._owner = [None] * self.rows
        self._pending = None
        self._outputs.clear()
        self._truncating.clear()
        self.running.zero_()
        self.cache.lengths.zero_()
        for group in groups.values():
            group.done(exc)
