"""The trainer's end of the XCCL weight sync: rank 0 of a group of the replicas that joined.

Per version (`send`, blocking; publish.py runs it in a thread):

    new joins or new layout?  -> re-form: send the old group an END header, drop it, write
                                 g<e>/members + g<e>/plan, build the group (waits for every
                                 member, at most `timeout_s`)
    pack the adapter into the preallocated buckets
    broadcast the header [VERSION, version, digest]   (members block in this receive between
                                                        versions: the collective notifies them)
    broadcast every bucket; all-reduce one flag per rank ("I have every byte")

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
from dataclasses import dataclass

import torch

from proto.messages import TensorSpec, XcclBackend, XcclPayload
from services.common import xccl

log = logging.getLogger(__name__)


@dataclass
class SendStats:
    """Seconds spent in the last `send`, for metrics and benchmarks."""

    form_s: float = 0.0
    pack_s: float = 0.0
    broadcast_s: float = 0.0
    members: int = 0
    reformed: bool = False
    error: str = ""


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
    ):
        self.address, self.backend = address, backend
        self.bucket_bytes, self.timeout_s = bucket_bytes, timeout_s
        self.device = torch.device(device)
        self.store = xccl.host_store(address, port, timeout_s)
        self.port = self.store.port
        self.token = uuid.uuid4().hex[:8]
        self.epoch = 0
        self.members: dict[str, int] = {}
        self.pg = None
        self.digest = ""
        self.plan: list[xccl.Bucket] = []
        self.buffers: list[torch.Tensor] = []
        self.joins_read = 0
        self._group_digest = ""
        self.stats = SendStats()
        self.durable: concurrent.futures.Future | None = None
        """the durable copy of the last version while it uploads (publish.py); `close` waits"""
        self._lock = threading.Lock()

    @property
    def group_name(self) -> str:
        return f"{self.token}-g{self.epoch}"

    def handle(self, manifest: list[TensorSpec], ranks: dict[str, int]) -> XcclPayload:
        return XcclPayload(
            backend=self.backend,
            master_address=self.address,
            master_port=self.port,
            world_size=len(ranks) + 1 if ranks else 1,
            group_name=self.group_name,
            tensors=manifest,
            bucket_bytes=self.bucket_bytes,
            ranks=dict(ranks),
        )

    # --- membership ---
    def new_joins(self) -> list[str]:
        """Replicas that asked to join since the last look (in join order, deduplicated)."""
        total = self.store.add("join_seq", 0)
        names = [self.store.get(f"join/{i}").decode() for i in range(self.joins_read + 1, total + 1)]
        self.joins_read = total
        return list(dict.fromkeys(names))

    def _reform(self, members: list[str], manifest: list[TensorSpec]) -> None:
        self._drop_group(reason_next=self.epoch + 1)
        self.epoch += 1
        self.members = {name: i + 1 for i, name in enumerate(members)}
        e = self.epoch
        self.store.set(
            f"g{e}/plan",
            xccl.dumps(
                {
                    "manifest": [[s.name, list(s.shape), s.dtype] for s in manifest],
                    "bucket_bytes": self.bucket_bytes,
                    "digest": self.digest,
                    "backend": self.backend,
                }
            ),
        )
        self.store.set(f"g{e}/members", xccl.dumps({"group": self.group_name, "ranks": self.members}))
        self.store.set("epoch", str(e))
        # its own client connection: the group's rendezvous must not hold up our key writes
        pg_store = xccl.connect_store(self.address, self.port, self.timeout_s)
        self.pg = xccl.new_group(self.backend, pg_store, f"g{e}/pg", 0, len(members) + 1, self.timeout_s)

    def _drop_group(self, reason_next: int | None = None) -> None:
        if self.pg is not None and reason_next is not None:
            # members wait in the header receive: point them at the next group (they leave
            # cleanly and read its members from the store); a broken group just closes
            try:
                self.pg.broadcast(xccl.end_header(reason_next), 0).wait(xccl.timeout(self.timeout_s))
            except Exception as exc:
                log.info("xccl: group %s did not take its END header (%s)", self.group_name, exc)
        box, self.pg = [self.pg], None
        xccl.abort_group(box)

    # --- one version ---
    def send(self, version: int, tensors: dict[str, torch.Tensor]) -> XcclPayload:
        """Broadcast `tensors` as `version` to the current members (see the module docstring)."""
        with self._lock:
            return self._send(version, tensors)

    def _send(self, version: int, tensors: dict[str, torch.Tensor]) -> XcclPayload:
        st = self.stats = SendStats()
        manifest = xccl.manifest_of(tensors)
        digest = xccl.manifest_digest(manifest, self.bucket_bytes)
        t0 = time.perf_counter()
        try:
            joins = self.new_joins()
            if digest != self.digest:
                self.digest = digest
                self.plan = xccl.plan_buckets(manifest, self.bucket_bytes)
                self.buffers = xccl.alloc_buckets(self.plan, self.device)
            layout_changed = self.pg is not None and self._group_digest != digest
            if joins or layout_changed:
                wanted = list(self.members) + [j for j in joins if j not in self.members]
                st.reformed = True
                self._reform(wanted, manifest)
                self._group_digest = digest
                log.info("xccl: group %s formed with %s", self.group_name, self.members)
            st.form_s = time.perf_counter() - t0
            if self.pg is None or not self.members:
                return self.handle(manifest, {})
            st.members = len(self.members)
            t1 = time.perf_counter()
            xccl.pack(self.plan, tensors, self.buffers)
            if self.device.type == "cuda":
                torch.cuda.current_stream().synchronize()
            t2 = time.perf_counter()
            st.pack_s = t2 - t1
            wait = xccl.timeout(self.timeout_s)
            self.pg.broadcast(xccl.version_header(version, digest).to(self._flag_device()), 0).wait(wait)
            for buf in self.buffers:
                self.pg.broadcast(buf, 0).wait(wait)
            flags = torch.zeros(len(self.members) + 1, dtype=torch.int64, device=self._flag_device())
            flags[0] = 1
            self.pg.allreduce(flags).wait(wait)
            st.broadcast_s = time.perf_counter() - t2
            got = flags.cpu().tolist()
            ranks = {name: r for name, r in self.members.items() if got[r] == 1}
            if len(ranks) < len(self.members):
                log.warning(
                    "xccl v%d: %s did not stage it (object copy for them)",
                    version,
                    sorted(set(self.members) - set(ranks)),
                )
            return self.handle(manifest, ranks)
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
            return self.handle(manifest, {})

    def last_sent(self) -> dict[str, torch.Tensor]:
        """The last version as broadcast: views into the send buckets, valid until the next
        `send` packs over them (publish.deliver serialises the durable copy from these and
        waits for it before the next send)."""
        return xccl.unpack(self.plan, self.buffers)

    def _flag_device(self) -> torch.device:
        return self.device if self.backend == "nccl" else torch.device("cpu")

    def close(self) -> None:
        if self.durable is not None:  # the last version's object copy finishes uploading first
            concurrent.futures.wait([self.durable], timeout=max(60.0, self.timeout_s))
        with self._lock:
            self._drop_group(reason_next=self.epoch + 1 if self.pg is not None else None)
            self.members = {}
