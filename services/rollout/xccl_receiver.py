"""A replica's end of the XCCL weight sync: a background thread that stays in the trainer's
group and stages every broadcast version, and `take` for the service's adapter handler.

Lifecycle of the thread (one session per trainer handle, i.e. master address/port):

    connect to the trainer's store, `join` (that is the capability announcement: it proves
    this replica can reach the trainer, and names the GPU it would stage on, so the trainer
    picks a backend every rank can use: `xccl.group_backend`) -> wait for a g<e>/members that names us -> build the
    group, allocate two staging sets of buckets from g<e>/plan -> block in the header receive
    (no timeout: the trainer may train for hours; its death closes the connection) -> on a
    VERSION header receive every bucket into a free staging set (now within `timeout_s`),
    mark the version staged once every byte is in, and send the trainer our flag (a gather
    to rank 0: 1 staged, 0 refused); on an END header leave for the next group, or, when the
    trainer closes for good (END naming `xccl.LEAVING`), wait for a trainer's next handle
    rather than retry an address that is going away.

Nothing is loaded into the engine here. The service calls `take(version, payload)` when the
version's event arrives. A staged version is always complete: a receive that fails or is cut
off (a torn broadcast) raises before `staged` and ends the session. It is servable only once
the trainer says it sent everything: the event, published after the trainer's broadcast and
gather completed without error, names this replica in `ranks`; an event whose group, digest or
ranks do not match what was staged gets None (the object copy then), and its set is reused.
Any failure ends the session (group dropped, staging forgotten) and a new one re-joins, so
the trainer re-forms the group with this replica at its next version.

A staging set taken by the caller stays the caller's until `release`: a consumer whose slot
store holds tensors as they come (the benchmark's replica) keeps the set as the version's slot
(`adopt`, then `release` when it unloads the version: no copy), and a consumer that copies
into slots of its own layout (the embedded engine: stacked, transposed and pre-scaled for its
fused correction; a server's adapter directory) releases right after the copy. A set held by
the caller is never received into: a new version lands in a free set (a new one is allocated
when the caller holds them all).

A thread blocked in the header receive cannot be woken from this process (gloo has no local
cancel): `close` does not wait for it (it is a daemon thread), and a retarget to a new trainer
is noticed at the old trainer's next header or at its death.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from proto.messages import TensorSpec, XcclPayload
from services.common import xccl

log = logging.getLogger(__name__)


@dataclass
class Staged:
    version: int
    group: str
    digest: str
    buffers: list[torch.Tensor]
    views: dict[str, torch.Tensor]
    """every tensor's view into `buffers` (made once per staging set)"""
    epoch: int
    claimed: bool = False
    members: int = 0
    """how many members the event named (for the `released` hint)"""
    hinted: bool = False
    """the `released` hint went out (`adopt` sends it before the set is released)"""


class _Retarget(Exception):
    pass


class _TrainerLeft(Exception):
    """The trainer closed its group for good (an END header naming no next group)."""


IDLE_TIMEOUT_S = 365 * 24 * 3600.0
"""the header receive between versions: effectively forever (a gloo timeout closes the pair,
so a "re-post on timeout" loop is not possible; liveness comes from the connection)"""
RETRY_S = 0.2
"""after a failed session (trainer gone, or not up yet) before connecting again"""


