"""The embedded replica's adapter load path: from `adapter.vN.ready` to a servable version in a
few copies, the checksum still guarding every trajectory.

Stages, each timed (`LoadTimes`, logged and exported as a histogram):
- fetch: the object's bytes into a reused host buffer (page-locked on CUDA, so the copy to the
  device needs no staging), read in parallel parts (`ObjectStore.read_into`);
- parse: the safetensors header only; every tensor is a view of the buffer, nothing is copied;
- h2d: one host-to-device copy of the whole data section (one bucket), viewed as the tensors;
- copy: the views into the version's slot (`EmbeddedEngine.swap_in`);
- merge: the head re-merge, when the version is the newest (`swap_in`);
- verify: sha256 and size of the very bytes that were copied, on a background thread that runs
  while h2d, copy and merge do; it is off the critical path, so it is not part of `servable_s`.

Invariant: a version loaded here may be served before its verification ends, but nothing it
generated leaves the replica until verification has passed: `AdapterFollower.trusted` waits for
every verification in flight and refuses a generation that overlapped a version whose bytes
failed; such a version is withdrawn (no new grants, unloaded once unpinned, loaded again by the
verify-first path). A host buffer is reused only once the device copy has completed and its
verification has read it.
"""

from __future__ import annotations

import hashlib
import json
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from proto.messages import AdapterReady, ObjectPayload
from services.common.store import ObjectStore
from services.rollout import metrics
from services.rollout.engines.embedded import EmbeddedEngine

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_HEADER_LIMIT = 100 * 1024 * 1024
"""safetensors' own cap on the JSON header"""


class VerifyError(ValueError):
    """The bytes loaded into a slot are not the bytes the event announced."""


@dataclass
class LoadTimes:
    """Seconds per stage of one load; `verify` is filled in when the background check ends."""

    fetch: float = 0.0
    parse: float = 0.0
    h2d: float = 0.0
    copy: float = 0.0
    merge: float = 0.0
    verify: float | None = None

    @property
    def servable_s(self) -> float:
        """Event received to version servable: every stage but the background verification."""
        return self.fetch + self.parse + self.h2d + self.copy + self.merge

    def observe(self, run: str, replica: str) -> None:
        for stage in ("fetch", "parse", "h2d", "copy", "merge", "verify"):
            value = getattr(self, stage)
            if value is not None:
                metrics.LOAD_STAGE_SECONDS.labels(run, replica, stage).observe(value)

    def describe(self) -> str:
        ms = {k: f"{v * 1e3:.1f}" for k, v in vars(self).items() if v is not None}
        verify = f"; verify {ms['verify']} ms beside them" if "verify" in ms else ""
        return (
            f"{self.servable_s * 1e3:.1f} ms (fetch {ms['fetch']}, parse {ms['parse']}, h2d {ms['h2d']}, "
            f"copy {ms['copy']}, merge {ms['merge']} ms{verify})"
        )


def parse_safetensors(buf: torch.Tensor) -> tuple[int, dict[str, tuple[torch.dtype, list[int], int, int]]]:
    """The layout of a safetensors file held in a uint8 tensor: (offset of the data section,
    {name: (dtype, shape, start, end)} with start/end relative to that section)."""
    if buf.numel() < 8:
        raise VerifyError(f"safetensors: {buf.numel()} bytes cannot hold a header")
    (n,) = struct.unpack("<Q", bytes(buf[:8].numpy()))
    if n > _HEADER_LIMIT or 8 + n > buf.numel():
        raise VerifyError(f"safetensors: header length {n} does not fit the {buf.numel()}-byte object")
    header = json.loads(bytes(buf[8 : 8 + n].numpy()))
    layout = {}
    data_len = buf.numel() - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise VerifyError(f"safetensors: tensor {name!r} has dtype {info['dtype']}, which lorabus does not load")
        start, end = info["data_offsets"]
        if not 0 <= start <= end <= data_len:
            raise VerifyError(f"safetensors: tensor {name!r} spans bytes {start}-{end} of a {data_len}-byte section")
        layout[name] = (_DTYPES[info["dtype"]], list(info["shape"]), start, end)
    return 8 + n, layout


