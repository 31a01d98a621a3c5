"""Per-rank adapter checkpoints (torch.save), because Megatron's DCP checkpoints do not work
with LoRA (AReaL: "no DCP checkpoints with LoRA").

Under tensor parallelism every rank holds its own slices of the adapter and of the Adam
moments, so one rank-0 file (what the FSDP2 engine gathers) cannot restore them without the
inverse of every TP layout. Each rank therefore writes exactly what it holds, fp32 masters and
optimizer state in bridge naming, to
`<checkpoint_dir>/megatron-ranks/step-<NNNNNNNN>/rank-<RRRRR>.pt`; the trainer service's own
checkpoint (`services.trainer.checkpoint`: the published HF adapter bytes, RNG, counters)
stores only a reference to that directory. Files are written under a temporary name, fsynced
and renamed, so a crash leaves whole files or none; the layout (world, tp, pp, dp, rank) is
recorded and checked on load, because a shard is only meaningful in the layout it came from.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from services.trainer.checkpoint import KEEP

RANKS_DIR = "megatron-ranks"
FORMAT = "lorabus-megatron-adapter-1"


def step_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / RANKS_DIR / f"step-{step:08d}"


def shard_path(root: str | os.PathLike, step: int, rank: int) -> Path:
    return step_dir(root, step) / f"rank-{rank:05d}.pt"


def save_shard(root: str | os.PathLike, step: int, layout: dict, state: dict) -> Path:
    """Write this rank's shard (`layout["rank"]`) of step `step` atomically."""
    path = shard_path(root, step, layout["rank"])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    torch.save({"format": FORMAT, "step": step, "layout": dict(layout), "state": state}, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def load_shard(root: str | os.PathLike, step: int, layout: dict) -> dict:
    """This rank's state of step `step`; raises naming the file and the fix when it is
    missing, damaged or from another parallel layout."""
    path = shard_path(root, step, layout["rank"])
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: the Megatron adapter shard of step {step} for rank {layout['rank']} is "
            "missing; resume with the same world size and parallel layout, or start a fresh "
            "actor.checkpoint_dir"
        )
    try:
        saved = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # torch raises several types for a truncated file
        raise RuntimeError(f"{path}: cannot be read ({exc}); delete that step to resume from the previous one") from exc
    if not isinstance(saved, dict) or saved.get("format") != FORMAT:
        raise RuntimeError(f"{path}: not a {FORMAT} file")
    if saved["step"] != step:
        raise RuntimeError(f"{path}: holds step {saved['step']}, expected {step}")
    if saved["layout"] != dict(layout):
        raise RuntimeError(
            f"{path}: written with parallel layout {saved['layout']}, this run is {dict(layout)}; "
            "adapter shards only load into the layout they were saved from (same world size, "
            "tensor/pipeline/data parallel sizes)"
        )
    return saved["state"]


def prune(root: str | os.PathLike, keep: int = KEEP + 1) -> None:
    """Delete all but the newest `keep` step directories (one more than the service keeps, so
    every trainer checkpoint still on disk finds its shards)."""
    base = Path(root) / RANKS_DIR
    if not base.is_dir():
        return
    steps = sorted(p for p in base.glob("step-*") if p.is_dir())
    for old in steps[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
