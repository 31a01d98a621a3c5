"""XCCL weight sync, the parts both ends share: the bucket plan and the rendezvous store.

An adapter travels as a few flat byte buckets (`plan_buckets`), each one collective. Every
tensor lies whole inside one bucket at an offset aligned to `ALIGN` bytes, so a receiver can
view its tensors straight out of the bucket bytes (`unpack`) without a copy.

The trainer's TCPStore is the control plane of the group (the bus announces versions to the
world; the store tells the members what is about to be broadcast). Keys:

    join_seq, join/<i>      a replica asks to be in the next group (`add` gives i)
    epoch                   the newest group's number e
    g<e>/members            JSON {replica: rank} (rank 0 is the trainer)
    g<e>/plan               JSON {"manifest": [...], "bucket_bytes": n}
    g<e>/pg/...             the process group's own rendezvous (a PrefixStore)
    g<e>/send/<k>           JSON header of the k-th broadcast in group e: {"version", "digest"}

The process group is a `ProcessGroupGloo` / `ProcessGroupNCCL` object built directly on that
store, not `torch.distributed.init_process_group`/`new_group`: those are tied to the one
default group of a process, which under torchrun already belongs to the trainer's FSDP ranks.
A directly constructed backend object lives beside the default group, needs no global state,
and is torn down with `abort()` (the peers' pending ops then fail at once with "connection
closed" instead of waiting out their timeouts).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import threading
from dataclasses import dataclass

import torch

from proto.messages import TensorSpec

ALIGN = 16
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class ManifestError(ValueError):
    pass


# --- the plan (pure) -------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Bucket:
    nbytes: int
    entries: tuple[Entry, ...]


def tensor_nbytes(spec: TensorSpec) -> int:
    return math.prod(spec.shape) * DTYPES[spec.dtype].itemsize


def manifest_of(tensors: dict[str, torch.Tensor]) -> list[TensorSpec]:
    """The broadcast order: sorted names, like `adapter_io.to_bytes`."""
    out = []
    for name in sorted(tensors):
        t = tensors[name]
        if t.dtype not in DTYPE_NAMES:
            raise ManifestError(f"tensor {name!r}: dtype {t.dtype} cannot be sent; use one of {sorted(DTYPES)}")
        out.append(TensorSpec(name=name, shape=list(t.shape), dtype=DTYPE_NAMES[t.dtype]))
    return out


def check_manifest(manifest: list[TensorSpec]) -> None:
    if not manifest:
        raise ManifestError("tensors: the manifest is empty; an adapter has at least one tensor")
    seen: set[str] = set()
    for spec in manifest:
        if spec.name in seen:
            raise ManifestError(f"tensors: {spec.name!r} appears twice in the manifest")
        seen.add(spec.name)
        if spec.dtype not in DTYPES:
            raise ManifestError(f"tensors: {spec.name!r} has dtype {spec.dtype!r}; use one of {sorted(DTYPES)}")
        if any(d < 0 for d in spec.shape):
            raise ManifestError(f"tensors: {spec.name!r} has a negative dimension {spec.shape}")


def check_matches(manifest: list[TensorSpec], tensors: dict[str, torch.Tensor]) -> None:
    """`tensors` are exactly what `manifest` promises (names, shapes, dtypes)."""
    expected = {s.name: (tuple(s.shape), s.dtype) for s in manifest}
    got = {n: (tuple(t.shape), DTYPE_NAMES.get(t.dtype, str(t.dtype))) for n, t in tensors.items()}
    if expected != got:
        missing = sorted(set(expected) - set(got))[:3]
        extra = sorted(set(got) - set(expected))[:3]
        differ = sorted(n for n in set(expected) & set(got) if expected[n] != got[n])[:3]
        raise ManifestError(
            f"tensors do not match the manifest: missing {missing}, unexpected {extra}, "
            f"other shape/dtype {differ}"
        )


def plan_buckets(manifest: list[TensorSpec], bucket_bytes: int) -> list[Bucket]:
    """Greedy in manifest order: start a new bucket when the next tensor would overflow it.
    A tensor bigger than `bucket_bytes` gets a bucket of its own (tensors are never split)."""
    check_manifest(manifest)
    if bucket_bytes < 1:
        raise ManifestError(f"bucket_bytes: {bucket_bytes} must be >= 1 (actor.xccl_bucket_mb > 0)")
    buckets: list[Bucket] = []
    entries: list[Entry] = []
    used = 0
    for spec in manifest:
        n = tensor_nbytes(spec)
        start = -(-used // ALIGN) * ALIGN
        if entries and start + n > bucket_bytes:
            buckets.append(Bucket(used, tuple(entries)))
            entries, start = [], 0
        entries.append(Entry(spec.name, tuple(spec.shape), spec.dtype, start, n))
        used = start + n
    if entries:
        buckets.append(Bucket(used, tuple(entries)))
    return buckets


def manifest_digest(manifest: list[TensorSpec], bucket_bytes: int) -> str:
    """Names a layout: equal digests <=> the same buckets with the same tensors in them."""
    doc = [[s.name, list(s.shape), s.dtype] for s in manifest]
    return hashlib.sha256(json.dumps([doc, bucket_bytes]).encode()).hexdigest()[:32]


def bucket_bytes_of(mb: float) -> int:
    return max(1, int(mb * 1024 * 1024))


# --- bytes in and out of buckets -------------------------------------------------------------


def alloc_buckets(plan: list[Bucket], device: torch.device | str = "cpu") -> list[torch.Tensor]:
    return [torch.empty(b.nbytes, dtype=torch.uint8, device=device) for b in plan]


def _view(buf: torch.Tensor, e: Entry) -> torch.Tensor:
    return buf[e.offset : e.offset + e.nbytes].view(DTYPES[e.dtype]).view(e.shape)


def pack(plan: list[Bucket], tensors: dict[str, torch.Tensor], buffers: list[torch.Tensor]) -> None:
    """Copy every tensor into its place in the preallocated `buffers`."""
    for bucket, buf in zip(plan, buffers, strict=True):
        dst, src = [], []
        for e in bucket.entries:
            t = tensors[e.name]
            if tuple(t.shape) != e.shape or DTYPE_NAMES.get(t.dtype) != e.dtype:
                raise ManifestError(
                    f"tensor {e.name!r}: {tuple(t.shape)} {t.dtype} is not the planned {e.shape} {e.dtype}"
                )
            dst.append(_view(buf, e))
            src.append(t.detach())
        torch._foreach_copy_(dst, src)


def unpack(plan: list[Bucket], buffers: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Views into `buffers` (no copy): valid until the buffers are reused."""
    return {e.name: _view(buf, e) for bucket, buf in zip(plan, buffers, strict=True) for e in bucket.entries}