class XcclReceiver:
    def __init__(
        self, replica: str, *, device: torch.device | str = "cpu", timeout_s: float = 30.0, poll_s: float = 0.005
    ):
        self.replica = replica
        self.device = torch.device(device)
        self.gpu = xccl.gpu_id(self.device)
        """the GPU an nccl group would stage on, told to the trainer at the join (None: none)"""
        self.timeout_s, self.poll_s = timeout_s, poll_s
        self._cond = threading.Condition()
        self._target: tuple[str, int] | None = None
        self._target_version = -1
        self._closed = False
        self.group: str | None = None
        """the group this replica is in now (None between sessions)"""
        self.plan: list[xccl.Bucket] = []
        self.manifest: list[TensorSpec] = []
        self.bucket_bytes = 0
        self.staging_device = torch.device("cpu")
        self.digest = ""
        self._sets: list[list[torch.Tensor]] = []
        self._views: dict[int, dict[str, torch.Tensor]] = {}
        """id(staging set) -> its tensor views"""
        self._staged: dict[int, Staged] = {}
        self._pg: dist.ProcessGroup | None = None
        self._store: dist.TCPStore | None = None
        """the session's store connection (also used by `release`, from the service's thread)"""
        self._epoch = 0
        self.sessions = 0
        self.joined: tuple[str, int] | None = None
        """the trainer handle this replica last registered with"""
        self.last_receive_s = 0.0
        self.stamps: dict[str, float] = {}
        """time.monotonic() of the last version's stages (header, received, staged)"""
        self._thread = threading.Thread(target=self._run, name=f"xccl-{replica}", daemon=True)
        self._thread.start()

    # --- called by the service ---
    def observe(self, payload: XcclPayload, version: int) -> None:
        """The newest event's handle names the trainer to join (a restarted trainer has a new
        one); handles of older, replayed events are ignored."""
        with self._cond:
            if version < self._target_version:
                return
            self._target_version = version
            target = (payload.master_address, payload.master_port)
            if target != self._target:
                self._target = target
                self._cond.notify_all()

    def take(self, version: int, payload: XcclPayload, wait_s: float = 2.0) -> dict[str, torch.Tensor] | None:
        """The staged tensors of `version` (views of a set that stays the caller's until
        `release`: copy them and release, or `adopt` them as the version's slot), or None when
        this replica does not hold exactly what the event describes."""
        if self.replica not in payload.ranks:
            return None
        deadline = time.monotonic() + wait_s
        with self._cond:
            # the trainer publishes after our flag came back and we stage before sending it,
            # so the version is staged when its event arrives; the wait covers a re-delivered
            # event racing a re-join, and lasts only while in that group
            while version not in self._staged and self.group == payload.group_name:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            st = self._staged.get(version)
            # the staged views were cut from this very manifest (`_prepare`), so equal
            # manifests (one C-level comparison) mean the views match the event exactly
            if (
                st is not None
                and st.group == payload.group_name
                and st.digest == self.digest
                and payload.bucket_bytes == self.bucket_bytes
                and payload.tensors == self.manifest
            ):
                for v in [v for v in self._staged if v < version and not self._staged[v].claimed]:
                    del self._staged[v]
                st.claimed, st.members = True, len(payload.ranks)
                return dict(st.views)  # the caller's own dict: the cached one stays as cut
            in_group = self._epoch if self.group == payload.group_name else None
        # this replica takes the object copy: the trainer's durable copy need not wait for it
        if in_group is not None:
            self._hint_released(in_group, version, len(payload.ranks))
        return None

    def adopt(self, version: int) -> None:
        """The caller serves the taken views of `version` as they are (its slot is this set):
        the trainer hears that the swap is done (`released` hint), and the set stays out of
        the receiver's use until `release(version)`."""
        with self._cond:
            st = self._staged.get(version)
            if st is None or not st.claimed or st.hinted:
                return
            st.hinted = True
        self._hint_in_background(st)

    def release(self, version: int) -> None:
        """Done with the staged copy of `version` (the engine holds a copy now, refused it, or
        unloaded the adopted version): its buffers are free, and the trainer hears it
        (`released` hint, xccl.py) unless `adopt` told it already."""
        with self._cond:
            st = self._staged.pop(version, None)
            self._cond.notify_all()
        if st is not None and st.claimed and not st.hinted:
            self._hint_in_background(st)

    def _hint_in_background(self, st: Staged) -> None:
        # a round trip to the trainer's store: not on the caller's thread (the service calls
        # this from its event loop)
        hint = threading.Thread(
            target=self._hint_released, args=(st.epoch, st.version, st.members), name="xccl-released", daemon=True
        )
        hint.start()

    def _hint_released(self, epoch: int, version: int, members: int) -> None:
        """Count this member done with `version`; the last one sets the `all` key the trainer's
        durable copy waits for. Best effort: a lost hint only delays that copy."""
        store = self._store
        if store is None:
            return
        try:
            if store.add(xccl.released_key(epoch, version), 1) == members:
                store.set(xccl.all_released_key(epoch, version), "1")
        except Exception as exc:  # the trainer went away: nothing waits for the hint
            log.info("xccl %s: released hint for v%d not delivered (%s)", self.replica, version, exc)

    def close(self, wait_s: float = 1.0) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        # a thread between sessions ends now; one blocked in a header receive ends with the
        # trainer's next header or its connection (daemon: it does not hold up the exit)
        self._thread.join(timeout=wait_s)

    # --- the thread ---
    def _run(self) -> None:
        while True:
            with self._cond:
                while self._target is None and not self._closed:
                    self._cond.wait()
                if self._closed or self._target is None:  # the wait ends with a target, or closed
                    return
                target = self._target
            try:
                self._session(target)
            except _Retarget:
                continue
            except _TrainerLeft:
                log.info("xccl %s: the trainer at %s:%d closed its group; waiting for a trainer's next handle",
                         self.replica, *target)  # fmt: skip
                with self._cond:  # its address is going away: no retries against it
                    if self._target == target:
                        self._target = None
                continue
            except Exception as exc:
                log.warning(
                    "xccl %s: session with %s:%d ended: %s", self.replica, *target, f"{type(exc).__name__}: {exc}"[:300]
                )
            finally:
                self._end_session()
            with self._cond:  # a dead trainer: wait before trying its address again
                if not self._closed and self._target == target:
                    self._cond.wait(RETRY_S)

    def _check(self, target) -> None:
        if self._closed or self._target != target:
            raise _Retarget()

    def _wait_key(self, store, key: str, target) -> bytes:
        """Block until `key` exists, noticing close/retarget between polls.

        Polls with `check` instead of `TCPStore.wait`: a wait that times out leaves the server
        holding a waiter for that client, and under several clients we saw a later wait on the
        same key stall for seconds after the key was set."""
        while True:
            self._check(target)
            if store.check([key]):
                return store.get(key)
            time.sleep(self.poll_s)

    def _session(self, target: tuple[str, int]) -> None:
        # a short connect timeout: a dead trainer's address must not keep us from a new one
        store = xccl.connect_store(*target, min(self.timeout_s, 1.0))
        self._store = store
        self.sessions += 1
        store.set(f"join/{store.add('join_seq', 1)}", xccl.join_record(self.replica, self.gpu))
        self.joined = target
        epoch = int(store.get("epoch")) if store.check(["epoch"]) else 0
        while True:
            epoch += 1
            members = xccl.loads(self._wait_key(store, f"g{epoch}/members", target))
            if self.replica not in members["ranks"]:
                continue
            rank, world = members["ranks"][self.replica], len(members["ranks"]) + 1
            plan_doc = xccl.loads(store.get(f"g{epoch}/plan"))
            self._prepare(plan_doc)
            # the group gets a store connection of its own: a gloo rank blocks on the store it
            # was built with (connection setup), and our key waits must not queue behind it
            pg_store = xccl.connect_store(*target, self.timeout_s)
            self._pg = pg = xccl.new_group(plan_doc["backend"], pg_store, f"g{epoch}/pg", rank, world, self.timeout_s)
            group: str = members["group"]
            with self._cond:
                self.group, self._epoch = group, epoch
                self._cond.notify_all()
            log.info("xccl %s: in group %s as rank %d of %d", self.replica, self.group, rank, world)
            header = torch.zeros(xccl.HEADER_LEN, dtype=torch.int64, device=self.staging_device)
            while True:
                self._check(target)
                xccl.set_timeout(pg, IDLE_TIMEOUT_S)
                pg.broadcast(header, 0).wait()
                kind, value, digest = xccl.read_header(header)
                if kind == "end" and value == xccl.LEAVING:
                    raise _TrainerLeft()
                if kind == "end":
                    log.info("xccl %s: group %s ends, next is g%d", self.replica, self.group, value)
                    break
                xccl.set_timeout(pg, self.timeout_s)
                self._receive(pg, group, value, digest)
            box, self._pg = [self._pg], None
            xccl.abort_group(box)
            with self._cond:
                self.group = None
            epoch = value - 1

    def _prepare(self, plan_doc: dict) -> None:
        if plan_doc["digest"] == self.digest and self._sets:
            return
        manifest = [TensorSpec(name=n, shape=s, dtype=d) for n, s, d in plan_doc["manifest"]]
        if xccl.manifest_digest(manifest, plan_doc["bucket_bytes"]) != plan_doc["digest"]:
            raise xccl.ManifestError("g<e>/plan: its digest does not match its manifest")
        self.plan = xccl.plan_buckets(manifest, plan_doc["bucket_bytes"])
        # gloo moves host memory; only an nccl group stages on the engine's GPU
        self.staging_device = self.device if plan_doc["backend"] == "nccl" else torch.device("cpu")
        with self._cond:
            self._staged.clear()
            self.digest = plan_doc["digest"]
            self.manifest, self.bucket_bytes = manifest, plan_doc["bucket_bytes"]
            self._sets = [xccl.alloc_buckets(self.plan, self.staging_device) for _ in range(2)]
            self._views = {id(b): xccl.unpack(self.plan, b) for b in self._sets}

    def _free_set(self) -> list[torch.Tensor]:
        """A set nobody reads: not staged, or staged and never taken (the oldest such version
        goes first); a set the caller holds (taken, not yet released) is never handed out."""
        with self._cond:
            used = {id(s.buffers) for s in self._staged.values()}
            for buffers in self._sets:
                if id(buffers) not in used:
                    return buffers
            for v in sorted(self._staged):
                if not self._staged[v].claimed:
                    return self._staged.pop(v).buffers
            # the caller holds every set (adopted versions): one more, kept for the layout
            buffers = xccl.alloc_buckets(self.plan, self.staging_device)
            self._sets.append(buffers)
            self._views[id(buffers)] = xccl.unpack(self.plan, buffers)
            return buffers

    def _receive(self, pg: dist.ProcessGroup, group: str, version: int, digest: tuple[int, int]) -> None:
        t0 = time.perf_counter()
        self.stamps = {"header": time.monotonic()}
        buffers = self._free_set()
        wait = xccl.timeout(self.timeout_s)
        for buf in buffers:
            pg.broadcast(buf, 0).wait(wait)
        if self.staging_device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        self.stamps["received"] = time.monotonic()
        # a header of another layout than our plan: receive its bytes (the collective must
        # complete) but never stage them; the flag tells the trainer to list us out. Staged
        # before the flag goes out: the event that names us (sent after the trainer has every
        # flag) finds it staged. Not servable yet: only that event makes it so (`take`).
        ok = digest == xccl.digest_ints(self.digest)
        if ok:
            views = self._views.get(id(buffers)) or xccl.unpack(self.plan, buffers)
            with self._cond:
                self._staged[version] = Staged(version, group, self.digest, buffers, views, self._epoch)
                self._cond.notify_all()
        self.stamps["staged"] = time.monotonic()
        opts = dist.GatherOptions()
        opts.rootRank = 0
        flag = torch.tensor([1 if ok else 0], dtype=torch.int64, device=self.staging_device)
        pg.gather([], [flag], opts).wait(wait)
        self.last_receive_s = time.perf_counter() - t0

    def _end_session(self) -> None:
        self._store = None
        box, self._pg = [self._pg], None
        xccl.abort_group(box)
        with self._cond:
            self.group = None
            self._staged = {v: s for v, s in self._staged.items() if s.claimed}
            self._cond.notify_all()