def tensor_views(
    data: torch.Tensor, layout: dict[str, tuple[torch.dtype, list[int], int, int]]
) -> dict[str, torch.Tensor]:
    """Each tensor as a view of the uint8 `data` section (a copy only where a tensor does not
    start on a multiple of its element size, which safetensors' writer avoids)."""
    out = {}
    for name, (dtype, shape, start, end) in layout.items():
        raw = data[start:end]
        try:
            typed = raw.view(dtype)
        except RuntimeError:
            typed = raw.clone().view(dtype)
        out[name] = typed.view(shape)
    return out


class HostBuffers:
    """Reused host buffers for object bytes: allocating page-locked memory costs more than
    reading an adapter, so a buffer is kept and handed out again once it is released."""

    def __init__(self, pinned: bool):
        self.pinned = pinned
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, size: int) -> torch.Tensor:
        """A uint8 tensor of exactly `size` bytes (a view of a buffer at least that large)."""
        with self._lock:
            fits = [b for b in self._free if b.numel() >= size]
            if fits:
                buf = min(fits, key=lambda b: b.numel())
                self._free.remove(buf)
                return buf[:size]
        # room to grow: the next version of the same adapter is the same size
        return torch.empty(size, dtype=torch.uint8, pin_memory=self.pinned)

    def give_back(self, view: torch.Tensor) -> None:
        base = view._base if view._base is not None else view
        with self._lock:
            self._free.append(base)


def _verify(buf: torch.Tensor, obj: ObjectPayload, times: LoadTimes) -> str:
    """The sha256 of the bytes in `buf` (those the slot was filled from), once they are the
    announced ones."""
    t0 = time.perf_counter()
    # hashlib releases the GIL for large buffers: this runs beside the copies and decode steps
    actual = hashlib.sha256(buf.numpy().data).hexdigest()
    times.verify = time.perf_counter() - t0
    if buf.numel() != obj.bytes or actual != obj.sha256:
        raise VerifyError(
            f"{obj.uri}: sha256 mismatch: expected {obj.sha256} ({obj.bytes} bytes), got {actual} ({buf.numel()} bytes)"
        )
    return actual


@dataclass
class Staged:
    """A version the engine serves now, and the verification that decides whether anything it
    generates may leave the replica."""

    times: LoadTimes
    verified: Future[str]
    """the sha256 of the bytes copied into the slot; raises VerifyError when they were not the
    announced ones"""


class Stager:
    """Loads versions into one embedded engine by the fast path (module docstring)."""

    def __init__(self, engine: EmbeddedEngine, store_for: Callable[[str], ObjectStore]):
        self.engine = engine
        self.store_for = store_for
        self.device = engine.device
        self.buffers = HostBuffers(pinned=self.device.type == "cuda")
        self._verifier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="adapter-verify")

    def load(self, ev: AdapterReady) -> Staged:
        """Blocking: on return the version is servable; `verified` resolves a little later."""
        obj = ev.object_payload()
        if obj is None:
            raise ValueError(f"{ev.adapter_name}: no object payload to load")
        times = LoadTimes()
        t0 = time.perf_counter()
        buf = self.buffers.take(obj.bytes)
        users = _Users(2, lambda: self.buffers.give_back(buf))  # the verifier and the device copy
        try:
            self.store_for(obj.uri).read_into(obj.uri, buf.numpy().data)
        except BaseException:
            users.done()
            users.done()
            raise
        t1 = time.perf_counter()
        times.fetch = t1 - t0
        verified = self._verifier.submit(_verify, buf, obj, times)
        verified.add_done_callback(lambda _: users.done())
        try:
            start, layout = parse_safetensors(buf)
            t2 = time.perf_counter()
            times.parse = t2 - t1
            data = buf[start:]
            if self.device.type != "cpu":
                # one copy of the whole data section; the engine's copy into the slot is
                # ordered after it on the same stream
                data = data.to(self.device, non_blocking=True)
            tensors = tensor_views(data, layout)
            if self.device.type == "cuda":
                torch.cuda.current_stream().synchronize()
            t3 = time.perf_counter()
            times.h2d = t3 - t2
            times.copy, times.merge = self.engine.swap_in(ev.version, tensors, ev.lora)
        finally:
            users.done()
        return Staged(times, verified)

    def close(self) -> None:
        self._verifier.shutdown(wait=True)


class _Users:
    """Calls `release` once `n` users are done with a buffer."""

    def __init__(self, n: int, release: Callable[[], None]):
        self._n, self._release, self._lock = n, release, threading.Lock()

    def done(self) -> None:
        with self._lock:
            self._n -= 1
            last = self._n == 0
        if last:
            self._release()
