"""Trainer checkpoints: adapter, optimizer state, counters and RNG, written atomically.

Layout: `<checkpoint_dir>/step-<NNNNNNNN>/` with `adapter_model.safetensors` (the exact bytes
that were published, so a resumed trainer re-announces the same sha256), `trainer.pt`
(optimizer + RNG) and `state.json` (counters, readable by people). A directory is written
under a temporary name and renamed into place, so a crash leaves either the whole
checkpoint or none of it; the newest complete one is what a restart resumes from.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from services.common import adapter_io

STATE_NAME = "state.json"
TRAINER_NAME = "trainer.pt"
KEEP = 2
"""complete checkpoints kept; older ones are deleted after a new one lands"""


@dataclass
class Checkpoint:
    step: int
    """train steps completed"""
    version: int
    """the adapter version these weights were published as"""
    adapter_bytes: bytes
    optimizer: dict[str, Any]
    rng: dict[str, Any] = field(default_factory=dict)
    trained_ids: list[str] = field(default_factory=list)
    """trajectory ids of the last step: if their acks were lost, the redelivery is skipped"""
    trained_seqs: list[tuple[int, int]] = field(default_factory=list)
    """ACCEPTED stream sequences of every group trained so far, as ranges (`common.ranges`): a
    redelivery after acks lost in a nats-server crash is skipped, whichever step trained it"""

    @property
    def adapter(self) -> dict[str, torch.Tensor]:
        return adapter_io.from_bytes(self.adapter_bytes)


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "python" in state:
        random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _name(step: int) -> str:
    return f"step-{step:08d}"


def save(directory: str | os.PathLike, ckpt: Checkpoint) -> Path:
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    final = root / _name(ckpt.step)
    tmp = root / f".tmp-{_name(ckpt.step)}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    (tmp / adapter_io.WEIGHTS_NAME).write_bytes(ckpt.adapter_bytes)
    torch.save({"optimizer": ckpt.optimizer, "rng": ckpt.rng}, tmp / TRAINER_NAME)
    state = {
        "step": ckpt.step,
        "version": ckpt.version,
        "trained_ids": ckpt.trained_ids,
        "trained_seqs": ckpt.trained_seqs,
        "adapter_sha256": adapter_io.sha256(ckpt.adapter_bytes),
    }
    (tmp / STATE_NAME).write_text(json.dumps(state, indent=2))
    for path in tmp.iterdir():  # data on disk before the rename makes it visible
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    if final.exists():  # the same step saved again after a resume: replace it whole
        shutil.rmtree(final)
    os.replace(tmp, final)
    _prune(root)
    return final


def _complete(root: Path) -> list[Path]:
    dirs = [p for p in root.glob("step-*") if p.is_dir() and (p / STATE_NAME).is_file()]
    return sorted(dirs, key=lambda p: p.name)


def _prune(root: Path) -> None:
    for old in _complete(root)[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)


def load_latest(directory: str | os.PathLike) -> Checkpoint | None:
    """The newest complete checkpoint, or None when there is none (a fresh run)."""
    root = Path(directory)
    if not root.is_dir():
        return None
    found = _complete(root)
    if not found:
        return None
    path = found[-1]
    state = json.loads((path / STATE_NAME).read_text())
    adapter_bytes = (path / adapter_io.WEIGHTS_NAME).read_bytes()
    if adapter_io.sha256(adapter_bytes) != state["adapter_sha256"]:
        raise RuntimeError(
            f"checkpoint {path}: adapter does not match its recorded sha256; the file is "
            "damaged: delete this step directory to resume from the previous one"
        )
    extra = torch.load(path / TRAINER_NAME, weights_only=False)
    return Checkpoint(
        step=state["step"],
        version=state["version"],
        adapter_bytes=adapter_bytes,
        optimizer=extra["optimizer"],
        rng=extra.get("rng", {}),
        trained_ids=list(state.get("trained_ids", [])),
        trained_seqs=[(lo, hi) for lo, hi in state.get("trained_seqs", [])],
    )
