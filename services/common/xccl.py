"""XCCL weight sync, the parts both ends share: the bucket plan and the rendezvous store.

An adapter travels as a few flat byte buckets (`plan_buckets`), each one collective. Every
tensor lies whole inside one bucket at an offset aligned to `ALIGN` bytes, so a receiver can
view its tensors straight out of the bucket bytes (`unpack`) without a copy.

The trainer's TCPStore is the control plane of the group (the bus announces versions to the
world; the store tells the members what is about to be broadcast). Keys:

    join_seq, join/<i>      a replica asks to be in the next group (`add` gives i): JSON
                            {"replica", "gpu"} (`join_record`; the GPU it stages on, or null)
    epoch                   the newest group's number e
    g<e>/members            JSON {replica: rank} (rank 0 is the trainer)
    g<e>/plan               JSON {"manifest": [...], "bucket_bytes": n, "backend": the group's
                            (`group_backend`: nccl only where every rank has a GPU of its own)}
    g<e>/pg/...             the process group's own rendezvous (a PrefixStore)
    g<e>/released/v<N>      how many members are done with version N's staged copy (`add`)
    g<e>/released/v<N>/all  set by the member whose `add` completes the count

The store is touched when the membership changes and, once per version and member, after the
version is servable there (`released`: a scheduling hint that lets the trainer's durable copy
wait until the members have swapped, so it does not compete with them; it never decides
anything, a missing hint only delays that copy by `RELEASE_WAIT_S`). A version is announced to
the members by the collective itself: a 4-int64 header broadcast (`version_header` /
`end_header`, read back by `read_header`) precedes the buckets, and members block in that receive between
versions, so no member polls the store and the notification costs one small collective.

The process group is a `ProcessGroupGloo` / `ProcessGroupNCCL` object built directly on that
store, not `torch.distributed.init_process_group`/`new_group`: those are tied to the one
default group of a process, which under torchrun already belongs to the trainer's FSDP ranks.
A directly constructed backend object lives beside the default group, needs no global state,
and is torn down by dropping it: its destructor closes the connections, and the peers'
pending ops then fail at once with "connection closed" instead of waiting out their timeouts.
(`abort()` alone does not do that for gloo in torch 2.13: a blocked receive on the other end
stays blocked, and so does one in the same process; measured.)
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from proto.messages import Dtype, TensorSpec, XcclBackend
from services.common.adapter_io import DTYPES

ALIGN = 16
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class ManifestError(ValueError):
    pass


# --- the plan (pure) -------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    name: str
    shape: tuple[int, ...]
    dtype: Dtype
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Bucket:
    nbytes: int
    entries: tuple[Entry, ...]


def tensor_nbytes(spec: TensorSpec) -> int:
    return math.prod(spec.shape) * DTYPES[spec.dtype].itemsize


def manifest_of(tensors: Mapping[str, torch.Tensor]) -> list[TensorSpec]:
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


def pack_views(views: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor]) -> None:
    """`pack` into views made once by `unpack`, for tensors whose manifest digest equals the
    plan's (names, shapes, dtypes already match: no per-tensor check, one fused copy)."""
    torch._foreach_copy_(list(views.values()), [tensors[name].detach() for name in views])


