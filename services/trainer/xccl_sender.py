"""The trainer's end of the XCCL weight sync: rank 0 of a group of the replicas that joined.

Per version (`send`, blocking; publish.py runs it in a thread):

    new joins or new layout?  -> re-form: send the old group an END header, drop it, write
                                 g<e>/members + g<e>/plan, build the group (waits for every
                                 member, at most `timeout_s`); the group is nccl only when
                                 every rank has a GPU of its own (`xccl.group_backend`: the
                                 members name theirs at the join), else gloo
    the adapter in a send set: written there by the trainer itself (`fill_views`: the
    engine's cast lands in the buckets, no pack), or else packed into the free set
    broadcast the header [VERSION, version, digest]   (members block in this receive between
                                                        versions: the collective notifies them)
    broadcast every bucket; gather one flag per member ("I have every byte")

Two send sets per layout, used in turn: the durable copy of version N reads N's set (publish.py)
while the trainer writes N+1 into the other; N+2 comes back to N's set only after the next
`deliver` has waited for N's copy, so a set is never written while it is read.

It returns the `XcclPayload` for the event: `ranks` lists exactly the members whose flag came
back set, so a replica named there has the whole version staged and a replica not named falls
back to the object copy. Any failure (a member died, timed out, a rendezvous never completed)
drops the group (its connections close, so the survivors' pending receives fail at once),
forgets the members and returns a handle with no ranks: the version reaches everyone through
the object copy, and the survivors re-join for the next version.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from proto.messages import TensorSpec, XcclBackend, XcclPayload
from services.common import adapter_io, xccl

log = logging.getLogger(__name__)
SETS = 2
"""send sets per layout: the one being written and the one the durable copy reads"""


@dataclass
class SendStats:
    """Seconds spent in the last `send`, for metrics and benchmarks."""

    form_s: float = 0.0
    pack_s: float = 0.0
    """0 when the adapter was written into the send set by the trainer (`fill_views`)"""
    header_s: float = 0.0
    buckets_s: float = 0.0
    flag_s: float = 0.0
    broadcast_s: float = 0.0
    """header + buckets + flag"""
    packed: bool = False
    members: int = 0
    reformed: bool = False
    error: str = ""


@dataclass
class Layout:
    """One adapter layout's send state (fixed for a run: a new one only if shapes change)."""

    manifest: list[TensorSpec]
    digest: str
    plan: list[xccl.Bucket]
    sets: list[list[torch.Tensor]]
    views: list[Mapping[str, torch.Tensor]]
    """per set: every tensor's view into its buckets (read-only mapping of the view objects)"""
    size: int
    """bytes of the durable (safetensors) copy"""
    durable_buffer: torch.Tensor | None = field(default=None, repr=False)

    @classmethod
    def of(cls, manifest: list[TensorSpec], digest: str, bucket_bytes: int, device: torch.device) -> Layout:
        plan = xccl.plan_buckets(manifest, bucket_bytes)
        sets = [xccl.alloc_buckets(plan, device) for _ in range(SETS)]
        views: list[Mapping[str, torch.Tensor]] = [MappingProxyType(xccl.unpack(plan, b)) for b in sets]
        return cls(manifest, digest, plan, sets, views, adapter_io.serialized_size(views[0]))

    def set_of(self, tensors: Mapping[str, torch.Tensor]) -> int | None:
        """The set whose views `tensors` are, every one of them (written in place), if any."""
        for i, views in enumerate(self.views):
            if len(tensors) == len(views) and all(tensors.get(n) is v for n, v in views.items()):
                return i
        return None


