"""The adapter follower of a rollout replica: which versions its engine serves, and why.

A durable consumer of the ADAPTERS stream (one per replica, `rollout-<replica>`). On start the
newest AdapterReady in the stream is loaded first, so a late or restarted replica serves the
head at once; older events replayed after it are skipped when outside the keep window. Every
load goes through the replica's loaders in order (`loaders`: XCCL-staged tensors, the fast
path, the verified fetch) and is served as `{lora_name}-v{N}`, with retries and backoff here;
each failure is reported (AdapterFailed), the last one re-raised so the bus redelivers or
dead-letters the event: a version is never silently skipped. A version leaves the engine only
outside the keep window and unpinned, or after failing a check. Each loaded version keeps the
sha256 its loader hashed from the bytes it handed the engine (`identity`): what the trajectories
it generates name.

A loaded version is marked loaded (granted, AdapterLoaded reported) at once, and checked while it
serves: the embedded engine's fast path (`load_path.Stager`) hashes the bytes it copied, and an
event that carries a canary, or says one follows it (read from the CANARIES stream as it comes,
`canary.obtain`), has it decoded under the version's name (`canary`). `trusted()` is
the gate the work side passes before publishing: it waits for the checks in flight of every
version the output may have used and refuses output that overlapped a version whose check
failed. Such a version is withdrawn at once (left out of `loaded()`, so no grant pins it again)
and unloaded once unpinned; after a failed sha256 it is loaded again by the verify-first path,
after a failed canary it is given up (the same weights fail again), as after a canary that never
came or is not the event's.

A canary that follows its event can only come from the trainer that announced the version. A
later event whose trainer step did not rise past the version's says that trainer is gone and its
successor resumed from an older checkpoint (announced, not checkpointed: the version is out of
the lineage): its canary never comes, so the wait for it ends there (`canary.obtain`'s `orphaned`,
after one more read of the stream) instead of holding the version's output for
rollout.canary_wait_s (60 s of a stalled run, in CI's chaos run).

Server engines forget (a restarted server): `watch_engine_loop` and `restore()` load again the
versions still admissible, so a grant's version is served again rather than dropped. A version
loaded again is checked against its canary as on its first load, before `restore()` returns
(output published meanwhile waits for it): a restarted server may come back answering a name
with other weights (the base, another copy); one that fails is withdrawn and given up, and the
replica goes on with the versions that passed.

Invariant: no output generated under a version is published before that version's checks (its
canary, and the fast path's sha256) passed on this replica; a version whose canary fails never
has its output published and leaves the replica, which keeps serving the versions that passed.

The work side (`service.RolloutService`) pins versions in `book`, waits on `changed`, and
calls `restore()` when a generation finds its version gone.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Callable, Collection, Coroutine
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import msgspec

from proto import subjects
from proto.messages import AdapterFailed, AdapterLoaded, AdapterReady, AdapterUnloaded, Canary, LoadedVia
from services.common import lineage, streams
from services.common.bus import Bus, Refused
from services.common.pull import Puller
from services.common.store import ObjectCorrupt, ObjectNotFound, OutsideStore
from services.config.schema import LorabusConfig
from services.rollout import canary, loaders, metrics
from services.rollout.engines.base import Engine
from services.rollout.versions import VersionBook

if TYPE_CHECKING:
    from services.rollout.load_path import Staged, Stager
    from services.rollout.xccl_receiver import XcclReceiver

log = logging.getLogger(__name__)


class InFlight(NamedTuple):
    """A check of served weights, still running."""

    kind: Literal["sha256", "canary"]
    version: int | None
    """the version whose output waits for it; None: all output (a sha256's, a restore's)"""


class AdapterFollower:
    def __init__(
        self,
        cfg: LorabusConfig,
        replica: str,
        engine: Engine,
        bus: Bus,
        *,
        keep: int,
        fetch: Callable[[AdapterReady], bytes],
        engine_name: str,
        load_attempts: int,
        retry_base_s: float,
        xccl: XcclReceiver | None = None,
        stager: Stager | None = None,
    ):
        self.cfg, self.run_id, self.replica = cfg, cfg.run, replica
        self.engine, self.bus, self.fetch, self.engine_name = engine, bus, fetch, engine_name
        self.keep = keep
        self.book = VersionBook(keep)
        # read at scrape time from the book, which drops a version only after the engine's
        # unload returned: what a soak watches to see old versions really leave
        metrics.LOADED_VERSIONS.labels(self.run_id, replica).set_function(lambda: len(self.book.loaded()))
        self.load_attempts, self.retry_base_s = load_attempts, retry_base_s
        self.newest_seen = -1
        """the newest version followed (only events that passed `_refusal` count)"""
        self.epoch: str | None = None
        """the run's trainer epoch (the stream's first event's), once known"""
        self.changed = asyncio.Condition()
        """notified when a version is loaded or unpinned"""
        self._events: dict[int, AdapterReady] = {}
        """the event of every loaded version: what re-loading a version the engine lost reads"""
        self._steps: dict[int, int] = {}
        """the trainer step of each version followed, within the keep window (`orphaned_by`)"""
        self._canary_waits: dict[int, asyncio.Future[str]] = {}
        """versions whose canary is awaited -> set (to the reason) once it never can come"""
        self._loading: int | None = None
        self._restore_failures: dict[int, int] = {}
        self._restoring = asyncio.Lock()
        # collect() runs from the load path and after every generation: one at a time, or two
        # callers would both try to unload the same version
        self._collecting = asyncio.Lock()
        self._load_lock = asyncio.Lock()
        self.xccl = xccl
        """the XcclReceiver (created in `start` under weight_update_mode: xccl)"""
        self.stager = stager
        """the fast load path (embedded engine); None: fetch verified bytes, then load"""
        self._checks: dict[asyncio.Future[Any], InFlight] = {}
        """checks of served weights still running: the fast path's sha256, canaries (a restore's
        re-checks among them)"""
        self._tainted: list[list[float]] = []
        """[from, until] (time.monotonic) of each version served that failed a check"""
        self._withdrawn: set[int] = set()
        self._settling: set[asyncio.Task] = set()
        self._loaders, self._fetch_loader = loaders.loaders(
            engine, fetch, replica=replica, receiver=lambda: self.xccl, stager=stager
        )
        self._sha256: dict[int, str | None] = {}
        """each loaded version's digest as its loader hashed it (None: XCCL tensors, or a
        fast-path check still running)"""
        self.engine_id = ",".join(getattr(engine, "urls", None) or [replica])[:256]
        """the engine instance token ranges name: its servers' URLs, or the replica (embedded)"""

    def loaded(self) -> list[int]:
        """Versions that may be granted: loaded, and not withdrawn after a failed check."""
        return [v for v in self.book.loaded() if v not in self._withdrawn]

    def identity(self, version: int) -> tuple[str | None, str]:
        """(sha256 of the adapter bytes loaded as `version`, engine instance): what a token range
        generated by it names. Read after `trusted`, when the version's checks have ended."""
        return self._sha256.get(version), self.engine_id

    async def trusted(self, since: float, versions: Collection[int]) -> bool:
        """Whether output generated on `versions` from `since` (time.monotonic) to now may be
        published: every check in flight of weights it may have used has passed (waited for
        here), and no version that failed one was served meanwhile. What it waited for canaries
        is observed (`CANARY_WAIT_SECONDS`): the replica canary's cost to the run."""
        # A canary holds its own version's output only: the rows of other versions subtract a
        # merged head's delta again (`lora_slots`). Bytes that failed their sha256 may hold
        # anything, and a restore re-loads versions already granted: those hold all output.
        checks = [(f, c) for f, c in self._checks.items() if c.version is None or c.version in versions]
        checks.sort(key=lambda fc: fc[1].kind != "canary")  # so that `waited` is the canaries' alone
        t0, waited = time.perf_counter(), 0.0
        try:
            for check, what in checks:
                if not await _passes(check):
                    return False
                if what.kind == "canary":
                    waited = time.perf_counter() - t0
        finally:
            metrics.CANARY_WAIT_SECONDS.labels(self.run_id, self.replica).observe(waited)
        return not any(until >= since for _, until in self._tainted)

    def _make_receiver(self) -> None:
        if self.xccl is not None or self.cfg.actor.weight_update_mode != "xccl":
            return
        from services.rollout.xccl_receiver import XcclReceiver

        if self.engine_name == "embedded":
            device = getattr(getattr(self.engine, "model", None), "device", "cpu")
        else:  # a server's sidecar: an nccl group needs a GPU to stage on, gloo stages in host memory
            from services.common.models import resolve_device

            device = resolve_device(self.cfg.rollout.device)
        self.xccl = XcclReceiver(self.replica, device=device, timeout_s=self.cfg.actor.xccl_timeout_s)

    async def start(self) -> asyncio.Task:
        """Load the newest version, then follow the stream from its start; returns the
        consumer task."""
        self._make_receiver()
        consumer = streams.consumer(self.run_id, f"rollout-{self.replica}")
        self.epoch = await lineage.first_epoch(self.bus, consumer.stream)
        # not simply the newest message: a forged jump there would anchor the keep window
        head = await lineage.newest_trusted(self.bus, consumer.stream, self.epoch)
        if head is not None:
            try:
                await self.on_adapter(head)
            except Exception:  # reported already; the consumer below delivers it again
                log.exception("rollout %s: initial load of v%d failed", self.replica, head.version)
        reader: Puller[AdapterReady] = await self.bus.pull(consumer, AdapterReady, batch=1)
        return self.bus.dispatch(reader, lambda ev, meta: self.on_adapter(ev))

    def _spawn(self, work: Coroutine[Any, Any, object]) -> asyncio.Task:
        """Run `work` beside the follower (cancelled by `close`)."""
        task = asyncio.create_task(work)
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)
        return task

    async def close(self) -> None:
        metrics.close_run(self.run_id, self.replica)
        for task in list(self._settling):
            task.cancel()
        if self.xccl is not None:
            await asyncio.to_thread(self.xccl.close)
        if self.stager is not None:
            await asyncio.to_thread(self.stager.close)

    def _refusal(self, ev: AdapterReady) -> str | None:
        """Why `ev` is not a version of this run's trainer to follow, or None."""
        if ev.run != self.run_id:
            return f"run: {ev.run!r} is not this replica's run {self.run_id!r}"
        newest = self.newest_seen if self.newest_seen >= 0 else None
        problem = lineage.lineage_problem(self.epoch, newest, ev.trainer_epoch, ev.version)
        if problem is None and ev.version in self._events and self._events[ev.version] != ev:
            problem = f"version: v{ev.version} is loaded here from another event; a version is published once"
        return problem

    async def on_adapter(self, ev: AdapterReady) -> None:
        async with self._load_lock:
            if (problem := self._refusal(ev)) is not None:
                raise Refused(f"{ev.adapter_name}: {problem}")
            self.epoch = ev.trainer_epoch
            self.newest_seen = max(self.newest_seen, ev.version)
            self._follow_steps(ev)
            if ev.version in self.book.loaded():
                return
            if ev.version <= self.newest_seen - self.keep:
                log.info(
                    "rollout %s: skip v%d (outside the keep window of v%d)", self.replica, ev.version, self.newest_seen
                )
                return
            if ev.lora_name != self.cfg.rollout.lora_name and self.cfg.rollout.lora_name:
                raise ValueError(
                    f"adapter {ev.adapter_name}: lora_name {ev.lora_name!r} is not this run's "
                    f"rollout.lora_name {self.cfg.rollout.lora_name!r}"
                )
            self._events[ev.version] = ev
            self._loading = ev.version
            try:
                if not await self._load_with_retries(ev):
                    self._events.pop(ev.version, None)
            except BaseException:
                self._events.pop(ev.version, None)
                raise
            finally:
                self._loading = None
            await self.collect()

    def _follow_steps(self, ev: AdapterReady) -> None:
        """Note `ev`'s trainer step, and end the canary waits it orphans."""
        self._steps[ev.version] = ev.trainer_step
        for version in [v for v in self._steps if v < self.newest_seen - self.keep]:
            del self._steps[version]
        for version, orphaned in self._canary_waits.items():
            if not orphaned.done() and (reason := self.orphaned_by(version)) is not None:
                orphaned.set_result(reason)

    def orphaned_by(self, version: int) -> str | None:
        """Why `version`'s canary can never come (a later version's trainer step did not rise
        past its own: its trainer was replaced by one resumed from an older checkpoint), or None."""
        step = self._steps.get(version)
        if step is None:
            return None
        for later, later_step in self._steps.items():
            if later > version and later_step <= step:
                return (
                    f"v{later} was announced at trainer step {later_step}, not after v{version}'s step {step}: "
                    f"the trainer that announced v{version} is gone and its successor resumed from an "
                    f"older checkpoint, so no canary of v{version} can come"
                )
        return None

    async def _load_with_retries(self, ev: AdapterReady, verify_first: bool = False) -> bool:
        """Load `ev` by the first of the loaders that takes it (True), give it up when its
        object is missing or corrupt (False: reported, never retried), or raise after
        `load_attempts` failures of another kind. `verify_first` takes the hash-before-load path
        (a version withdrawn after a failed background check)."""
        payload = ev.xccl_payload()
        if self.xccl is not None and payload is not None:
            self.xccl.observe(payload, ev.version)
        for attempt in range(1, self.load_attempts + 1):
            t0 = time.time()
            try:
                await self._make_room()
                done = await loaders.load(self._loaders, ev, attempt=attempt, verify_first=verify_first)
            except Exception as exc:
                metrics.LOAD_FAILURES.labels(self.run_id, self.replica).inc()
                gone = isinstance(exc, ObjectNotFound | ObjectCorrupt)
                retry = attempt < self.load_attempts and not gone and not isinstance(exc, OutsideStore)
                log.warning(
                    "rollout %s: load of %s failed (attempt %d): %r", self.replica, ev.adapter_name, attempt, exc
                )
                await self._report_failed(ev.version, exc, attempt=attempt, will_retry=retry, tag=str(attempt))
                if isinstance(exc, OutsideStore):  # no retry can make it the run's object
                    raise Refused(f"{ev.adapter_name}: {exc}") from None
                if gone:
                    # the version is given up (reported above) and the newer ones behind it load
                    log.error("rollout %s: %s given up: %s", self.replica, ev.adapter_name, exc)
                    return False
                if not retry:
                    raise
                await asyncio.sleep(self.retry_base_s * 2 ** (attempt - 1))
                continue
            now = time.time()
            settle = await self._serve(ev, done)
            try:
                # the run and the wait since the announcement: a fleet's start-up is read from these
                log.info(
                    "rollout %s: loaded %s via %s in %.3fs (run %s, %.3fs after its announcement)",
                    self.replica, ev.adapter_name, done.via, now - t0, self.run_id, now - ev.created_at,
                )  # fmt: skip
                metrics.ADAPTER_LOAD_SECONDS.labels(self.run_id, self.replica).observe(now - t0)
                metrics.PROPAGATION_SECONDS.labels(self.run_id, self.replica).observe(max(0.0, now - ev.created_at))
                if (head := self.book.head()) is not None:  # it is: a version was just marked loaded
                    metrics.LOADED_VERSION.labels(self.run_id, self.replica).set(head)
                # no canary_seconds: the check ends after this report (CANARY_SECONDS and the log say it)
                await self._report_loaded(ev.version, done.via, load_seconds=now - t0, loaded_at=now, kind="loaded")
            finally:
                if settle is not None:  # after AdapterLoaded, so that a failure is reported after it
                    self._spawn(settle)
            return True
        return False  # not reached: the last attempt returns or raises

    async def _serve(self, ev: AdapterReady, done: loaders.Loaded) -> Coroutine[Any, Any, None] | None:
        """Mark a version just loaded as loaded, its checks in flight from that moment: the fast
        path's sha256 (`done.staged`) and the event's canary. Returns what settles them (to run
        beside the follower), None when there are none."""
        version = ev.version
        self._sha256[version] = done.sha256
        async with self.changed:
            # nothing awaited in here: a grant can pin the version only once its checks are in flight
            began = time.monotonic()
            self.book.mark_loaded(version)
            sha = check = None
            if done.staged is not None:
                sha = asyncio.wrap_future(done.staged.verified)
                # on the future itself: the digest is in before any `trusted` waiting for it returns
                sha.add_done_callback(lambda f: self._take_digest(version, f))
                self._checks[sha] = InFlight("sha256", None)
            if canary.expected(ev):
                self.book.pin(version)  # not collected while its canary comes and decodes
                check = self._spawn(self._canary(ev))
                self._checks[check] = InFlight("canary", version)
            self.changed.notify_all()
        if sha is None and check is None:
            return None
        return self._settle(ev, began, done.staged, sha, check)

    def _take_digest(self, version: int, sha: asyncio.Future[str]) -> None:
        if not sha.cancelled() and sha.exception() is None and version in self.book.loaded():
            self._sha256[version] = sha.result()

    async def _canary(self, ev: AdapterReady) -> float:
        """Obtain `ev`'s canary (the event's, or the one that follows it), decode it under its
        version (loaded) and compare; returns the seconds the decode and comparison took. Raises
        `CanaryFailed` with the figures beyond the tolerance, or when no canary bound to the event
        came in time, or the engine's error when it cannot answer `load_attempts` times in a row."""
        t_wait = time.perf_counter()
        orphaned = asyncio.get_running_loop().create_future()
        if (reason := self.orphaned_by(ev.version)) is not None:
            orphaned.set_result(reason)
        self._canary_waits[ev.version] = orphaned
        try:
            want = await canary.obtain(self.bus, ev, self.cfg.rollout.canary_wait_s, orphaned)
        finally:
            self._canary_waits.pop(ev.version, None)
        t0 = time.perf_counter()
        if ev.canary is None:
            log.debug("rollout %s: %s's canary came %.1f ms into its check", self.replica, ev.adapter_name,
                      (t0 - t_wait) * 1e3)  # fmt: skip
        measured = await self._score(ev, want)
        seconds = time.perf_counter() - t0
        metrics.CANARY_SECONDS.labels(self.run_id, self.replica).observe(seconds)
        metrics.CANARY_GAP.labels(self.run_id, self.replica).observe(min(measured.value, 1e6))
        if not measured.passed:
            raise canary.CanaryFailed(
                f"{ev.adapter_name}: {measured.describe(len(want.sequences))}; {canary.WITHDRAWN}"
            )
        return seconds

    async def _score(self, ev: AdapterReady, want: Canary) -> canary.Gap:
        for attempt in range(1, self.load_attempts):
            try:
                return await canary.score(self.engine, ev.version, want, self.cfg.rollout.dtype)
            except Exception as exc:
                log.warning("rollout %s: canary of %s not answered (attempt %d): %r", self.replica,
                            ev.adapter_name, attempt, exc)  # fmt: skip
                await asyncio.sleep(self.retry_base_s * 2 ** (attempt - 1))
        return await canary.score(self.engine, ev.version, want, self.cfg.rollout.dtype)

    async def _settle(
        self,
        ev: AdapterReady,
        began: float,
        staged: Staged | None,
        sha: asyncio.Future[str] | None,
        check: asyncio.Future[float] | None,
    ) -> None:
        """Wait for the checks of a version served since `began`. The first to fail withdraws it
        at once; once both ended it is loaded again verify-first after a failed sha256 (other
        bytes than the trainer's were checked), or given up after a failed canary."""
        checks = [c for c in (sha, check) if c is not None]
        await asyncio.wait(checks, return_when=asyncio.FIRST_EXCEPTION)
        served = self._withdraw_now(ev.version, began) if any(map(_failed, checks)) else None
        await asyncio.wait(checks)
        for c in checks:  # a failure's window is tainted already: `trusted` refuses by it from here
            self._checks.pop(c, None)
        if check is not None:
            async with self.changed:
                self.book.unpin(ev.version)
                self.changed.notify_all()
        if staged is not None and sha is not None and not _failed(sha):
            staged.times.observe(self.run_id, self.replica)
        if served is None:
            self._log_passed(ev, staged, check)
            return
        failed = sha if sha is not None and _failed(sha) else check
        assert failed is not None
        exc = _error(failed)
        metrics.LOAD_FAILURES.labels(self.run_id, self.replica).inc()
        log.error("rollout %s: %s withdrawn: %s", self.replica, ev.adapter_name, exc)
        if failed is sha:
            await self._report_failed(ev.version, exc, attempt=1, will_retry=True, tag="w",
                                      context="withdrawn after loading: ")  # fmt: skip
            await self._withdraw(ev, served)
            return
        unanswered = "" if isinstance(exc, canary.CanaryFailed) else "canary not answered: "
        await self._report_failed(ev.version, exc, attempt=1, will_retry=False, tag="c", context=unanswered)
        await self._give_up(ev.version, served)

    def _log_passed(self, ev: AdapterReady, staged: Staged | None, check: asyncio.Future[float] | None) -> None:
        parts = []
        if staged is not None:
            parts.append(f"servable in {staged.times.describe()}")
        if check is not None:
            parts.append(f"canary passed in {check.result() * 1e3:.1f} ms beside serving")
        log.info("rollout %s: %s %s", self.replica, ev.adapter_name, "; ".join(parts))

    def _withdraw_now(self, version: int, since: float) -> list[float]:
        """Leave `version` out of `loaded()` and refuse output generated from `since` on; returns
        that tainted window, closed once the version has left the engine."""
        served = [since, math.inf]
        self._tainted.append(served)
        self._withdrawn.add(version)
        return served

    async def _withdraw(self, ev: AdapterReady, served: list[float]) -> None:
        """Unload a version whose bytes failed their check once nothing uses it, then load it
        again by the verify-first path (while it is still inside the keep window)."""
        async with self.changed:
            while self.book.pins(ev.version):
                await self.changed.wait()
        async with self._load_lock:
            async with self._collecting:
                if ev.version in self.book.loaded():
                    await self.engine.unload_version(ev.version)
                    self.book.mark_unloaded(ev.version)
                    self._sha256.pop(ev.version, None)
            served[1] = time.monotonic()
            self._withdrawn.discard(ev.version)
            if ev.version <= self.newest_seen - self.keep:
                self._events.pop(ev.version, None)
                return
            try:
                await self._load_with_retries(ev, verify_first=True)
            except Exception:  # reported by _load_with_retries; the stream has moved on
                self._events.pop(ev.version, None)
                log.exception("rollout %s: %s could not be loaded again", self.replica, ev.adapter_name)

    async def _give_up(self, version: int, served: list[float]) -> None:
        """Unload a withdrawn version whose canary failed once nothing pins it, for good: the
        same weights would fail again. The replica keeps serving the versions that passed."""
        async with self.changed:
            await self.changed.wait_for(lambda: not self.book.pins(version))
        async with self._collecting:
            unloaded = version in self.book.loaded()
            if unloaded:
                try:
                    await self.engine.unload_version(version)
                except Exception:  # it stays withdrawn: never granted, its output never published
                    log.exception("rollout %s: v%d, withdrawn, could not be unloaded", self.replica, version)
                    return
                self.book.mark_unloaded(version)
            served[1] = time.monotonic()
            self._withdrawn.discard(version)
            self._events.pop(version, None)
            self._sha256.pop(version, None)
        async with self.changed:
            self.changed.notify_all()
        if (head := self.book.head()) is not None:
            metrics.LOADED_VERSION.labels(self.run_id, self.replica).set(head)
        if unloaded:
            await self._report("unloaded", AdapterUnloaded(run=self.run_id, replica=self.replica, version=version,
                                                           reason="withdrawn: its canary failed on this replica",
                                                           unloaded_at=time.time()),
                               msg_id=f"{self.replica}-unloaded-v{version}-{uuid.uuid4().hex[:8]}")  # fmt: skip

    async def head_moved(self, seen: int | None) -> None:
        """Return once the newest loaded version is other than `seen` (at once if it is)."""
        async with self.changed:
            await self.changed.wait_for(lambda: self.book.head() != seen)

    async def _make_room(self) -> None:
        """Wait until a slot is free: old versions go as soon as their requests finish."""
        while len(self.book.loaded()) >= self.keep + 1:
            await self.collect()
            if len(self.book.loaded()) < self.keep + 1:
                return
            async with self.changed:
                await self.changed.wait()

    async def collect(self) -> None:
        """Unload every version outside the keep window that nobody pins."""
        async with self._collecting:
            await self._collect()

    async def _collect(self) -> None:
        for version in self.book.to_unload():
            await self.engine.unload_version(version)
            self.book.mark_unloaded(version)
            self._events.pop(version, None)
            self._sha256.pop(version, None)
            await self._report(
                "unloaded",
                AdapterUnloaded(
                    run=self.run_id,
                    replica=self.replica,
                    version=version,
                    reason=f"outside the keep window of {self.keep}",
                    unloaded_at=time.time(),
                ),
                msg_id=f"{self.replica}-unloaded-v{version}-{uuid.uuid4().hex[:8]}",
            )

    async def _report(self, kind: str, msg: msgspec.Struct, msg_id: str) -> None:
        await self.bus.publish(subjects.rollout_report(self.run_id, self.replica, kind), msg, msg_id=msg_id)

    async def _report_loaded(
        self,
        version: int,
        via: LoadedVia,
        *,
        load_seconds: float,
        loaded_at: float,
        kind: str,
        canary_seconds: float | None = None,
    ) -> None:
        """Report `version` servable; `kind` (`loaded`, or `reloaded` by a restore) names it in
        the msg_id."""
        await self._report(
            "loaded",
            AdapterLoaded(
                run=self.run_id,
                replica=self.replica,
                version=version,
                via=via,
                load_seconds=load_seconds,
                loaded_at=loaded_at,
                canary_seconds=canary_seconds,
            ),
            msg_id=f"{self.replica}-{kind}-v{version}-{uuid.uuid4().hex[:8]}",
        )

    async def _report_failed(
        self, version: int, exc: Exception, *, attempt: int, will_retry: bool, tag: str, context: str = ""
    ) -> None:
        """Report one failure to load `version`; `tag` names it in the msg_id: the attempt number
        of a load, `w` a withdrawal after a failed check, `r<n>` a restore's nth attempt."""
        await self._report(
            "failed",
            AdapterFailed(
                run=self.run_id,
                replica=self.replica,
                version=version,
                reason=f"{context}{type(exc).__name__}: {exc}"[:1000],
                attempt=attempt,
                will_retry=will_retry,
                failed_at=time.time(),
            ),
            msg_id=f"{self.replica}-failed-v{version}-{tag}-{uuid.uuid4().hex[:8]}",
        )

    # --- servers that forget ---
    async def restore(self) -> list[int]:
        """Load again the still-admissible versions the engine no longer serves (a restarted
        server, a lost replica) and check each against its canary before returning the ones
        that passed. Server engines only (`reload_missing`); a failed load is reported with
        will_retry and tried again at the next call, a failed canary gives the version up."""
        reload_missing = getattr(self.engine, "reload_missing", None)
        if reload_missing is None:
            return []
        # _collecting: no unload of a version while we decide whether to bring it back
        async with self._restoring, self._collecting:
            admissible = set(self.loaded())
            if self._loading is not None:
                admissible.add(self._loading)
            hold = self._hold(admissible)
            since = time.monotonic()
            try:
                return await self._recheck(await self._reload(reload_missing, admissible), since)
            finally:
                if hold is not None:
                    hold.set_result(None)
                    self._checks.pop(hold, None)

    def _hold(self, admissible: set[int]) -> asyncio.Future[None] | None:
        """A canary check in flight for the whole of a restore, when its versions carry
        canaries: a server may answer a re-loaded name with other weights until the canary says
        otherwise, and the grants already pinning it may be generating on it meanwhile."""
        if not any((ev := self._events.get(v)) is not None and canary.expected(ev) for v in admissible):
            return None
        hold: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._checks[hold] = InFlight("canary", None)
        return hold

    async def _reload(self, reload_missing: Callable[[list[int]], Any], admissible: set[int]) -> list[int]:
        """The admissible versions the engine had forgotten, loaded again: by the engine from
        its own copies, or from their events."""
        restored: list[int] = []
        try:
            restored = list(await reload_missing(sorted(admissible)))
        except Exception as exc:
            log.warning("rollout %s: checking the server's adapters failed: %r", self.replica, exc)
        # versions the engine dropped without getting back (a reload that failed above, or
        # a generation that found one gone): re-loaded from their events
        serving = set(await self.engine.loaded_versions())
        for version in self.book.loaded():
            ev = self._events.get(version)
            if version in serving or version in restored or version == self._loading or ev is None:
                continue
            if version in self._withdrawn:  # on its way out (a failed check): not brought back
                continue
            try:
                data = await asyncio.to_thread(self.fetch, ev)
                self._sha256[version] = (await self._fetch_loader.load_bytes(ev, data)).sha256
            except Exception as exc:
                attempt = self._restore_failures[version] = self._restore_failures.get(version, 0) + 1
                await self._report_failed(
                    version,
                    exc,
                    attempt=attempt,
                    will_retry=True,
                    tag=f"r{attempt}",
                    context="re-load after the server forgot it: ",
                )
                continue
            restored.append(version)
        return restored

    async def _recheck(self, restored: list[int], since: float) -> list[int]:
        """Check each re-loaded version against its canary and report the ones that pass loaded
        again; one that fails is withdrawn (output from `since` on refused) and given up."""
        checked = []
        for version in restored:
            self._restore_failures.pop(version, None)
            ev = self._events.get(version)
            try:
                canary_s = await self._canary(ev) if ev is not None and canary.expected(ev) else None
            except Exception as exc:
                served = self._withdraw_now(version, since)
                log.error("rollout %s: v%d re-loaded, then withdrawn: %s", self.replica, version, exc)
                metrics.LOAD_FAILURES.labels(self.run_id, self.replica).inc()
                await self._report_failed(version, exc, attempt=1, will_retry=False, tag="rc",
                                          context="re-loaded after the server forgot it: ")  # fmt: skip
                self._spawn(self._give_up(version, served))  # once this restore lets _collecting go
                continue
            checked.append(version)
            log.info("rollout %s: v%d re-loaded (the server had forgotten it)", self.replica, version)
            await self._report_loaded(version, "object", load_seconds=0.0, loaded_at=time.time(), kind="reloaded",
                                      canary_seconds=canary_s)  # fmt: skip
        return checked

    async def watch_engine_loop(self, stop: asyncio.Event) -> None:
        if getattr(self.engine, "reload_missing", None) is None:
            return
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), self.cfg.rollout.heartbeat_s)
            except TimeoutError:
                pass
            if not stop.is_set():
                await self.restore()


def _failed(check: asyncio.Future[Any]) -> bool:
    """A check that ended without passing (cancelled: it will never pass)."""
    return check.done() and (check.cancelled() or check.exception() is not None)


def _error(check: asyncio.Future[Any]) -> Exception:
    """Why a `_failed` check failed."""
    exc = None if check.cancelled() else check.exception()
    return exc if isinstance(exc, Exception) else RuntimeError(f"the check was stopped: {exc!r}")


async def _passes(check: asyncio.Future[Any]) -> bool:
    """Wait for a check in flight; whether it passed."""
    try:
        await asyncio.shield(check)
    except asyncio.CancelledError:
        if not check.cancelled():
            raise  # the caller was cancelled, not the check
        return False
    except Exception:
        return False
    return True