# --- store and group helpers -----------------------------------------------------------------


def timeout(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def host_store(address: str, port: int, timeout_s: float) -> torch.distributed.TCPStore:
    """The trainer's store server; port 0 picks a free one (read it back from `.port`)."""
    return torch.distributed.TCPStore(
        address, port, None, True, timeout=timeout(timeout_s), wait_for_workers=False
    )


def connect_store(address: str, port: int, timeout_s: float) -> torch.distributed.TCPStore:
    return torch.distributed.TCPStore(address, port, None, False, timeout=timeout(timeout_s))


def new_group(backend: str, store, prefix: str, rank: int, world_size: int, timeout_s: float):
    """A process group outside the default one (see the module docstring); blocks until every
    rank has joined or `timeout_s` passes."""
    pstore = torch.distributed.PrefixStore(prefix, store)
    if backend == "gloo":
        return torch.distributed.ProcessGroupGloo(pstore, rank, world_size, timeout(timeout_s))
    if backend == "nccl":
        opts = torch.distributed.ProcessGroupNCCL.Options()
        opts._timeout = timeout(timeout_s)
        return torch.distributed.ProcessGroupNCCL(pstore, rank, world_size, opts)
    raise ValueError(f"actor.xccl_backend: {backend!r} is not gloo or nccl")


def resolve_backend(configured: str, device: torch.device) -> str:
    if configured == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    return configured


def abort_group(pg, wait_s: float = 1.0) -> None:
    """Close the group's connections now so peers stuck in a collective fail fast.

    Runs in a daemon thread and is waited for at most `wait_s`: closing a gloo context whose
    peer vanished can block, and the caller (a trainer step, a receiver re-joining) must not."""
    if pg is None:
        return

    def _abort() -> None:
        try:
            pg.abort()
        except Exception:  # abort of an already broken group; nothing left to close
            pass

    t = threading.Thread(target=_abort, name="xccl-abort", daemon=True)
    t.start()
    t.join(wait_s)


def dumps(obj) -> str:
    return json.dumps(obj, separators=(",", ":"))


def loads(raw: bytes | str):
    return json.loads(raw)
