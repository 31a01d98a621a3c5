"""The rollout service over a server engine (SGLang protocol server, real peft weights) and a
real nats-server: a load that fails while the server is down is reported and retried; a server
that restarts and forgets its adapters gets them back (from the engine watch, or from the
generation that finds its version gone), and every trajectory's logprobs are those of the
version it names."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from functools import partial

import pytest
import torch

from proto import subjects
from proto.messages import (
    AdapterFailed,
    AdapterLoaded,
    AdapterReady,
    AdmissionGrant,
    AdmissionRequest,
    Canary,
    ObjectPayload,
    RolloutReport,
    Trajectory,
)
from services.common import adapter_io, models
from services.common.bus import Bus
from services.common.data import Prompt
from services.common.store import LocalStore
from services.config.schema import (
    BusConfig,
    DatasetConfig,
    GenerationConfig,
    LorabusConfig,
    RolloutConfig,
    StoreConfig,
)
from services.local.ports import free_port
from services.rollout import metrics
from services.rollout.__main__ import fetcher
from services.rollout.engines.http import AdapterDirs, Http
from services.rollout.engines.sglang import SglangEngine
from services.rollout.service import RolloutService
from services.trainer import canary as trainer_canary
from services.trainer.publish import publish_canary
from tests.fixtures.sglang_server import ServerArgs, SglangProtocolServer
from tests.fixtures.vllm import TINY_MODEL, make_adapter
from tests.fixtures.waiting import wait_until

LORA = "tiny_lora"


# the sidecar waits out the server's restart within one of these
until = partial(wait_until, timeout=60.0)


class Run:
    """A run id, a bus with a granting responder, a store, and recorded reports/trajectories."""

    def __init__(self, nats_url: str, tmp_path, heartbeat_s: float):
        self.id = f"rs{uuid.uuid4().hex[:8]}"
        self.tmp = tmp_path
        self.cfg = LorabusConfig(
            run=self.id,
            seed=5,
            bus=BusConfig(url=nats_url),
            store=StoreConfig(uri=f"file://{tmp_path}/store"),
            gconfig=GenerationConfig(n_samples=2, max_new_tokens=4, temperature=1.0, lora_name=LORA),
            rollout=RolloutConfig(
                engine="sglang",
                lora_name=LORA,
                lora_keep_versions=2,
                batch_groups=2,
                heartbeat_s=heartbeat_s,
                adapter_dir=str(tmp_path / "adapters"),
            ),
            train_dataset=DatasetConfig(path="builtin:none"),
        )
        self.store = LocalStore(tmp_path / "store")
        self.reports: list = []
        self.trajectories: list[Trajectory] = []
        self.tok = models.load_tokenizer(TINY_MODEL)
        self.adapters = {v: make_adapter(rank=8, seed=40 + v) for v in range(2)}

    async def start(self) -> None:
        self.bus = await Bus.connect(self.cfg.bus, run=self.id, service="test")
        await self.bus.ensure_streams()

        async def on_report(msg, meta):
            self.reports.append(msg)

        async def on_trajectory(msg, meta):
            self.trajectories.append(msg)

        async def admission(req: AdmissionRequest):
            # any loaded version: batches mix versions, so a mix-up would show in the logprobs
            return AdmissionGrant(
                request_id=req.request_id,
                grant_id=uuid.uuid4().hex,
                version=random.choice(req.loaded_versions),
                lease_expires_at=time.time() + 60,
            )

        await self.bus.subscribe(subjects.rollout_report_all(self.id), RolloutReport, on_report)
        await self.bus.subscribe(subjects.trajectory_all(self.id), Trajectory, on_trajectory)
        await self.bus.serve(subjects.admission(self.id), AdmissionRequest, admission)

    def canary(self, version: int) -> Canary:
        """The trainer's canary of `version`: transformers + peft on its weights."""
        from peft import PeftModel

        d = AdapterDirs(LORA, self.tmp / "canary").local(version)
        adapter_io.write_peft_dir(d, *self.adapters[version])
        model = PeftModel.from_pretrained(models.load_base_model(TINY_MODEL), str(d)).eval()
        prompt_ids = trainer_canary.prompts(model.config.vocab_size, seed=self.cfg.seed, n=4, length=6)
        return trainer_canary.reference(model, prompt_ids, "float32")

    async def publish(self, version: int, with_canary: bool = False) -> None:
        """Announce `version`; `with_canary`: its event says the canary follows, and the
        trainer's canary is published after it, as the trainer does."""
        data, spec = self.adapters[version]
        ref = self.store.put_bytes(f"{self.id}/adapters/v{version}/adapter_model.safetensors", data)
        ev = AdapterReady(
            run=self.id,
            trainer_epoch="e0",
            lora_name=LORA,
            version=version,
            trainer_step=version,
            created_at=time.time(),
            lora=spec,
            payloads=[ObjectPayload(uri=ref.uri, bytes=ref.bytes, sha256=ref.sha256)],
            canary_follows=with_canary,
        )
        await self.bus.publish(subjects.adapter_ready(self.id, version), ev, msg_id=f"{self.id}-v{version}")
        if with_canary:
            await publish_canary(self.bus, ev, self.canary(version))

    def service(self, url: str) -> tuple[SglangEngine, RolloutService]:
        engine = SglangEngine(
            [url], AdapterDirs(LORA, self.cfg.rollout.adapter_dir), http=Http(timeout_s=60, attempts=2, backoff_s=0.05)
        )
        prompts = [Prompt(prompt_id=f"p{i}", text=f"{i}+{i}=", answer=str(2 * i)) for i in range(5)]
        return engine, RolloutService(
            self.cfg,
            "r1",
            engine,
            self.bus,
            fetch=fetcher(self.cfg),
            encode=lambda text: models.encode_prompt(self.tok, text),
            decode_text=lambda ids: models.decode_completion(self.tok, ids),
            reward_fn=lambda prompt, completion, answer: 0.0,
            prompts=prompts,
            engine_name="sglang",
            load_attempts=8,
            retry_base_s=0.1,
        )

    def of(self, kind, **match) -> list:
        return [r for r in self.reports if isinstance(r, kind) and all(getattr(r, k) == v for k, v in match.items())]

    def check_attribution(self, trajectories: list[Trajectory]) -> None:
        """Each completion's logprobs equal a separate peft forward of the version it names."""
        from peft import PeftModel

        refs = {}
        for v in {t.oldest_version() for t in trajectories}:
            d = AdapterDirs(LORA, self.tmp / "ref").local(v)
            from services.common import adapter_io

            adapter_io.write_peft_dir(d, *self.adapters[v])
            refs[v] = PeftModel.from_pretrained(models.load_base_model(TINY_MODEL), str(d)).eval()
        for t in trajectories:
            for c in t.completions:
                assert set(c.versions) == {t.oldest_version()}
                ids = torch.tensor([t.prompt_token_ids + c.token_ids])
                with torch.no_grad():
                    logits = refs[t.oldest_version()](input_ids=ids).logits[0].double()
                p = len(t.prompt_token_ids)
                want = logits[p - 1 : -1].log_softmax(-1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
                torch.testing.assert_close(torch.tensor(c.logprobs, dtype=torch.float64), want, atol=1e-4, rtol=0)


def observations(histogram) -> float:
    return sum(bucket.get() for bucket in histogram._buckets)


async def restart(server: SglangProtocolServer, port: int) -> SglangProtocolServer:
    """Stop it (if it still runs) and start a fresh one on the same port: same URL, no adapters."""
    await server.stop()
    fresh = SglangProtocolServer(ServerArgs(model_path=str(TINY_MODEL), max_loras_per_batch=3))
    await fresh.start(port=port)
    return fresh


@pytest.mark.parametrize("watch", [True, False], ids=["engine-watch", "generation-finds-it-gone"])
async def test_server_down_then_restarted(nats_url, tmp_path, watch):
    # engine watch at 0.3 s, or so slow that only a generation can notice the restart
    run = Run(nats_url, tmp_path, heartbeat_s=0.3 if watch else 600.0)
    await run.start()
    port = free_port()
    engine, service = run.service(f"http://127.0.0.1:{port}")
    await run.publish(0)
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    server = None
    try:
        # no server yet: the load is reported as failed, will_retry, and retried
        await until(lambda: run.of(AdapterFailed, version=0), what="a failed load of v0")
        failed = run.of(AdapterFailed, version=0)[0]
        assert failed.will_retry and "no answer" in failed.reason
        server = SglangProtocolServer(ServerArgs(model_path=str(TINY_MODEL), max_loras_per_batch=3))
        await server.start(port=port)
        await until(lambda: run.of(AdapterLoaded, version=0), what="v0 loaded once the server is up")
        await run.publish(1)
        await until(lambda: run.of(AdapterLoaded, version=1), what="v1 loaded")
        await until(lambda: len({t.oldest_version() for t in run.trajectories}) == 2, what="trajectories on v0 and v1")

        if watch:  # down for a while: the replica stops routing to it and reports every re-load that fails
            await server.stop()
            failed_before = len(run.of(AdapterFailed))
            await until(lambda: len(run.of(AdapterFailed)) >= failed_before + 2, what="failed re-loads reported")
            assert await engine.loaded_versions() == []
            assert any("re-load after the server forgot it" in r.reason for r in run.of(AdapterFailed)[failed_before:])
        server = await restart(server, port)
        before = len(run.trajectories)
        await until(
            lambda: len(run.of(AdapterLoaded, version=1)) == 2 and len(run.of(AdapterLoaded, version=0)) == 2,
            what="v0 and v1 reported loaded again",
        )
        assert sorted(server.loaded_adapters()) == [f"{LORA}-v0", f"{LORA}-v1"]
        await until(lambda: len(run.trajectories) >= before + 6, what="trajectories after the restart")
        assert await engine.loaded_versions() == [0, 1]
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        await engine.close()
        if server is not None:
            await server.stop()
        await run.bus.close()
    run.check_attribution(run.trajectories)


async def test_a_version_the_restarted_server_answers_with_other_weights_is_withdrawn(nats_url, tmp_path):
    """Issue 28: the canary after a server restart. Both versions pass their canary on the first
    load (checked while they serve); the server is restarted and comes back answering v1's name
    with the base model (a LoRA request dropped after the restart). The re-load of v0 passes its
    canary again (read back from the CANARIES stream: the canaries follow the events), checked
    before the restore reports it; v1's fails: it is reported with the figures, never served
    again on this replica, which goes on with v0."""
    run = Run(nats_url, tmp_path, heartbeat_s=0.3)
    run.adapters = {v: make_adapter(rank=8, seed=40 + v, scale=3.0) for v in range(2)}
    await run.start()
    port = free_port()
    engine, service = run.service(f"http://127.0.0.1:{port}")
    server = SglangProtocolServer(ServerArgs(model_path=str(TINY_MODEL), max_loras_per_batch=3))
    await server.start(port=port)
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    try:
        await run.publish(0, with_canary=True)
        await until(lambda: run.of(AdapterLoaded, version=0), what="v0 loaded")
        await run.publish(1, with_canary=True)
        await until(lambda: run.of(AdapterLoaded, version=1), what="v1 loaded")
        # marked loaded first, checked beside serving: the reports name no canary seconds
        assert all(r.canary_seconds is None for r in run.of(AdapterLoaded))
        await until(lambda: observations(metrics.CANARY_SECONDS.labels(run.id, "r1")) == 2, what="both canaries")
        assert not run.of(AdapterFailed) and service.adapters.loaded() == [0, 1]
        await server.stop()
        server = SglangProtocolServer(ServerArgs(model_path=str(TINY_MODEL), max_loras_per_batch=3))
        answer_as = server._adapter
        v1 = AdapterDirs(LORA, "").name(1)
        server._adapter = lambda name: answer_as(None if name == v1 else name)  # type: ignore[method-assign]
        await server.start(port=port)
        await until(lambda: len(run.of(AdapterLoaded, version=0)) == 2, what="v0 re-loaded, its canary passed")
        assert run.of(AdapterLoaded, version=0)[1].canary_seconds is not None, "checked before it was reported"
        await until(
            lambda: any("canary gap" in r.reason for r in run.of(AdapterFailed, version=1)), what="v1 withdrawn"
        )
        failed = [r for r in run.of(AdapterFailed, version=1) if "canary gap" in r.reason][0]
        assert not failed.will_retry and "re-loaded after the server forgot it" in failed.reason
        assert len(run.of(AdapterLoaded, version=1)) == 1  # never reported servable again
        await until(lambda: service.adapters.loaded() == [0], what="v1 off the replica's book")
        before = len(run.trajectories)
        await until(lambda: len(run.trajectories) >= before + 4, what="trajectories after the restart")
        assert {t.oldest_version() for t in run.trajectories[before:]} == {0}
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        await engine.close()
        await server.stop()
        await run.bus.close()
