"""The embedded engine: a transformers model in this process, our LoRA slots, our decode loop.

One lock serialises every forward step, adapter load and head change. A batch takes it once
per decode step, so a version can be loaded between two steps of a running generation; rows
of that generation stay on the version they were pinned to (their slot is untouched, and the
head change only moves them from "merged" to "corrected"), so their outputs do not change.

On CUDA with `cuda_graphs` (rollout.cuda_graphs, default on) the decode steps run on a static
KV cache and replay CUDA graphs: one per batch size and cache length, for "all rows on the
head" and for "some rows corrected". The routing is a device tensor, so a head change between
two steps needs no new capture.

Without a slab, the calls made in one pass of the event loop are decoded as one batch: the
rollout service asks for each version of a batch in its own call, and a replica of a fleet for
each run's batch, all at once; decoded apart they took a forward per call at every step and a
static cache (and CUDA graphs) per call (`DecodeGraphs` keeps four), so a fleet's replica
slowed down as runs were added. A call made while a batch decodes starts the next batch
without waiting for it, as before. A version stays counted as in use until its batch ends,
also when its caller has stopped waiting.

With a slab (`slab_rows`, rollout.slab_rows) a decoder thread batches continuously
(`continuous.ContinuousDecoder`): each request is a group that joins the running slab as rows
free up, and its call returns when its own rows finish. A version in use by a group stays
counted as in use until the group is answered, also when its caller has stopped waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel

from proto.messages import LoraSpec
from services.common import adapter_io
from services.rollout.continuous import ContinuousDecoder, Group
from services.rollout.engines.base import GenRequest, GenResult
from services.rollout.lora_slots import LoraSlots
from services.rollout.sampling import DecodeGraphs, Row, RowOutput, decode, mix32, static_unsupported

if TYPE_CHECKING:
    from services.config.schema import LorabusConfig

log = logging.getLogger(__name__)


@dataclass
class _Call:
    """One `generate_mixed` call of the batch path: its rows as (version, request, sample, row)
    in request order, its versions (one per request), and where its rows' outputs go."""

    rows: list[tuple[int, int, int, Row]]
    versions: Sequence[int]
    answer: asyncio.Future[list[RowOutput]]


