"""Trainer checkpoints: adapter, optimizer state, counters and RNG, written atomically.

Layout: `<checkpoint_dir>/step-<NNNNNNNN>/` with `adapter_model.safetensors` (the exact bytes
that were published, so a resumed trainer re-announces the same sha256), `trainer.bin`
(optimizer + RNG: `write_state`) and `state.json` (counters, readable by people). A directory
is written under a temporary name and renamed into place, so a crash leaves either the whole
checkpoint or none of it; the newest complete one is what a restart resumes from. Checkpoints
of older trainers (`trainer.pt`, a torch.save) still load.

`trainer.bin` is the optimizer state's structure, pickled with every plain CPU tensor replaced
by a reference, followed by those tensors' raw bytes, written straight from their memory by
`os.writev`, which releases the GIL. A checkpoint is written in a thread while the run's next
step trains (`runs`), every step by default (`actor.checkpoint_every`), and torch.save holds the
GIL while it pickles every tensor. A 70 MB Adam state (1008 tensors), 2 CPU cores, fsync
included: torch.save 149 ms alone, 3.8 s beside a thread busy in Python; this 84 / 188 ms. A
thread of small torch ops (the step's) ran 1.77x slower beside a loop of torch.save, 1.14x
beside one of these.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from services.common import adapter_io

STATE_NAME = "state.json"
TRAINER_NAME = "trainer.bin"
LEGACY_TRAINER_NAME = "trainer.pt"
"""what trainers before `trainer.bin` wrote (torch.save); still loaded"""
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


MAGIC = b"lorabus-trainer-state-1\n"
_ALIGN = 64
"""each tensor's bytes start at a multiple of this from the data section's start"""
_IOV_MAX = 1024
"""buffers per writev (Linux's IOV_MAX)"""
_PAD = bytes(_ALIGN)


class _TensorRef(NamedTuple):
    """Where a tensor's bytes lie in the data section of `trainer.bin`, and how to rebuild it."""

    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


def _raw(value: Any) -> bool:
    """Whether `value` is written as raw bytes (else it is pickled with the structure)."""
    return (
        type(value) is torch.Tensor
        and value.device.type == "cpu"
        and value.layout == torch.strided
        and not value.is_quantized
        and not value.requires_grad
        and not value.is_conj()
        and not value.is_neg()
    )


class _Layout:
    """The data section of a `trainer.bin` being laid out: the buffers in file order."""

    def __init__(self) -> None:
        self.buffers: list[memoryview] = []
        self.size = 0
        self.tensors: list[torch.Tensor] = []
        """the tensors whose memory `buffers` point into: alive until they are written"""

    def take(self, obj: Any) -> Any:
        """`obj` with every plain CPU tensor in its dicts, lists and tuples replaced by a
        `_TensorRef` to its bytes, which are queued (no copy when contiguous)."""
        if _raw(obj):
            # the bytes in place, through no torch call that releases the GIL
            view, t = adapter_io.host_bytes(obj)
            ref = _TensorRef(self.size, view.nbytes, str(t.dtype).removeprefix("torch."), tuple(t.shape))
            if ref.nbytes == 0:
                return ref
            self.tensors.append(t)
            self.buffers.append(view)
            self.size += view.nbytes
            if pad := -self.size % _ALIGN:
                self.buffers.append(memoryview(_PAD)[:pad])
                self.size += pad
            return ref
        kind = type(obj)
        if kind is dict:
            return {k: self.take(v) for k, v in obj.items()}
        if kind is list:
            return [self.take(v) for v in obj]
        if kind is tuple:
            return tuple(self.take(v) for v in obj)
        return obj


def _writev_all(fd: int, buffers: list[memoryview]) -> None:
    """Every byte of `buffers`, in order, in as few writev calls as the OS takes (each releases
    the GIL while the kernel copies)."""
    pending = list(buffers)
    while pending:
        chunk = pending[:_IOV_MAX]
        written = os.writev(fd, chunk)
        if written <= 0 and any(b.nbytes for b in chunk):
            raise OSError(f"writev wrote {written} bytes")
        done = 0
        while done < len(chunk) and written >= chunk[done].nbytes:
            written -= chunk[done].nbytes
            done += 1
        del pending[:done]
        if written:  # a short write ended inside this buffer
            pending[0] = pending[0][written:]


def write_state(path: str | os.PathLike, obj: Any) -> None:
    """Write `obj` (the optimizer state and RNG) to `path` as a `trainer.bin` (module
    docstring), fsynced; `read_state` gives it back. The GIL is held to walk the structure and
    pickle it without the tensors, not while their bytes are copied."""
    layout = _Layout()
    skeleton = layout.take(obj)
    head = pickle.dumps((layout.size, skeleton), protocol=pickle.HIGHEST_PROTOCOL)
    head = MAGIC + len(head).to_bytes(8, "little") + head
    head += bytes(-len(head) % _ALIGN)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _writev_all(fd, [memoryview(head), *layout.buffers])
        os.fsync(fd)
    finally:
        os.close(fd)


def _rebuild(obj: Any, data: bytearray, start: int) -> Any:
    if type(obj) is _TensorRef:
        dtype = getattr(torch, obj.dtype)
        if obj.nbytes == 0:
            return torch.empty(obj.shape, dtype=dtype)
        flat = torch.frombuffer(data, dtype=torch.uint8, count=obj.nbytes, offset=start + obj.offset)
        return flat.view(dtype).reshape(obj.shape)
    kind = type(obj)
    if kind is dict:
        return {k: _rebuild(v, data, start) for k, v in obj.items()}
    if kind is list:
        return [_rebuild(v, data, start) for v in obj]
    if kind is tuple:
        return tuple(_rebuild(v, data, start) for v in obj)
    return obj


def read_state(path: str | os.PathLike) -> Any:
    """What `write_state` wrote to `path`; raises when the file is not one, or is cut short."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        data = bytearray(size)
        got = f.readinto(data)
    if got != size or not data.startswith(MAGIC):
        raise RuntimeError(f"{path}: not a trainer state file ({MAGIC!r}); the file is damaged")
    at = len(MAGIC)
    n = int.from_bytes(data[at : at + 8], "little")
    total, skeleton = pickle.loads(data[at + 8 : at + 8 + n])
    start = at + 8 + n
    start += -start % _ALIGN
    if size != start + total:
        raise RuntimeError(
            f"{path}: {size} bytes, its header says {start + total}; the file is damaged: delete this step "
            "directory to resume from the previous one"
        )
    return _rebuild(skeleton, data, start)


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
    write_state(tmp / TRAINER_NAME, {"optimizer": ckpt.optimizer, "rng": ckpt.rng})
    state = {
        "step": ckpt.step,
        "version": ckpt.version,
        "trained_ids": ckpt.trained_ids,
        "trained_seqs": ckpt.trained_seqs,
        "adapter_sha256": adapter_io.sha256(ckpt.adapter_bytes),
    }
    (tmp / STATE_NAME).write_text(json.dumps(state, indent=2))
    for path in (tmp / adapter_io.WEIGHTS_NAME, tmp / STATE_NAME):  # on disk before the rename
        with open(path, "rb") as f:  # makes it visible (write_state fsyncs its own)
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
    if (path / TRAINER_NAME).is_file():
        extra = read_state(path / TRAINER_NAME)
    else:  # written by a trainer before trainer.bin
        extra = torch.load(path / LEGACY_TRAINER_NAME, weights_only=False)
    return Checkpoint(
        step=state["step"],
        version=state["version"],
        adapter_bytes=adapter_bytes,
        optimizer=extra["optimizer"],
        rng=extra.get("rng", {}),
        trained_ids=list(state.get("trained_ids", [])),
        trained_seqs=[(lo, hi) for lo, hi in state.get("trained_seqs", [])],
    )
