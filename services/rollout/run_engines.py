"""One engine, every run of the fleet: a per-run view that the run's adapter follower and
generations use as if the engine were the run's alone (`Engine`, versions numbered per run).

- embedded: one base model and one slot pool (`LoraSlots`) for all runs. A version of run `r`
  lives in the pool under its own key (`RunKeys`: the fleet's own run keeps its version
  numbers, so a one-run fleet is exactly a single-run replica). The pool is shaped once, at its
  first adapter, with the fleet's slot count and rank (`services.common.capacity`) over that
  adapter's modules (the fleet's own run's, which the registry makes every run's superset); an
  adapter of lower rank or fewer modules is zero-padded into it: B' A' = B A, so a padded row
  computes exactly what the adapter alone computes, and the pool's rows route to any run's
  version like to any version of one run.
- vLLM / SGLang: a sibling `ServerEngine` per run on the same servers and HTTP client, naming
  its versions `<run>-<lora_name>-v<N>` (the fleet's own run keeps `<lora_name>-v<N>`), each in
  its own directory, so the runs' names and files never meet.

Invariant: a view loads, serves, lists and unloads its own run's versions only.
"""

from __future__ import annotations

from typing import cast

import torch
from msgspec import structs

from proto.messages import LoraSpec
from services.common import adapter_io
from services.rollout.engines.base import Engine, GenRequest, GenResult
from services.rollout.engines.embedded import EmbeddedEngine
from services.rollout.engines.http import AdapterDirs, ServerEngine
from services.rollout.lora_slots import LoraSlots, module_tensors

KEY_STRIDE = 1 << 32
"""pool keys of one run: run index * KEY_STRIDE + version (versions stay below 2**32)"""
_PREFIX = "base_model.model."


class RunKeys:
    """(run, version) <-> the pool key it is loaded under; the first run named is index 0."""

    def __init__(self, own: str):
        self._index: dict[str, int] = {own: 0}

    def key(self, run: str, version: int) -> int:
        if not 0 <= version < KEY_STRIDE:
            raise ValueError(f"version: {version} must be within 0..{KEY_STRIDE - 1}")
        index = self._index.setdefault(run, len(self._index))
        return index * KEY_STRIDE + version

    def versions(self, run: str, keys: list[int]) -> list[int]:
        index = self._index.get(run)
        return [] if index is None else sorted(k - index * KEY_STRIDE for k in keys if k // KEY_STRIDE == index)


def pad(tensors: dict[str, torch.Tensor], pool: LoraSlots, what: str) -> dict[str, torch.Tensor]:
    """The adapter as the pool's rank and modules hold it: A [r, in] -> [R, in] and
    B [out, r] -> [out, R] with zeros, and zero A/B for modules it does not target."""
    mods, rank = module_tensors(tensors), pool.rank
    extra = sorted(set(mods) - set(pool.layers))
    if extra:
        raise ValueError(
            f"{what}: targets {extra[:3]}, which the fleet's slots do not hold; a run targets a subset "
            "of the fleet's own actor.target_modules"
        )
    out = {}
    for path, layer in pool.layers.items():
        dtype = layer.weight.dtype
        a = torch.zeros(rank, layer.in_features, dtype=dtype)
        b = torch.zeros(layer.out_features, rank, dtype=dtype)
        if path in mods:
            a_run, b_run = mods[path]
            r = a_run.shape[0]
            if r > rank:
                raise ValueError(f"{what}: rank {r} is above the fleet's slot rank {rank} (fleet.max_lora_rank)")
            a[:r], b[:, :r] = a_run, b_run
        out[f"{_PREFIX}{path}.lora_A.weight"] = a
        out[f"{_PREFIX}{path}.lora_B.weight"] = b
    return out


class EmbeddedRun:
    """One run's view of the fleet's embedded engine (what the run's follower and generations use)."""

    def __init__(self, engine: EmbeddedEngine, keys: RunKeys, run: str, *, slots: int, rank: int):
        self.engine, self.keys, self.run = engine, keys, run
        self.slots, self.rank = slots, rank
        self.model = engine.model
        """the device an XCCL receiver stages on"""

    async def load_version(self, version: int, weights: bytes | dict[str, torch.Tensor], lora: LoraSpec) -> None:
        tensors = adapter_io.from_bytes(weights) if isinstance(weights, (bytes, bytearray)) else weights
        engine = self.engine
        if engine.slots is None:
            # shaped by the first adapter's modules, with the fleet's slot count and rank
            engine.slots = LoraSlots(engine.model, list(module_tensors(tensors)), self.rank, self.slots)
        pool = engine.slots
        if lora.rank != pool.rank or set(module_tensors(tensors)) != set(pool.layers):
            tensors = pad(tensors, pool, f"run {self.run} v{version}")
            # same scale alpha / rank, at the pool's rank
            lora = structs.replace(lora, rank=pool.rank, alpha=lora.alpha / lora.rank * pool.rank)
        await engine.load_version(self.keys.key(self.run, version), tensors, lora)

    async def unload_version(self, version: int) -> None:
        await self.engine.unload_version(self.keys.key(self.run, version))

    async def generate(self, requests: list[GenRequest], version: int) -> list[list[GenResult]]:
        return await self.engine.generate(requests, self.keys.key(self.run, version))

    async def loaded_versions(self) -> list[int]:
        return self.keys.versions(self.run, await self.engine.loaded_versions())

    async def health(self) -> bool:
        return await self.engine.health()

    async def close(self) -> None:
        """The engine is the fleet's: closing one run's view leaves it serving the others."""


def server_sibling(engine: ServerEngine, run: str, lora_name: str) -> ServerEngine:
    """The same servers, with `run`'s versions named `<run>-<lora_name>-v<N>`."""
    dirs = AdapterDirs(f"{run}-{lora_name}", engine.dirs.local_root, engine.dirs.server_root)
    return type(engine)(engine.urls, dirs, http=engine.http)


class RunEngines:
    """Hands each run of the fleet its view of the replica's one engine."""

    def __init__(self, engine: Engine, own: str, *, slots: int, rank: int):
        self.engine, self.own = engine, own
        self.keys = RunKeys(own)
        self.slots, self.rank = slots, rank

    def view(self, run: str, lora_name: str) -> Engine:
        engine = self.engine
        if isinstance(engine, EmbeddedEngine):
            return EmbeddedRun(engine, self.keys, run, slots=self.slots, rank=self.rank)
        if run == self.own:
            return engine
        if isinstance(engine, ServerEngine):
            return cast(Engine, server_sibling(engine, run, lora_name))  # a subclass: health is its own
        raise TypeError(f"rollout.engine: {type(engine).__name__} cannot serve several runs")
