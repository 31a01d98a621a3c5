"""Trainer engines: each owns the model, the optimizer and the train step for one backend, behind
the `TrainEngine` contract (`base.py`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.config.schema import LorabusConfig
from services.trainer.engines.base import TrainEngine

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def make_engine(cfg: LorabusConfig, base: PreTrainedModel | None = None, *, pad_id: int = 0) -> TrainEngine:
    """The engine for `actor.backend`; `base` overrides loading `actor.path` (tests, benchmarks)."""
    if cfg.actor.backend == "fsdp2":
        from services.trainer.engines.fsdp2 import FSDP2Engine

        return FSDP2Engine(cfg, base, pad_id=pad_id)
    if cfg.actor.backend == "megatron":
        # raises MegatronNotInstalled, naming the lorabus[megatron] extra, without Megatron
        from services.trainer.engines.megatron import MegatronEngine

        return MegatronEngine(cfg, base, pad_id=pad_id)
    raise ValueError(f"actor.backend: {cfg.actor.backend!r} has no engine in this build; use 'fsdp2' or 'megatron'")
