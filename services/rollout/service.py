"""One run on a rollout replica: its grants generated, scored and published; its adapters
followed beside them (a `RunWorker` of the replica's `RunHost`, `services.rollout.fleet`).

The replica's one work loop (`work.work_loop`) asks for admission and hands the run its grants:
`take` pins a grant's version in the follower's book, `serve` generates up to
`rollout.batch_groups` grants per engine batch, scores the completions with the run's reward
function and publishes one Trajectory per grant, each completion's tokens naming the policy
that generated them (version, the sha256 its loader hashed, the engine: `TokenRange`). A
generation that finds its version gone from a server asks the follower to `restore()` it and
runs its grants again on that version, so a trajectory always carries the version that
generated it. Beside it, while the run is served:
- the adapter follower (`adapters.AdapterFollower`: the durable consumer of adapter versions);
- heartbeat: ReplicaHeartbeat every `rollout.heartbeat_s`;
- engine watch (server engines): the follower's `watch_engine_loop`.

A reward function that raises is the run's fault (`run_faults.RunFault`): the batch is dropped
(its leases expire), and after `run_faults.STRIKES` such batches in a row a run that shares the
replica (`on_fault` set) stops asking for work and is reported to the registry, which stops it
with the reason; the replica's other runs go on. A run alone keeps trying, as before.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
import zlib
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any

from proto import codec, subjects
from proto.messages import (
    AdapterReady,
    AdmissionGrant,
    AdmissionReply,
    AdmissionRequest,
    Completion,
    EngineKind,
    ReplicaHeartbeat,
    TokenRange,
    Trajectory,
)
from services.common.bus import PUBLISH_TIMEOUT_S, Bus
from services.common.data import Prompt, epoch_order
from services.common.nats_client import BusError
from services.common.run_faults import RunFault, Strikes
from services.config.schema import LorabusConfig
from services.rollout import metrics
from services.rollout.adapters import AdapterFollower
from services.rollout.engines.base import Engine, GenRequest
from services.rollout.engines.http import VersionNotLoaded
from services.rollout.sampling import mix32
from services.rollout.work import RequestIds, Run, request_admission, work_loop

if TYPE_CHECKING:
    from services.rollout.load_path import Stager
    from services.rollout.xccl_receiver import XcclReceiver

log = logging.getLogger(__name__)

STARTED_AT = time.time()
"""when this process started: every heartbeat and admission request carries it, so that the
registry frees a restarted replica's old grants at once instead of after their leases"""
INCARNATION = uuid.uuid4().hex
"""this process, drawn once: every heartbeat carries it, so that the registry tells a restart
by identity, not by comparing clocks (`policy._new_incarnation`)"""


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
        bus: Bus,
        *,
        fetch: Callable[[AdapterReady], bytes],
        encode: Callable[[str], list[int]],
        decode_text: Callable[[list[int]], str],
        reward_fn: Callable[[str, str, str], float],
        prompts: list[Prompt],
        engine_name: EngineKind = "embedded",
        load_attempts: int = 4,
        retry_base_s: float = 0.5,
        admission_timeout_s: float = 2.0,
        xccl: XcclReceiver | None = None,
        stager: Stager | None = None,
        release_versions: bool = False,
    ):
        self.cfg, self.run_id, self.replica = cfg, cfg.run, subjects.token(replica, "replica")
        self.engine, self.bus = engine, bus
        self.encode, self.decode_text, self.reward_fn = encode, decode_text, reward_fn
        self.engine_name = engine_name
        self.adapters = AdapterFollower(
            cfg, self.replica, engine, bus, keep=cfg.rollout.keep_versions, fetch=fetch, engine_name=engine_name,
            load_attempts=load_attempts, retry_base_s=retry_base_s, xccl=xccl, stager=stager,
        )  # fmt: skip
        self.book = self.adapters.book
        """pinned by the work loop for the versions its grants name"""
        self.admission_timeout_s = admission_timeout_s
        seed = cfg.seed * 1_000_003 + zlib.crc32(self.replica.encode())
        self._seed = seed
        self._prompts = prompt_cycle(prompts, seed, cfg.train_dataset.shuffle)
        self._batches = 0
        self.release_versions = release_versions
        """unload the run's versions when it closes (a run that shares the replica's engine)"""
        self.draining = False
        """no more grants: the run is leaving this replica"""
        self.on_fault: Callable[[RunFault], Awaitable[object]] | None = None
        """how the run's own fault is reported (`FleetReplica`: to the registry); None: keep trying"""
        self._strikes = Strikes()
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    # --- heartbeat ---
    async def heartbeat_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.bus.publish_core(
                    subjects.rollout_report(self.run_id, self.replica, "heartbeat"),
                    ReplicaHeartbeat(
                        run=self.run_id,
                        replica=self.replica,
                        engine=self.engine_name,
                        loaded_versions=self.adapters.loaded(),
                        in_flight=self.book.in_flight(),
                        sent_at=time.time(),
                        started_at=STARTED_AT,
                        incarnation=INCARNATION,
                    ),
                )
            except Exception as exc:
                log.warning("rollout %s: heartbeat not sent: %r", self.replica, exc)
            try:
                await asyncio.wait_for(stop.wait(), self.cfg.rollout.heartbeat_s)
            except TimeoutError:
                pass

    # --- work ---
    async def admit(self, runs: object, ids: RequestIds) -> AdmissionReply | None:
        """Ask the run's own admission subject (a replica that serves this run alone)."""
        req = AdmissionRequest(
            run=self.run_id,
            replica=self.replica,
            request_id=ids.next(),
            loaded_versions=self.adapters.loaded(),
            started_at=STARTED_AT,
        )
        return await request_admission(self.bus, subjects.admission(self.run_id), req, ids, self.admission_timeout_s)

    def loaded(self) -> list[int]:
        """The run's versions that may be granted (`AdapterFollower.loaded`)."""
        return self.adapters.loaded()

    async def head_moved(self, seen: int | None) -> None:
        """Return once the run's newest loaded version is other than `seen` (the work loop's
        wake after a deny)."""
        await self.adapters.head_moved(seen)

    def take(self, reply: AdmissionGrant, grants: list[AdmissionGrant]) -> float:
        """Add a grant to `grants`, its version pinned; returns the wait before asking again
        (0: ask on; a version not loaded here ends the batch)."""
        if reply.version not in self.adapters.loaded():
            log.warning(
                "rollout %s: grant %s names %s v%d, not loaded here (%s); dropped",
                self.replica,
                reply.grant_id,
                self.run_id,
                reply.version,
                self.adapters.loaded(),
            )
            return 0.2
        self.book.pin(reply.version)
        grants.append(reply)
        return 0.0

    async def serve(self, grants: list[AdmissionGrant]) -> float:
        """Generate and publish the grants `take` pinned, then unpin them; returns the wait
        before asking again."""
        changed, wait_s = self.adapters.changed, 0.0
        try:
            await self.generate(grants)
            self._strikes.clear()
        except RunFault as fault:
            log.error("rollout %s: %d grants dropped: %s", self.replica, len(grants), fault)
            wait_s = 1.0
            if self._strikes.hit() and self.on_fault is not None:
                self.draining = True  # the work loop asks for it no more; the registry stops it everywhere
                await self.on_fault(fault)
        except Exception:
            # the grants' leases expire at the registry; keep serving
            log.exception("rollout %s: batch of %d grants failed", self.replica, len(grants))
            wait_s = 1.0
        finally:
            async with changed:
                for g in grants:
                    self.book.unpin(g.version)
                changed.notify_all()
            await self.adapters.collect()
        return wait_s

    async def generate(self, grants: list[AdmissionGrant]) -> list[Trajectory]:
        """Generate, check, score and publish one batch of grants; returns the trajectories
        published (none when the batch overlapped a version that failed its sha256 or canary check)."""
        started, since = time.time(), time.monotonic()
        metrics.IN_FLIGHT.labels(self.run_id, self.replica).set(len(grants))
        work = self._requests(grants)
        outs = await self._generate_by_version(work)
        work, outs = [w for w, o in zip(work, outs) if o is not None], [o for o in outs if o is not None]
        if not await self.adapters.trusted(since, {g.version for g in grants}):
            # a version served meanwhile failed its sha256 or canary check: nothing of this batch
            # may be accepted; the registry frees the grants on a version given up when its
            # AdapterFailed comes, the others when their leases pass
            log.warning("rollout %s: %d groups dropped: generated beside weights that failed a check", self.replica,
                        len(work))  # fmt: skip
            metrics.IN_FLIGHT.labels(self.run_id, self.replica).set(0)
            return []
        finished = time.time()
        metrics.IN_FLIGHT.labels(self.run_id, self.replica).set(0)
        trajectories, tokens = self._trajectories(work, outs, started, finished)
        # one burst, its PubAcks gathered together: one round trip a batch, not one a group,
        # before the work loop's next round (each carries its id: a resend is stored once)
        subject = subjects.trajectory(self.run_id, self.replica)
        acks = await self.bus.publish_all(
            [(subject, codec.encode(t), t.trajectory_id) for t in trajectories], timeout=PUBLISH_TIMEOUT_S
        )
        failed = [ack for ack in acks if isinstance(ack, BaseException)]
        metrics.TRAJECTORIES.labels(self.run_id, self.replica).inc(len(acks) - len(failed))
        if failed:
            raise BusError(
                f"bus.url: {self.bus.url}, {len(failed)} of {len(acks)} trajectories not stored on {subject} "
                f"({failed[0]!r}); is nats-server up, with a stream capturing {subject} (ensure_streams)?"
            )
        metrics.TOKENS.labels(self.run_id, self.replica).inc(tokens)
        metrics.TOKENS_PER_SECOND.labels(self.run_id, self.replica).set(tokens / max(finished - started, 1e-9))
        return trajectories

    def _requests(self, grants: list[AdmissionGrant]) -> list[tuple[AdmissionGrant, Prompt, GenRequest]]:
        """Each grant with its next prompt and the request to generate it (seeded per batch)."""
        g = self.cfg.gconfig
        work = []
        for grant in grants:
            prompt = next(self._prompts)
            self._batches += 1
            req = GenRequest(
                prompt_token_ids=self.encode(prompt.text),
                n=g.n_samples,
                max_new_tokens=g.max_new_tokens,
                temperature=0.0 if g.greedy else g.temperature,
                top_p=g.top_p,
                top_k=g.top_k,
                stop_token_ids=list(g.stop_token_ids),
                seed=mix32(self._seed + mix32(self._batches)),
            )
            work.append((grant, prompt, req))
        return work

    async def _generate_by_version(self, work: list[tuple[AdmissionGrant, Prompt, GenRequest]]) -> list[Any]:
        """The engine's results per request (None where its version's generation failed), one
        engine call per version; raises only when every version failed."""
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
                await self.adapters.restore()
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
        return outs

    def _trajectories(
        self, work: list[tuple[AdmissionGrant, Prompt, GenRequest]], outs: list[Any], started: float, finished: float
    ) -> tuple[list[Trajectory], int]:
        """One scored Trajectory per grant, and the tokens generated."""
        trajectories, tokens = [], 0
        for (grant, prompt, req), results in zip(work, outs):
            sha256, engine_id = self.adapters.identity(grant.version)
            span = functools.partial(TokenRange, start=0, version=grant.version, adapter_sha256=sha256,
                                     engine=self.engine_name, engine_id=engine_id)  # fmt: skip
            completions = []
            for r in results:
                reward = self._reward(prompt, self.decode_text(r.token_ids))
                metrics.REWARD.labels(self.run_id, self.replica).observe(reward)
                tokens += len(r.token_ids)
                completions.append(
                    Completion(
                        token_ids=r.token_ids,
                        logprobs=r.logprobs,
                        versions=[grant.version] * len(r.token_ids),
                        reward=reward,
                        finish_reason=r.finish_reason,
                        ranges=[span(end=len(r.token_ids))] if r.token_ids else [],
                    )
                )
            trajectories.append(
                Trajectory(
                    run=self.run_id,
                    trajectory_id=f"{self.replica}-{uuid.uuid4().hex}",
                    grant_id=grant.grant_id,
                    replica=self.replica,
                    prompt_id=prompt.prompt_id,
                    prompt_token_ids=req.prompt_token_ids,
                    completions=completions,
                    started_at=started,
                    finished_at=finished,
                )
            )
        return trajectories, tokens

    def _reward(self, prompt: Prompt, completion: str) -> float:
        try:
            return float(self.reward_fn(prompt.text, completion, prompt.answer))
        except Exception as exc:  # the run's own code on the run's own data
            raise RunFault(
                f"train_dataset.reward_fn: {self.cfg.train_dataset.reward_fn or 'the default'} raised {exc!r} on "
                f"prompt {prompt.prompt_id!r}; fix the reward function and submit the run again"
            ) from exc

    # --- the run's life on the replica (`RunWorker`) ---
    async def start(self) -> None:
        """Load the newest version and follow the run's adapters; heartbeat and watch the engine."""
        self._tasks = [await self.adapters.start()]  # the consumer first: close() cancels it at once
        self._tasks += [
            asyncio.create_task(self.heartbeat_loop(self._stop), name=f"heartbeat:{self.run_id}"),
            asyncio.create_task(self.adapters.watch_engine_loop(self._stop), name=f"watch-engine:{self.run_id}"),
        ]

    async def drain(self) -> None:
        """Take no more grants, and wait for the generations in flight to end."""
        self.draining = True
        while self.book.in_flight():
            await asyncio.sleep(0.1)

    async def close(self) -> None:
        """Stop following and heartbeating; a run sharing the engine takes its versions off it."""
        self._stop.set()
        if self._tasks:
            consumer, *loops = self._tasks
            consumer.cancel()
            await _ended(loops, self.cfg.rollout.request_timeout_s)
            await asyncio.gather(consumer, return_exceptions=True)
        await self.adapters.close()
        if not self.release_versions:
            return
        for version in await self.engine.loaded_versions():
            try:
                await self.engine.unload_version(version)
            except Exception as exc:
                log.warning("rollout %s: run %s v%d not unloaded: %r", self.replica, self.run_id, version, exc)
        log.info("rollout %s: run %s closed; its versions left the engine", self.replica, self.run_id)

    async def run(self, stop: asyncio.Event) -> None:
        """Serve this run alone until `stop`, asking on its own admission subject (a replica of
        one run, on the replica's work loop)."""
        await self.start()
        runs: dict[str, Run] = {self.run_id: self}
        work = asyncio.create_task(work_loop(runs, self.admit, own=self.run_id, replica=self.replica,
                                             batch_groups=self.cfg.rollout.batch_groups, stop=stop,
                                             streaming=self.cfg.rollout.continuous))  # fmt: skip
        try:
            await stop.wait()
        finally:
            await _ended([work], self.cfg.rollout.request_timeout_s)
            await self.close()


async def _ended(tasks: list[asyncio.Task], within_s: float) -> None:
    """Let `tasks` end by themselves for up to `within_s` (a generation finishing), then cancel."""
    if not tasks:
        return
    _, pending = await asyncio.wait(tasks, timeout=within_s)
    for task in pending:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