class XcclSender:
    def __init__(
        self,
        *,
        address: str,
        port: int,
        backend: XcclBackend,
        bucket_bytes: int,
        timeout_s: float,
        device: torch.device | str = "cpu",
        release_wait_s: float = xccl.RELEASE_WAIT_S,
    ):
        """`release_wait_s`: how long the durable copy waits for the members' swap
        (`wait_released`); 0 starts it at once (the benchmark's `xccl_eager` compares)."""
        self.address = address
        self.backend: XcclBackend = backend
        """the backend asked for; `group_backend` is the current group's (`xccl.group_backend`)"""
        self.group_backend: XcclBackend = backend
        self.release_wait_s = release_wait_s
        self.bucket_bytes, self.timeout_s = bucket_bytes, timeout_s
        self.device = torch.device(device)
        self.gpu = xccl.gpu_id(self.device)
        self.store = xccl.host_store(address, port, timeout_s)
        self.port = self.store.port
        self.token = uuid.uuid4().hex[:8]
        self.epoch = 0
        self.members: dict[str, int] = {}
        self.member_gpus: dict[str, str | None] = {}
        """the GPU each replica said at its last join it stages on"""
        self.pg = None
        self.layout: Layout | None = None
        self.current = 0
        """the send set of the last version"""
        self.joins_read = 0
        self._group_digest = ""
        self.stats = SendStats()
        self.durable: concurrent.futures.Future | None = None
        """the durable copy of the last version while it uploads (publish.py); `close` waits"""
        self._gate: torch.distributed.TCPStore | None = None
        """the store connection `wait_released` waits on"""
        self._lock = threading.Lock()

    @property
    def group_name(self) -> str:
        return f"{self.token}-g{self.epoch}"

    @property
    def digest(self) -> str:
        return self.layout.digest if self.layout is not None else ""

    def handle(self, manifest: list[TensorSpec], ranks: dict[str, int]) -> XcclPayload:
        return XcclPayload(
            backend=self.group_backend,
            master_address=self.address,
            master_port=self.port,
            world_size=len(ranks) + 1 if ranks else 1,
            group_name=self.group_name,
            tensors=manifest,
            bucket_bytes=self.bucket_bytes,
            ranks=dict(ranks),
        )

    # --- where the next version goes ---
    def fill_views(self) -> Mapping[str, torch.Tensor] | None:
        """The free send set's tensor views (names, shapes and dtypes of the last version),
        for the trainer to write the next version into in place and then pass to `send`
        as is: no pack copy. None before the first version fixed the layout.

        Valid until the version after next: the trainer writes them, sends, checkpoints,
        and the set is handed out again only two versions later."""
        if self.layout is None:
            return None
        return self.layout.views[(self.current + 1) % SETS]

    # --- membership ---
    def new_joins(self) -> list[str]:
        """Replicas that asked to join since the last look (in join order, deduplicated)."""
        total = self.store.add("join_seq", 0)
        names = []
        for i in range(self.joins_read + 1, total + 1):
            name, gpu = xccl.parse_join(self.store.get(f"join/{i}"))
            self.member_gpus[name] = gpu
            names.append(name)
        self.joins_read = total
        return list(dict.fromkeys(names))

    def _reform(self, members: list[str], manifest: list[TensorSpec]) -> None:
        self._drop_group(reason_next=self.epoch + 1)
        self.epoch += 1
        self.members = {name: i + 1 for i, name in enumerate(members)}
        backend, why = xccl.group_backend(self.backend, self.gpu, {n: self.member_gpus.get(n) for n in members})
        if why:
            log.warning("xccl: group %s is %s, not %s: %s", self.group_name, backend, self.backend, why)
        self.group_backend = backend
        e = self.epoch
        self.store.set(
            f"g{e}/plan",
            xccl.dumps(
                {
                    "manifest": [[s.name, list(s.shape), s.dtype] for s in manifest],
                    "bucket_bytes": self.bucket_bytes,
                    "digest": self.digest,
                    "backend": backend,
                }
            ),
        )
        self.store.set(f"g{e}/members", xccl.dumps({"group": self.group_name, "ranks": self.members}))
        self.store.set("epoch", str(e))
        # its own client connection: the group's rendezvous must not hold up our key writes
        pg_store = xccl.connect_store(self.address, self.port, self.timeout_s)
        self.pg = xccl.new_group(backend, pg_store, f"g{e}/pg", 0, len(members) + 1, self.timeout_s)

    def _drop_group(self, reason_next: int | None = None) -> None:
        if self.pg is not None and reason_next is not None:
            # members wait in the header receive: point them at the next group (they leave
            # cleanly and read its members from the store); a broken group just closes
            try:
                self.pg.broadcast(xccl.end_header(reason_next).to(self._flag_device()), 0).wait(
                    xccl.timeout(self.timeout_s)
                )
            except Exception as exc:
                log.info("xccl: group %s did not take its END header (%s)", self.group_name, exc)
        box, self.pg = [self.pg], None
        xccl.abort_group(box)

    # --- one version ---
    def send(
        self, version: int, tensors: Mapping[str, torch.Tensor], beside: Callable[[], object] | None = None
    ) -> XcclPayload:
        """Broadcast `tensors` as `version` to the current members (see the module docstring).
        `tensors`: the views `fill_views` handed out, written in place (nothing is copied
        here), or any other tensors, packed into the free send set. `beside`: run once on
        this thread while the buckets are on the wire (at once if nobody is in the group);
        what it raises is raised after the broadcast (which it does not affect)."""
        errors: list[Exception] = []
        done = False

        def once() -> None:
            nonlocal done
            if beside is not None and not done:
                done = True
                try:
                    beside()
                except Exception as exc:
                    errors.append(exc)

        with self._lock:
            try:
                payload = self._send(version, tensors, once)
            finally:
                once()
        if errors:
            raise errors[0]
        return payload

    def _place(self, tensors: Mapping[str, torch.Tensor]) -> int:
        """The send set that holds `tensors` now: theirs when they are a set's views, else the
        free set, packed (a new layout, new sets: shapes changed)."""
        st = self.stats
        filled = self.layout.set_of(tensors) if self.layout is not None else None
        if filled is not None:
            return filled
        t0 = time.perf_counter()
        manifest = xccl.manifest_of(tensors)
        digest = xccl.manifest_digest(manifest, self.bucket_bytes)
        if self.layout is None or digest != self.layout.digest:
            self.layout = Layout.of(manifest, digest, self.bucket_bytes, self.device)
        free = (self.current + 1) % SETS
        xccl.pack_views(self.layout.views[free], tensors)
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        st.pack_s, st.packed = time.perf_counter() - t0, True
        return free

    def _send(self, version: int, tensors: Mapping[str, torch.Tensor], beside: Callable[[], None]) -> XcclPayload:
        st = self.stats = SendStats()
        where = self._place(tensors)
        layout = self.layout
        assert layout is not None  # _place made it
        self.current = where
        t0 = time.perf_counter()
        try:
            joins = self.new_joins()
            layout_changed = self.pg is not None and self._group_digest != layout.digest
            if joins or layout_changed:
                wanted = list(self.members) + [j for j in joins if j not in self.members]
                st.reformed = True
                self._reform(wanted, layout.manifest)
                self._group_digest = layout.digest
                log.info("xccl: group %s formed with %s", self.group_name, self.members)
            st.form_s = time.perf_counter() - t0
            if self.pg is None or not self.members:
                return self.handle(layout.manifest, {})
            st.members = len(self.members)
            wait = xccl.timeout(self.timeout_s)
            t1 = time.perf_counter()
            self.pg.broadcast(xccl.version_header(version, layout.digest).to(self._flag_device()), 0).wait(wait)
            t2 = time.perf_counter()
            works = [self.pg.broadcast(buf, 0) for buf in layout.sets[where]]
            beside()  # gloo's/NCCL's own threads move the bytes meanwhile
            for work in works:
                work.wait(wait)
            t3 = time.perf_counter()
            got = self._gather_flags(self.pg, wait)
            t4 = time.perf_counter()
            st.header_s, st.buckets_s, st.flag_s, st.broadcast_s = t2 - t1, t3 - t2, t4 - t3, t4 - t1
            ranks = {name: r for name, r in self.members.items() if got[r] == 1}
            if len(ranks) < len(self.members):
                log.warning(
                    "xccl v%d: %s did not stage it (object copy for them)",
                    version,
                    sorted(set(self.members) - set(ranks)),
                )
            return self.handle(layout.manifest, ranks)
        except Exception as exc:
            st.error = f"{type(exc).__name__}: {exc}"[:500]
            log.warning(
                "xccl v%d: group %s failed (%s); aborted, the object copy serves this version and members re-join",
                version,
                self.group_name,
                st.error,
            )
            self._drop_group()
            self.members = {}
            return self.handle(layout.manifest, {})

    def last_sent(self) -> Mapping[str, torch.Tensor]:
        """The last version as broadcast: views into its send set, untouched until the version
        after next is written there (publish.deliver serialises the durable copy from these
        and the next `deliver` waits for it)."""
        if self.layout is None:
            raise RuntimeError("last_sent: nothing was sent yet")
        return self.layout.views[self.current]

    def object_size(self) -> int:
        """Bytes of the durable copy of the last version (from its layout; no data read)."""
        if self.layout is None:
            raise RuntimeError("object_size: nothing was sent yet")
        return self.layout.size

    def wait_released(self, epoch: int, version: int) -> bool:
        """Block until every member of group `epoch` that was sent `version` is done with it
        (the `released` hint, xccl.py) or `release_wait_s` passed; True if they all said so.
        Called by the durable copy's thread before it starts, so that it does not compete
        with the members' swap.

        Its own store connection, used by this one waiter: a `wait` that times out may leave
        the server answering it later on that connection, so a timed-out one is dropped."""
        if self.release_wait_s <= 0:
            return False
        key = xccl.all_released_key(epoch, version)
        try:
            if self._gate is None:
                self._gate = xccl.connect_store(self.address, self.port, self.timeout_s)
            self._gate.wait([key], xccl.timeout(self.release_wait_s))
            self._gate.delete_key(key)
            self._gate.delete_key(xccl.released_key(epoch, version))
            return True
        except Exception:  # timed out (a member died or never got the event): go ahead
            self._gate = None
            return False

    def durable_buffer(self) -> torch.Tensor:
        """A host buffer for the durable copy of the last version, kept for the layout (one
        copy is in flight at a time): warm memory, no fresh 37 MB per version. Page-locked
        when the buckets are on a GPU."""
        layout = self.layout
        if layout is None:
            raise RuntimeError("durable_buffer: nothing was sent yet")
        if layout.durable_buffer is None:
            pinned = self.device.type == "cuda"
            layout.durable_buffer = torch.empty(layout.size, dtype=torch.uint8, pin_memory=pinned)
        return layout.durable_buffer

    def _gather_flags(self, pg, wait) -> list[int]:
        """Every rank's flag (1: "I staged every byte"; ours, rank 0's, is 1): a gather to us,
        one message per member, where an all-reduce took several rounds on every rank
        (0.3 vs 0.8 ms for 2 members on 2 CPU cores)."""
        device = self._flag_device()
        flags = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(len(self.members) + 1)]
        opts = torch.distributed.GatherOptions()
        opts.rootRank = 0
        pg.gather([flags], [torch.ones(1, dtype=torch.int64, device=device)], opts).wait(wait)
        return [int(x) for x in torch.cat(flags).cpu().tolist()]

    def _flag_device(self) -> torch.device:
        return self.device if self.group_backend == "nccl" else torch.device("cpu")

    def close(self) -> None:
        if self.durable is not None:  # the last version's object copy finishes uploading first
            concurrent.futures.wait([self.durable], timeout=max(60.0, self.timeout_s))
        with self._lock:
            self._drop_group(reason_next=xccl.LEAVING if self.pg is not None else None)
            self.members = {}