def unpack(plan: list[Bucket], buffers: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Views into `buffers` (no copy): valid until the buffers are reused."""
    return {e.name: _view(buf, e) for bucket, buf in zip(plan, buffers, strict=True) for e in bucket.entries}


# --- the per-version header (pure) -----------------------------------------------------------

HEADER_LEN = 4
VERSION, END = 1, 2
"""header kinds: [VERSION, version, digest hi, digest lo] or [END, next epoch, 0, 0]"""
LEAVING = 0
"""END's next epoch when the trainer closes its group for good (epochs start at 1): the members
wait for a new trainer's handle instead of re-joining an address that is about to go"""


def digest_ints(digest: str) -> tuple[int, int]:
    """The first 120 bits of a manifest digest as two non-negative int64s."""
    return int(digest[:15], 16), int(digest[15:30], 16)


def version_header(version: int, digest: str) -> torch.Tensor:
    return torch.tensor([VERSION, version, *digest_ints(digest)], dtype=torch.int64)


def end_header(next_epoch: int) -> torch.Tensor:
    return torch.tensor([END, next_epoch, 0, 0], dtype=torch.int64)


def read_header(header: torch.Tensor) -> tuple[str, int, tuple[int, int]]:
    """("version", version, digest ints) or ("end", next epoch, (0, 0))."""
    kind, value, hi, lo = (int(x) for x in header.cpu().tolist())
    if kind == VERSION:
        return "version", value, (hi, lo)
    if kind == END:
        return "end", value, (0, 0)
    raise ManifestError(f"xccl header: kind {kind} is neither {VERSION} (version) nor {END} (end)")


# --- store and group helpers -----------------------------------------------------------------


RELEASE_WAIT_S = 1.0
"""at most this long the durable copy waits for the members' `released` hints"""


def released_key(epoch: int, version: int) -> str:
    return f"g{epoch}/released/v{version}"


def all_released_key(epoch: int, version: int) -> str:
    return f"{released_key(epoch, version)}/all"


def timeout(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def host_store(address: str, port: int, timeout_s: float) -> torch.distributed.TCPStore:
    """The trainer's store server; port 0 picks a free one (read it back from `.port`)."""
    return torch.distributed.TCPStore(address, port, None, True, timeout=timeout(timeout_s), wait_for_workers=False)


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


def resolve_backend(configured: Literal["auto", "gloo", "nccl"], device: torch.device) -> XcclBackend:
    """The backend the trainer asks for; each group may still be gloo (`group_backend`)."""
    if configured == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    return configured


# --- which backend a group can use (pure but for `gpu_id`) -----------------------------------
#
# NCCL takes one rank per GPU: a communicator with two ranks on the same device fails at its
# first collective ("Duplicate GPU detected : rank 0 and rank 1 both on CUDA device ...",
# ncclInvalidUsage). On one GPU the trainer and every replica share it, so an nccl group
# there fails for every version and every version falls back to the object copy (seen on the
# H200: 0 of 81 versions reached vLLM by broadcast). Each member says at its join which GPU
# it stages on, and a group is nccl only when every rank has a GPU of its own; else gloo,
# which broadcasts the trainer's CUDA buckets through host memory (a sidecar writes the
# version into a file from host memory anyway).


def gpu_id(device: torch.device | str) -> str | None:
    """The physical GPU a device is (its UUID, unique across hosts), or None off the GPU or
    when CUDA cannot say (then the rank is never counted as having a GPU of its own)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    try:
        props = torch.cuda.get_device_properties(device)
    except Exception:  # no driver here, or a device index this process cannot see
        return None
    uuid = getattr(props, "uuid", None)
    return f"GPU-{uuid}" if uuid is not None else None


def join_record(replica: str, gpu: str | None) -> str:
    """What a member writes under join/<i>: its name and the GPU it stages on."""
    return dumps({"replica": replica, "gpu": gpu})


def parse_join(raw: bytes | str) -> tuple[str, str | None]:
    """(replica, gpu) of a join record; a bare name (a member that predates the record) has
    no GPU known."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    if text.startswith("{"):
        doc = loads(text)
        return str(doc["replica"]), doc.get("gpu")
    return text, None


def group_backend(
    preferred: XcclBackend, trainer_gpu: str | None, member_gpus: Mapping[str, str | None]
) -> tuple[XcclBackend, str]:
    """The backend of a group and, when it is not the preferred one, why (for the log).

    nccl only if asked for and every rank (the trainer's included) stages on a GPU of its own;
    gloo otherwise: a group NCCL cannot form would fail at every version."""
    if preferred == "gloo":
        return "gloo", ""
    if trainer_gpu is None:
        return "gloo", "the trainer's buckets are on no GPU that NCCL can use"
    seen = {trainer_gpu: "the trainer"}
    for name, gpu in sorted(member_gpus.items()):
        if gpu is None:
            return "gloo", f"replica {name} stages on no GPU (NCCL needs one per rank)"
        if gpu in seen:
            return "gloo", f"replica {name} shares {gpu} with {seen[gpu]} (NCCL takes one rank per GPU)"
        seen[gpu] = f"replica {name}"
    return "nccl", ""


def set_timeout(pg, seconds: float) -> None:
    """The timeout of the group's next collectives (a receiver waits for the next version's
    header indefinitely, but for the buckets of a started broadcast only `xccl_timeout_s`)."""
    pg._set_default_timeout(timeout(seconds))


def abort_group(box: list, wait_s: float = 1.0) -> None:
    """Close the group in `box` (a one-element list, emptied here) so peers stuck in a
    collective fail fast: the connections close when the last reference goes, so the caller
    hands its only one over in the box.

    Runs in a daemon thread and is waited for at most `wait_s`: closing a gloo context whose
    peer vanished can block, and the caller (a trainer step, a receiver re-joining) must not."""
    if not box or box[0] is None:
        box.clear()
        return
    holder = [box.pop()]

    def _abort() -> None:
        pg = holder.pop()
        try:
            pg.abort()
        except Exception:  # abort of an already broken group; nothing left to close
            pass
        del pg  # the last reference: gloo closes the pairs here

    t = threading.Thread(target=_abort, name="xccl-abort", daemon=True)
    t.start()
    t.join(wait_s)


UPLOAD_WAIT_S = 60.0
"""how long a reader waits for the durable copy of an XCCL-broadcast version"""


def upload_wait_s(event) -> float:
    """How long the object of `event` (an AdapterReady) may lag its event: an upload time under
    XCCL; none otherwise, since the trainer stores the object before it announces it, so a
    missing one is gone (given up at once rather than blocking every version behind it)."""
    return UPLOAD_WAIT_S if event.xccl_payload() is not None else 0.0


def fetch_when_stored(get, *, what: str, within_s: float = UPLOAD_WAIT_S, first_s: float = 0.05):
    """`get()`, retried while it raises `ObjectNotFound`, with backoff, for at most `within_s`.

    Under XCCL the event of a broadcast version goes out before its durable copy has finished
    uploading (the members already hold it), so a reader of the object (a replica outside the
    group, the exporter, an evaluator) may arrive before the object does."""
    from services.common.store import ObjectNotFound

    deadline = time.monotonic() + within_s
    delay = first_s
    while True:
        try:
            return get()
        except ObjectNotFound:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ObjectNotFound(f"{what}: still not stored {within_s:.0f}s after its event") from None
            time.sleep(min(delay, left))
            delay = min(delay * 2, 2.0)


def dumps(obj) -> str:
    return json.dumps(obj, separators=(",", ":"))


def loads(raw: bytes | str):
    return json.loads(raw)