class EmbeddedEngine:
    name = "embedded"

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        eos_ids: Sequence[int],
        pad_id: int,
        slots: int,
        cuda_graphs: bool = True,
        slab_rows: int = 0,
        slab_length: int = 2048,
        prefill_chunk: int = 512,
        merge_head: bool = True,
    ):
        if slots < 2:
            raise ValueError(f"slots: {slots} must be >= 2 (lora_keep_versions + 1)")
        if slab_rows < 0:
            raise ValueError(f"rollout.slab_rows: {slab_rows} must be >= 0 (0: no continuous batching)")
        self.model = model.eval()
        on_cuda = next(model.parameters()).device.type == "cuda"
        self.graphs: DecodeGraphs | None = None
        """static-cache CUDA graph decoding; None: the eager DynamicCache loop (CPU, or off)"""
        self.decoder: ContinuousDecoder | None = None
        """continuous batching over a slab (slab_rows > 0); None: each call decodes its own batch"""
        self._decoder_thread: threading.Thread | None = None
        if slab_rows:
            self.decoder = ContinuousDecoder(
                model, rows=slab_rows, length=slab_length, step_context=self._step, free_version=self._free_version,
                capture=cuda_graphs and on_cuda, prefill_chunk=prefill_chunk,
            )  # fmt: skip
            self._decoder_thread = threading.Thread(target=self.decoder.run, name="lorabus-decoder", daemon=True)
            self._decoder_thread.start()
            log.info("embedded engine: continuous batching over %d rows of %d tokens", slab_rows, slab_length)
        elif cuda_graphs and on_cuda and static_unsupported(model) is None:
            self.graphs = DecodeGraphs(model, capture=True)
        self.eos_ids = tuple(eos_ids)
        self.pad_id = pad_id
        self.n_slots = slots
        self.merge_head = merge_head
        """rollout.merge_head: the newest version merged into the weights (`LoraSlots.merge_head`)"""
        self.slots: LoraSlots | None = None
        self.steps = 0
        """forward steps taken so far (for tests and metrics)"""
        self._lock = threading.Lock()
        self._active: Counter[int] = Counter()
        self._waiting: list[_Call] = []
        """calls of this pass of the event loop, not yet decoding"""
        self._batches: set[asyncio.Task[None]] = set()

    @classmethod
    def from_config(cls, cfg: LorabusConfig) -> EmbeddedEngine:
        """Model and tokenizer from `actor.path`, on `rollout.device` in `rollout.dtype`."""
        from services.common import models

        tok = models.load_tokenizer(cfg.actor.tokenizer_path or cfg.actor.path)
        model = models.load_base_model(cfg.actor.path, cfg.rollout.dtype, cfg.rollout.device)
        return cls(
            model,
            eos_ids=models.eos_token_ids(tok),
            pad_id=models.pad_token_id(tok),
            slots=cfg.rollout.keep_versions + 1,
            cuda_graphs=cfg.rollout.cuda_graphs,
            slab_rows=cfg.rollout.slab_rows,
            slab_length=cfg.rollout.slab_length,
            prefill_chunk=cfg.rollout.prefill_chunk,
            merge_head=cfg.rollout.merge_head,
        )

    # --- versions ---
    async def load_version(self, version: int, weights: bytes | dict[str, torch.Tensor], lora: LoraSpec) -> None:
        tensors = adapter_io.from_bytes(weights) if isinstance(weights, (bytes, bytearray)) else weights
        await asyncio.to_thread(self.swap_in, version, tensors, lora)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def swap_in(self, version: int, tensors: dict[str, torch.Tensor], lora: LoraSpec) -> tuple[float, float]:
        """Copy a version into a free slot and, if it is the newest, merge it as the head;
        blocking, and servable on return (the device work is synchronised). Returns the seconds
        of the copy and of the merge."""
        with self._lock:
            t0 = time.perf_counter()
            if self.slots is None:
                self.slots = LoraSlots.install(self.model, tensors, self.n_slots)
            if lora.rank != self.slots.rank:
                raise ValueError(
                    f"lora.rank: v{version} has rank {lora.rank} but the slots hold rank "
                    f"{self.slots.rank}; every version of one adapter must share its rank"
                )
            self.slots.merge_head = self.merge_head
            self.slots.load(version, tensors, lora.alpha / lora.rank)
            self._sync()
            t1 = time.perf_counter()
            if self.slots.head is None or version > self.slots.head:
                self.slots.set_head(version)
            self._sync()
            return t1 - t0, time.perf_counter() - t1

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()

    async def unload_version(self, version: int) -> None:
        await asyncio.to_thread(self._unload, version)

    def _unload(self, version: int) -> None:
        with self._lock:
            if self.slots is None or version not in self.slots.versions():
                raise KeyError(f"version {version} is not loaded (loaded: {self._versions()})")
            if self._active[version]:
                raise RuntimeError(
                    f"version {version} is used by {self._active[version]} running generation(s); "
                    "unload it after they finish"
                )
            if version == self.slots.head:
                rest = [v for v in self.slots.versions() if v != version]
                self.slots.set_head(max(rest) if rest else None)
            self.slots.unload(version)

    async def loaded_versions(self) -> list[int]:
        return self._versions()

    def _versions(self) -> list[int]:
        return self.slots.versions() if self.slots else []

    # --- generation ---
    async def generate(self, requests: list[GenRequest], version: int) -> list[list[GenResult]]:
        return await self.generate_mixed(requests, [version] * len(requests))

    async def generate_mixed(self, requests: Sequence[GenRequest], versions: Sequence[int]) -> list[list[GenResult]]:
        """Like `generate`, with each request on its own version, all in one batch."""
        if len(requests) != len(versions):
            raise ValueError(f"versions: {len(versions)} given for {len(requests)} requests")
        loaded = set(self._versions())
        for v in versions:
            if v not in loaded:
                raise KeyError(f"version {v} is not loaded (loaded: {sorted(loaded)})")
        # checked per call: a bad id would fail every call decoded beside it (on CUDA, the
        # embedding's device-side assert, the whole process)
        vocab = self.model.get_input_embeddings().num_embeddings
        for i, req in enumerate(requests):
            if min(req.prompt_token_ids) < 0 or max(req.prompt_token_ids) >= vocab:
                bad = next(t for t in req.prompt_token_ids if not 0 <= t < vocab)
                raise ValueError(
                    f"requests[{i}].prompt_token_ids: token id {bad} is outside the model's vocabulary "
                    f"(0..{vocab - 1}); encode the prompt with the base model's tokenizer"
                )
        rows: list[tuple[int, int, int, Row]] = []
        for i, (req, v) in enumerate(zip(requests, versions)):
            seed = req.seed if req.seed is not None else random.getrandbits(32)
            stop = self.eos_ids + tuple(req.stop_token_ids)
            for j in range(req.n):
                row = Row(
                    prompt=req.prompt_token_ids,
                    max_new_tokens=req.max_new_tokens,
                    temperature=req.temperature,
                    top_p=req.top_p,
                    top_k=req.top_k,
                    stop_ids=stop,
                    seed=mix32(seed + mix32(j + 1)),
                )
                rows.append((v, i, j, row))
        if self.decoder is not None:
            return await self._generate_continuous(versions, rows)
        call = _Call(rows, versions, asyncio.get_running_loop().create_future())
        self._active.update(versions)
        self._waiting.append(call)
        if len(self._waiting) == 1:
            task = asyncio.create_task(self._decode_waiting())
            self._batches.add(task)
            task.add_done_callback(self._batches.discard)
        outputs = await call.answer
        results: list[list[GenResult | None]] = [[None] * req.n for req in requests]
        for (_, i, j, _), out in zip(rows, outputs):
            results[i][j] = GenResult(token_ids=out.token_ids, logprobs=out.logprobs, finish_reason=out.finish_reason)
        return results  # type: ignore[return-value]

    async def _decode_waiting(self) -> None:
        """Decode the calls waiting once no pass of the event loop adds another, as one batch
        with each version's rows side by side (one correction span each), and answer each call
        with its own rows' outputs."""
        seen = 0
        while seen != len(self._waiting):
            seen = len(self._waiting)
            await asyncio.sleep(0)
        calls, self._waiting = self._waiting, []
        order = sorted(
            ((row[0], c, k) for c, call in enumerate(calls) for k, row in enumerate(call.rows)), key=lambda o: o[0]
        )
        rows = [calls[c].rows[k][3] for _, c, k in order]
        row_versions = [v for v, _, _ in order]
        if self.graphs is not None:
            # idle rows up to the batch's size class, on the last span's version: one token of
            # padding each, decoded beside the others and never answered
            idle = self.graphs.batch_size(len(rows)) - len(rows)
            rows += [Row(prompt=(self.pad_id,), max_new_tokens=1)] * idle
            row_versions += [row_versions[-1]] * idle
        try:
            outputs = await asyncio.to_thread(
                decode,
                self.model,
                rows,
                pad_id=self.pad_id,
                step_context=lambda: self._step(row_versions),
                graphs=self.graphs,
            )
        except Exception as exc:
            for call in calls:
                if not call.answer.done():
                    call.answer.set_exception(exc)
            return  # the callers have it
        except asyncio.CancelledError:
            for call in calls:
                call.answer.cancel()
            raise
        finally:
            for call in calls:
                self._active.subtract(call.versions)
        placed = {(c, k): out for (_, c, k), out in zip(order, outputs)}
        for c, call in enumerate(calls):
            if not call.answer.done():  # its caller stopped waiting
                call.answer.set_result([placed[c, k] for k in range(len(call.rows))])

    async def _generate_continuous(
        self, versions: Sequence[int], rows: list[tuple[int, int, int, Row]]
    ) -> list[list[GenResult]]:
        """One group per request (rows: (version, request, sample, row) in request order)."""
        assert self.decoder is not None
        loop = asyncio.get_running_loop()
        answers: list[asyncio.Future[list[RowOutput]]] = []
        for i, v in enumerate(versions):
            answer: asyncio.Future[list[RowOutput]] = loop.create_future()
            group = [row for (_, at, _, row) in rows if at == i]
            self._active[v] += 1
            try:
                self.decoder.submit(Group(rows=group, version=v, done=self._answer(loop, answer, v)))
            except BaseException:
                self._active[v] -= 1
                raise
            answers.append(answer)
        outputs = await asyncio.gather(*answers)
        return [
            [GenResult(token_ids=o.token_ids, logprobs=o.logprobs, finish_reason=o.finish_reason) for o in outs]
            for outs in outputs
        ]

    def _answer(self, loop: asyncio.AbstractEventLoop, answer: asyncio.Future, version: int):
        """The decoder thread's callback for one group: settles `answer` on the event loop and
        releases the group's version there."""

        def settle(result: list[RowOutput] | BaseException) -> None:
            self._active[version] -= 1
            if answer.done():  # the caller stopped waiting (cancelled)
                return
            if isinstance(result, BaseException):
                answer.set_exception(result)
            else:
                answer.set_result(result)

        return lambda result: loop.call_soon_threadsafe(settle, result)

    def _free_version(self) -> int:
        """The version a free slab row is routed to: the head (any loaded one does)."""
        assert self.slots is not None and self.slots.head is not None
        return self.slots.head

    @contextlib.contextmanager
    def _step(self, row_versions: Sequence[int]) -> Iterator[bool]:
        with self._lock:
            assert self.slots is not None
            with self.slots.route(row_versions) as corrected:
                yield corrected
            self.steps += 1

    async def health(self) -> bool:
        return True

    async def close(self) -> None:
        await asyncio.gather(*self._batches, return_exceptions=True)
        if self.decoder is not None and self._decoder_thread is not None:
            self.decoder.close()
            await asyncio.to_thread(self._decoder_thread.join)
        self.slots = None
