"""Where a run's training starts: its newest checkpoint, or its untrained adapter, and the
version to announce first.

Invariant: no version number ever names two different adapters: a restart re-announces the
checkpoint's version only when nothing newer was stored, else the restored weights become a new
version above the newest stored one.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import torch

from proto.messages import Canary
from services.common import adapter_io
from services.common.store import ObjectStore
from services.config.schema import LorabusConfig
from services.trainer import canary as trainer_canary
from services.trainer import checkpoint
from services.trainer.engines.base import TrainEngine
from services.trainer.publish import parse_adapter_version

log = logging.getLogger(__name__)


def highest_stored_version(store: ObjectStore, run: str) -> int | None:
    versions = [v for key in store.list(f"{run}/adapters/") if (v := parse_adapter_version(run, key)) is not None]
    return max(versions, default=None)


def resume_plan(ckpt: checkpoint.Checkpoint | None, highest_stored: int | None) -> tuple[int, bool]:
    """(version to (re)announce now, whether it carries the checkpoint's bytes unchanged).

    Fresh start: v0. Resume: the checkpoint's version, re-announced idempotently (the crash
    may have come between upload and publish). If versions past the checkpoint were already
    uploaded (checkpoint_every > 1), their weights are gone: the restored weights become a
    new version above them, so no version number ever names two different adapters."""
    if ckpt is None:
        return 0, False
    if highest_stored is not None and highest_stored > ckpt.version:
        return highest_stored + 1, False
    return ckpt.version, True


@dataclass(frozen=True)
class Resume:
    """Where rank 0's loop starts: the version to announce first (`resume_plan`), its weights
    as bytes and as tensors, and the trajectories of the checkpoint's last step (a redelivery
    of those is acked, not trained twice)."""

    version: int
    weights: bytes
    tensors: dict[str, torch.Tensor]
    trained_ids: frozenset[str]
    trained_seqs: tuple[tuple[int, int], ...] = ()
    canary: Canary | None = None
    """the first version's canary: the engine holds exactly these weights when it starts"""
    highest_stored: int | None = None
    """the highest version the store held (`highest_stored_version`): versions above it and above
    the first were never announced (`publish.Announced`)"""

    @classmethod
    def plan(
        cls,
        ckpt: checkpoint.Checkpoint | None,
        initial: dict[str, torch.Tensor] | None,
        highest_stored: int | None,
        canary: Canary | None = None,
    ) -> Resume:
        """`initial` is the untrained adapter, needed when there is no checkpoint; `canary`: the
        engine's canary of what it holds now (restored or untrained)."""
        version, unchanged = resume_plan(ckpt, highest_stored)
        if ckpt is None:
            if initial is None:
                raise ValueError(
                    "initial: None without a checkpoint; gather the untrained adapter "
                    "(engine.adapter_state() on every rank) before serving"
                )
            return cls(version, adapter_io.to_bytes(initial), initial, frozenset(), canary=canary,
                       highest_stored=highest_stored)  # fmt: skip
        tensors = ckpt.adapter
        weights = ckpt.adapter_bytes if unchanged else adapter_io.to_bytes(tensors)
        return cls(version, weights, tensors, frozenset(ckpt.trained_ids), tuple(ckpt.trained_seqs), canary,
                   highest_stored)  # fmt: skip


def restore(engine: TrainEngine, cfg: LorabusConfig) -> checkpoint.Checkpoint | None:
    """Every rank loads the newest checkpoint itself (same host, same directory)."""
    ckpt = checkpoint.load_latest(cfg.actor.checkpoint_dir)
    if ckpt is not None:
        engine.load_state(ckpt.adapter, ckpt.optimizer or None, ckpt.step)
        checkpoint.restore_rng(ckpt.rng)
    return ckpt


async def resume(engine: TrainEngine, cfg: LorabusConfig, store: ObjectStore) -> Resume:
    """Where a run starts: its newest checkpoint (restored into `engine`) or its untrained adapter."""
    ckpt = restore(engine, cfg)
    initial = engine.adapter_state() if ckpt is None else None
    canary, _ = trainer_canary.timed(engine)
    highest = await asyncio.to_thread(highest_stored_version, store, cfg.run)
    if ckpt is not None:
        log.info("run %s: resuming from %s step %d (v%d)", cfg.run, cfg.actor.checkpoint_dir, ckpt.step, ckpt.version)
    return Resume.plan(ckpt, initial, highest, canary)
