"""The rollout replica: follows adapter versions, asks for admission, generates, publishes.

Three concurrent loops over one engine:
- adapters: a durable consumer of the ADAPTERS stream (one per replica). On start the newest
  AdapterReady in the stream is loaded first, so a late or restarted replica serves the head
  at once; older events replayed after it are skipped when outside the keep window.
  Every load is fetched from the store, sha256-verified and loaded as `{lora_name}-v{N}`, with
  retries and backoff; each failure is reported (AdapterFailed), the last one re-raised so the
  bus redelivers or dead-letters the event: a version is never silently skipped.
- work: admission request -> grant (pin its version) or deny (wait retry_after_s); up to
  `rollout.batch_groups` grants per engine batch; completions scored by the reward function
  and published as one Trajectory per grant.
- heartbeat: ReplicaHeartbeat every `rollout.heartbeat_s`.
- engine watch (server engines): at the same period, versions a server forgot (it restarted)
  are loaded again while still admissible and reported as loaded; a generation that finds its
  version gone does the same and runs its grants again on that version, so a trajectory always
  carries the version that generated it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import nats.errors

from proto import subjects
from proto.messages import (
    AdapterFailed,
    AdapterLoaded,
    AdapterReady,
    AdapterUnloaded,
    AdmissionDeny,
    AdmissionGrant,
    AdmissionReply,
    AdmissionRequest,
    Completion,
    ReplicaHeartbeat,
    Trajectory,
)
from services.common import streams, xccl
from services.common.config_schema import LorabusConfig
from services.common.data import Prompt, epoch_order
from services.rollout import metrics
from services.rollout.engines.base import Engine, GenRequest
from services.rollout.engines.http import VersionNotLoaded
from services.rollout.sampling import mix32
from services.rollout.versions import VersionBook

log = logging.getLogger(__name__)


def keep_versions(cfg: LorabusConfig) -> int:
    return cfg.rollout.lora_keep_versions or cfg.rollout.max_head_offpolicyness + 1


def prompt_cycle(prompts: list[Prompt], seed: int, shuffle: bool) -> Iterator[Prompt]:
    """Prompts forever, a fresh seeded order per epoch."""
    if not prompts:
        raise ValueError("train_dataset: no prompts to generate from")
    epoch = 0
    while True:
        yield from epoch_order(prompts, epoch, seed, shuffle)
        epoch += 1


class RolloutService:
    def __init__(
        self,
        cfg: LorabusConfig,
        replica: str,
        engine: Engine,
        bus: Any,
        *,
        fetch: Callable[[AdapterReady], bytes],
        encode: Callable[[str], list[int]],
        decode_text: Callable[[list[int]], str],
        reward_fn: Callable[[str, str, str], float],
        prompts: list[Prompt],
        engine_name: str = "embedded",
        load_attempts: int = 4,
        retry_base_s: float = 0.5,
        admission_timeout_s: float = 2.0,
        xccl=None,
    ):
        self.cfg, self.run_id, self.replica = cfg, cfg.run, subjects.token(replica, "replica")
        self.engine, self.bus, self.fetch = engine, bus, fetch
        self.encode, self.decode_text, self.reward_fn = encode, decode_text, reward_fn
        self.engine_name = engine_name
        self.keep = keep_versions(cfg)
        self.book = VersionBook(self.keep)
        self.load_attempts, self.retry_base_s = load_attempts, retry_base_s
        self.admission_timeout_s = admission_timeout_s
        self.newest_seen = -1
        self._events: dict[int, AdapterReady] = {}
        """the event of every loaded version: what re-loading a version the engine lost reads"""
        self._loading: int | None = None
        self._restore_failures: dict[int, int] = {}
        self._restoring = asyncio.Lock()
        seed = cfg.seed * 1_000_003 + zlib.crc32(self.replica.encode())
        self._seed = seed
        self._prompts = prompt_cycle(prompts, seed, cfg.train_dataset.shuffle)
        self._changed = asyncio.Condition()
        # collect() runs from the load path and after every generation: one at a time, or two
        # callers would both try to unload the same version
        self._collecting = asyncio.Lock()
        self._load_lock = asyncio.Lock()
        self._batches = 0
        self.xccl = xccl
        """the XcclReceiver (created in `start_adapters` under weight_update_mode: xccl)"""

    # --- adapters ---
    def _make_receiver(self) -> None:
        if self.xccl is not None or self.cfg.actor.weight_update_mode != "xccl":
            return
        if self.engine_name != "embedded":
            log.info("rollout %s: engine %s takes adapters from the object copy only",
                     self.replica, self.engine_name)
            return
        from services.rollout.xccl_receiver import XcclReceiver

        device = getattr(getattr(self.engine, "model", None), "device", "cpu")
        self.xccl = XcclReceiver(self.replica, device=device, timeout_s=self.cfg.actor.xccl_timeout_s)

    async def start_adapters(self) -> asyncio.Task:
        self._make_receiver()
        stream = streams.ADAPTERS(self.run_id)
        head = await self._newest_event(stream)
        if head is not None:
            try:
                await self.on_adapter(head)
            except Exception:  # reported already; the consumer below delivers it again
                log.exception("rollout %s: initial load of v%d failed", self.replica, head.version)
        return await self.bus.consume(
            stream, f"rollout-{self.replica}", AdapterReady, lambda ev, meta: self.on_adapter(ev),
            deliver="all", batch=1, ack_wait_s=120.0,
        )

    async def _newest_event(self, stream: str) -> AdapterReady | None:
        from proto import codec

        info = await self.bus.js.stream_info(stream)
        if not info.state.last_seq or not info.state.messages:
            return None
        raw = await self.bus.js.get_msg(stream, seq=info.state.last_seq)
        try:
            return codec.decode(raw.data, AdapterReady)
        except codec.DecodeError:
            return None  # the consumer dead-letters it when it gets there

    async def on_adapter(self, ev: AdapterReady) -> None:
        async with self._load_lock:
            self.newest_seen = max(self.newest_seen, ev.version)
            if ev.version in self.book.loaded():
                return
            if ev.version <= self.newest_seen - self.keep:
                log.info("rollout %s: skip v%d (outside the keep window of v%d)",
                         self.replica, ev.version, self.newest_seen)
                return
            if ev.lora_name != self.cfg.rollout.lora_name and self.cfg.rollout.lora_name:
                raise ValueError(
                    f"adapter {ev.adapter_name}: lora_name {ev.lora_name!r} is not this run's "
                    f"rollout.lora_name {self.cfg.rollout.lora_name!r}"
                )
            self._events[ev.version] = ev
            self._loading = ev.version
            try:
                await self._load_with_retries(ev)
            except BaseException:
                self._events.pop(ev.version, None)
                raise
            finally:
                self._loading = None
            await self.collect()

    async def _load_xccl(self, ev: AdapterReady) -> bool:
        """Swap in the version staged by the XCCL receiver; False: take the object copy."""
        payload = ev.xccl_payload()
        if payload is None or self.xccl is None:
            return False
        tensors = await asyncio.to_thread(self.xccl.take, ev.version, payload)
        if tensors is None:
            return False
        try:
            await self.engine.load_version(ev.version, tensors, ev.lora)
        except Exception as exc:
            log.warning("rollout %s: staged %s does not load (%r); object copy instead",
                        self.replica, ev.adapter_name, exc)
            return False
        finally:
            self.xccl.release(ev.version)
        return True

    async def _load_with_retries(self, ev: AdapterReady) -> None:
        if self.xccl is not None and ev.xccl_payload() is not None:
            self.xccl.observe(ev.xccl_payload(), ev.version)
        for attempt in range(1, self.load_attempts + 1):
            t0 = time.time()
            via = "object"
            try:
                await self._make_room()
                if attempt == 1 and await self._load_xccl(ev):
                    via = "xccl"
                else:
                    if ev.object_payload() is None:
                        raise ValueError(f"{ev.adapter_name}: no object payload and this replica "
                                         "did not receive it by xccl")
                    # under xccl the event may precede its object by an upload time
                    data = await asyncio.to_thread(
                        xccl.fetch_when_stored, lambda: self.fetch(ev), what=ev.adapter_name)
                    await self.engine.load_version(ev.version, data, ev.lora)
            except Exception as exc:
                metrics.LOAD_FAILURES.labels(self.replica).inc()
                retry = attempt < self.load_attempts
                log.warning("rollout %s: load of %s failed (attempt %d): %r",
                            self.replica, ev.adapter_name, attempt, exc)
                await self._report("failed", AdapterFailed(
                    run=self.run_id, replica=self.replica, version=ev.version,
                    reason=f"{type(exc).__name__}: {exc}"[:1000], attempt=attempt,
                    will_retry=retry, failed_at=time.time(),
                ), msg_id=f"{self.replica}-failed-v{ev.version}-{attempt}-{uuid.uuid4().hex[:8]}")
                if not retry:
                    raise
                await asyncio.sleep(self.retry_base_s * 2 ** (attempt - 1))
                continue
            now = time.time()
            async with self._changed:
                self.book.mark_loaded(ev.version)
                self._changed.notify_all()
            log.info("rollout %s: loaded %s via %s in %.3fs", self.replica, ev.adapter_name, via, now - t0)
            metrics.ADAPTER_LOAD_SECONDS.labels(self.replica).observe(now - t0)
            metrics.PROPAGATION_SECONDS.labels(self.replica).observe(max(0.0, now - ev.created_at))
            metrics.LOADED_VERSION.labels(self.replica).set(self.book.head())
            await self._report("loaded", AdapterLoaded(
                run=self.run_id, replica=self.replica, version=ev.version, via=via,
                load_seconds=now - t0, loaded_at=now,
            ), msg_id=f"{self.replica}-loaded-v{ev.version}-{uuid.uuid4().hex[:8]}")
            return

    async def _make_room(self) -> None:
        """Wait until a slot is free: old versions go as soon as their requests finish."""
        while len(self.book.loaded()) >= self.keep + 1:
            await self.collect()
            if len(self.book.loaded()) < self.keep + 1:
                return
            async with self._changed:
                await self._changed.wait()

    async def collect(self) -> None:
        """Unload every version outside the keep window that nobody pins."""
        async with self._collecting:
            await self._collect()

    async def _collect(self) -> None:
        for version in self.book.to_unload():
            await self.engine.unload_version(version)
            self.book.mark_unloaded(version)
            self._events.pop(version, None)
            await self._report("unloaded", AdapterUnloaded(
                run=self.run_id, replica=self.replica, version=version,
                reason=f"outside the keep window of {self.keep}", unloaded_at=time.time(),
            ), msg_id=f"{self.replica}-unloaded-v{version}-{uuid.uuid4().hex[:8]}")

    async def _report(self, kind: str, msg, msg_id: str) -> None:
        await self.bus.publish(subjects.rollout_report(self.run_id, self.replica, kind), msg, msg_id=msg_id)

    # --- servers that forget ---
    async def restore(self) -> list[int]:
        """Load again the still-admissible versions the engine no longer serves (a restarted
        server, a lost replica); returns them. Server engines only (`reload_missing`); a
        failure is reported with will_retry and tried again at the next call."""
        reload_missing = getattr(self.engine, "reload_missing", None)
        if reload_missing is None:
            return []
        # _collecting: no unload of a version while we decide whether to bring it back
        async with self._restoring, self._collecting:
            admissible = set(self.book.loaded()) | ({self._loading} - {None})
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
                try:
                    data = await asyncio.to_thread(self.fetch, ev)
                    await self.engine.load_version(version, data, ev.lora)
                except Exception as exc:
                    attempt = self._restore_failures[version] = self._restore_failures.get(version, 0) + 1
                    await self._report("failed", AdapterFailed(
                        run=self.run_id, replica=self.replica, version=version,
                        reason=f"re-load after the server forgot it: {type(exc).__name__}: {exc}"[:1000],
                        attempt=attempt, will_retry=True, failed_at=time.time(),
                    ), msg_id=f"{self.replica}-failed-v{version}-r{attempt}-{uuid.uuid4().hex[:8]}")
                    continue
                restored.append(version)
            for version in restored:
                self._restore_failures.pop(version, None)
                log.info("rollout %s: v%d re-loaded (the server had forgotten it)", self.replica, version)
                await self._report("loaded", AdapterLoaded(
                    run=self.run_id, replica=self.replica, version=version, via="object",
                    load_seconds=0.0, loaded_at=time.time(),
                ), msg_id=f"{self.replica}-reloaded-v{version}-{uuid.uuid4().hex[:8]}")
            return restored

    async def watch_engine_loop(self, stop: asyncio.Event) -> None:
        if getattr(self.engine, "reload_missing", None) is None:
            return
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), self.cfg.rollout.heartbeat_s)
            except asyncio.TimeoutError:
                pass
            if not stop.is_set():
                await self.restore()

    # --- heartbeat ---
    async def heartbeat_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.bus.publish_core(
                    subjects.rollout_report(self.run_id, self.replica, "heartbeat"),
                    ReplicaHeartbeat(
                        run=self.run_id, replica=self.replica, engine=self.engine_name,
                        loaded_versions=self.book.loaded(), in_flight=self.book.in_flight(),
                        sent_at=time.time(),
                    ),
                )
            except Exception as exc:
                log.warning("rollout %s: heartbeat not sent: %r", self.replica, exc)
            try:
                await asyncio.wait_for(stop.wait(), self.cfg.rollout.heartbeat_s)
            except asyncio.TimeoutError:
                pass

    # --- work ---
    async def admit(self) -> AdmissionGrant | AdmissionDeny | None:
        req = AdmissionRequest(
            run=self.run_id, replica=self.replica, request_id=uuid.uuid4().hex,
            loaded_versions=self.book.loaded(),
        )
        try:
            return await self.bus.request(
                subjects.admission(self.run_id), req, AdmissionReply, timeout=self.admission_timeout_s
            )
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError, asyncio.TimeoutError):
            return None

    async def work_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            if self.book.head() is None:
                async with self._changed:
                    try:
                        await asyncio.wait_for(self._changed.wait(), 0.5)
                    except asyncio.TimeoutError:
                        pass
                continue
            grants: list[AdmissionGrant] = []
            wait_s = 0.0
            for _ in range(self.cfg.rollout.batch_groups):
                reply = await self.admit()
                if reply is None:
                    wait_s = 0.5  # no registry answering yet
                    break
                if isinstance(reply, AdmissionDeny):
                    wait_s = reply.retry_after_s
                    break
                if reply.version not in self.book.loaded():
                    log.warning("rollout %s: grant %s names v%d, not loaded here (%s); dropped",
                                self.replica, reply.grant_id, reply.version, self.book.loaded())
                    wait_s = 0.2
                    break
                self.book.pin(reply.version)
                grants.append(reply)
            if grants:
                try:
                    await self.generate(grants)
                except Exception:
                    # the grants' leases expire at the registry; keep serving
                    log.exception("rollout %s: batch of %d grants failed", self.replica, len(grants))
                    wait_s = 1.0
                finally:
                    async with self._changed:
                        for g in grants:
                            self.book.unpin(g.version)
                        self._changed.notify_all()
                    await self.collect()
            if wait_s:
                try:
                    await asyncio.wait_for(stop.wait(), wait_s)
                except asyncio.TimeoutError:
                    pass

    async def generate(self, grants: list[AdmissionGrant]) -> list[Trajectory]:
        g = self.cfg.gconfig
        started = time.time()
        metrics.IN_FLIGHT.labels(self.replica).set(len(grants))
        work = []
        for grant in grants:
            prompt = next(self._prompts)
            self._batches += 1
            req = GenRequest(
                prompt_token_ids=self.encode(prompt.text), n=g.n_samples,
                max_new_tokens=g.max_new_tokens, temperature=0.0 if g.greedy else g.temperature,
                top_p=g.top_p, top_k=g.top_k, stop_token_ids=list(g.stop_token_ids),
                seed=mix32(self._seed + mix32(self._batches)),
            )
            work.append((grant, prompt, req))
        by_version: dict[int, list[int]] = {}
        for i, (grant, _, _) in enumerate(work):
            by_version.setdefault(grant.version, []).append(i)
        outs: list[Any] = [None] * len(work)

        async def run(version: int, idx: list[int]) -> None:
            reqs = [work[i][2] for i in idx]
            try:
                res = await self.engine.generate(reqs, version)
            except VersionNotLoaded as exc:
                # the server forgot it: bring it back and run the same grants on the same version
                log.warning("rollout %s: %s; re-loading and generating again", self.replica, exc)
                await self.restore()
                res = await self.engine.generate(reqs, version)
            for i, r in zip(idx, res):
                outs[i] = r

        groups = list(by_version.items())
        errors = await asyncio.gather(*(run(v, idx) for v, idx in groups), return_exceptions=True)
        failed = [(v, e) for (v, _), e in zip(groups, errors) if isinstance(e, BaseException)]
        if len(failed) == len(groups):
            raise failed[0][1]
        for version, exc in failed:
            # their leases expire at the registry; the work loop asks for new grants
            log.warning("rollout %s: grants on v%d dropped: %r", self.replica, version, exc)
        work, outs = [w for w, o in zip(work, outs) if o is not None], [o for o in outs if o is not None]
        finished = time.time()
        metrics.IN_FLIGHT.labels(self.replica).set(0)
        trajectories, tokens = [], 0
        for (grant, prompt, req), results in zip(work, outs):
            completions = []
            for r in results:
                reward = float(self.reward_fn(prompt.text, self.decode_text(r.token_ids), prompt.answer))
                metrics.REWARD.labels(self.replica).observe(reward)
                tokens += len(r.token_ids)
                completions.append(Completion(
                    token_ids=r.token_ids, logprobs=r.logprobs,
                    versions=[grant.version] * len(r.token_ids), reward=reward,
                    finish_reason=r.finish_reason,
                ))
            traj = Trajectory(
                run=self.run_id, trajectory_id=f"{self.replica}-{uuid.uuid4().hex}",
                grant_id=grant.grant_id, replica=self.replica, prompt_id=prompt.prompt_id,
                prompt_token_ids=req.prompt_token_ids, completions=completions,
                started_at=started, finished_at=finished,
            )
            await self.bus.publish(
                subjects.trajectory(self.run_id, self.replica), traj, msg_id=traj.trajectory_id
            )
            metrics.TRAJECTORIES.labels(self.replica).inc()
            trajectories.append(traj)
        metrics.TOKENS.labels(self.replica).inc(tokens)
        metrics.TOKENS_PER_SECOND.labels(self.replica).set(tokens / max(finished - started, 1e-9))
        return trajectories

    # --- all together ---
    async def run(self, stop: asyncio.Event) -> None:
        consumer = await self.start_adapters()
        tasks = [
            asyncio.create_task(self.heartbeat_loop(stop), name="heartbeat"),
            asyncio.create_task(self.work_loop(stop), name="work"),
            asyncio.create_task(self.watch_engine_loop(stop), name="watch-engine"),
        ]
        try:
            await stop.wait()
        finally:
            consumer.cancel()
            done, pending = await asyncio.wait(tasks, timeout=self.cfg.rollout.request_timeout_s)
            for t in pending:
                t.cancel()
            await asyncio.gather(consumer, *tasks, return_exceptions=True)
            if self.xccl is not None:
                await asyncio.to_thread(self.xccl.close)
