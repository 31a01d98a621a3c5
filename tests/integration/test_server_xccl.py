"""XCCL into inference servers: the real vLLM server (CPU build) and the SGLang protocol
server, each behind the real sidecar code (`AdapterFollower` + server engine + `XcclReceiver`)
on a real nats-server, with the trainer's own publish path (`publish_adapter` + `XcclSender`,
gloo) in this process.

What is checked, on the server itself (its adapter listing, its generations):
- a sidecar outside the group (v0, or a late one) loads the object copy, then joins;
- a version broadcast to the group is written to a memory-backed directory and loaded under
  its own name; generation through it has the logprobs of transformers + peft;
- an older version, pinned by work in flight, keeps answering while newer ones arrive, and
  leaves the server once unpinned and outside the keep window;
- the durable copy lands behind the event and reads back verified;
- a trainer SIGKILLed mid-broadcast: no partial version ever reaches the server; the sidecar
  keeps serving its previous version and follows a restarted trainer.

One vLLM server for the module (tests/fixtures/vllm.py); names are unique per test.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import msgspec
import pytest
import torch

from proto import subjects
from proto.messages import (
    AdapterLoaded,
    AdapterReady,
    LoraSpec,
    ObjectPayload,
    RolloutReport,
    XcclBackend,
    XcclPayload,
)
from services.common import adapter_io, durable, models
from services.common.bus import Bus
from services.common.store import LocalStore
from services.config.schema import (
    ActorConfig,
    BusConfig,
    DatasetConfig,
    GenerationConfig,
    LorabusConfig,
    RolloutConfig,
    StoreConfig,
)
from services.rollout.__main__ import fetcher
from services.rollout.adapters import AdapterFollower
from services.rollout.engines.base import GenRequest
from services.rollout.engines.http import AdapterDirs, Http, ServerEngine
from services.rollout.engines.sglang import SglangEngine
from services.rollout.engines.vllm import VllmEngine
from services.trainer.publish import publish_adapter
from services.trainer.xccl_sender import XcclSender
from tests.fixtures.faults import KillAtBroadcast
from tests.fixtures.sglang_server import ServerArgs, SglangProtocolServer
from tests.fixtures.vllm import TINY_MODEL, make_adapter, vllm_server  # noqa: F401
from tests.fixtures.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 5.0
BUCKET = 4096  # bytes: the tiny adapter travels in several buckets (a kill can land mid-way)
SHM = Path("/dev/shm") if Path("/dev/shm").is_dir() else None

pytestmark = [pytest.mark.timeout(300)]


@functools.cache
def tensors_of(seed: int) -> dict[str, torch.Tensor]:
    return adapter_io.from_bytes(make_adapter(rank=8, seed=seed, scale=3.0)[0])


@functools.cache
def spec() -> LoraSpec:
    return make_adapter(rank=8, zero_b=True)[1]


# --- the pieces of a run ---------------------------------------------------------------------


class Run:
    """One run: a bus, a local store, the trainer side, and every rollout report."""

    def __init__(self, nats_url: str, tmp_path: Path):
        self.id = f"sx{uuid.uuid4().hex[:8]}"
        self.lora = f"xa{self.id[-6:]}"
        self.tmp = tmp_path
        self.nats_url = nats_url
        self.store = LocalStore(tmp_path / "store")
        self.adapter_root = (SHM or tmp_path) / f"lorabus-test-{self.id}"
        self.reports: list = []
        self.events: dict[int, AdapterReady] = {}
        self.sender: XcclSender | None = None
        self.followers: list[tuple[AdapterFollower, asyncio.Task]] = []

    def cfg(self, lora_name: str) -> LorabusConfig:
        return LorabusConfig(
            run=self.id,
            bus=BusConfig(url=self.nats_url),
            store=StoreConfig(uri=f"file://{self.tmp}/store"),
            gconfig=GenerationConfig(lora_name=self.lora),
            actor=ActorConfig(path=str(TINY_MODEL), weight_update_mode="xccl", xccl_timeout_s=TIMEOUT_S),
            rollout=RolloutConfig(lora_name=lora_name, max_head_offpolicyness=1, device="cpu", heartbeat_s=600),
            train_dataset=DatasetConfig(path="builtin:none"),
        )

    async def start(self) -> None:
        self.bus = await Bus.connect(BusConfig(url=self.nats_url), run=self.id, service="test")
        await self.bus.ensure_streams()

        async def on_report(msg, meta):
            self.reports.append(msg)

        await self.bus.subscribe(subjects.rollout_report_all(self.id), RolloutReport, on_report)

    def new_sender(self, backend: XcclBackend = "gloo") -> XcclSender:
        self.sender = XcclSender(address="127.0.0.1", port=0, backend=backend, bucket_bytes=BUCKET, timeout_s=TIMEOUT_S)
        return self.sender

    async def publish(self, version: int, tensors: dict[str, torch.Tensor]) -> AdapterReady:
        """What the trainer does for each version (`trainer.service.Rank0.announce`)."""
        ev = await publish_adapter(
            self.bus,
            self.store,
            run=self.id,
            epoch="e0",
            lora_name=self.lora,
            version=version,
            tensors=tensors,
            lora=spec(),
            trainer_step=version,
            sender=self.sender,
        )
        assert ev is not None
        self.events[version] = ev
        return ev

    async def publish_payload(self, version: int, tensors: dict[str, torch.Tensor], xp: XcclPayload) -> None:
        """An event for a broadcast another process did: the object stored first, then the event."""
        ref = self.store.put_bytes(
            f"{self.id}/adapters/v{version}/adapter_model.safetensors", adapter_io.to_bytes(tensors)
        )
        ev = AdapterReady(
            run=self.id,
            trainer_epoch="e0",
            lora_name=self.lora,
            version=version,
            trainer_step=version,
            created_at=time.time(),
            lora=spec(),
            payloads=[ObjectPayload(uri=ref.uri, bytes=ref.bytes, sha256=ref.sha256), xp],
        )
        await self.bus.publish(subjects.adapter_ready(self.id, version), ev, msg_id=f"adapter-v{version}")
        self.events[version] = ev

    async def sidecar(
        self, kind: str, url: str, replica: str, name: str, *, check_name: bool = True
    ) -> AdapterFollower:
        """A rollout sidecar: `name` is its adapters' name prefix on the server."""
        cls: type[ServerEngine] = VllmEngine if kind == "vllm" else SglangEngine
        engine = cls([url], AdapterDirs(name, self.adapter_root / replica), http=Http(timeout_s=60, attempts=2))
        cfg = self.cfg(name if check_name else "")
        f = AdapterFollower(
            cfg,
            replica,
            engine,
            self.bus,
            keep=cfg.rollout.keep_versions,
            fetch=fetcher(cfg),
            engine_name=kind,
            load_attempts=3,
            retry_base_s=0.1,
        )
        self.followers.append((f, await f.start()))
        return f

    def via(self, replica: str, version: int) -> list[str]:
        return [
            r.via for r in self.reports if isinstance(r, AdapterLoaded) and (r.replica, r.version) == (replica, version)
        ]

    async def loaded(self, f: AdapterFollower, version: int) -> str:
        """Wait until `f` serves `version`; how it got there."""
        await wait_until(lambda: version in f.loaded() and self.via(f.replica, version), timeout=60.0)
        return self.via(f.replica, version)[0]

    async def close(self) -> None:
        for f, task in self.followers:
            task.cancel()
            await f.close()
            await f.engine.close()
        if self.sender is not None:
            await asyncio.to_thread(self.sender.close)
        await self.bus.close()
        shutil.rmtree(self.adapter_root, ignore_errors=True)


async def joins(sender: XcclSender, n: int) -> None:
    await wait_until(lambda: sender.store.add("join_seq", 0) >= n, timeout=20.0)


def peft_logprobs(adapter_dir: Path, prompt: list[int], completion: list[int]) -> list[float]:
    from peft import PeftModel

    model = PeftModel.from_pretrained(models.load_base_model(TINY_MODEL), str(adapter_dir)).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
    lp = torch.log_softmax(logits.double(), dim=-1)
    return lp.gather(1, torch.tensor(completion)[:, None])[:, 0].tolist()


def server_lists(kind: str, url: str) -> dict[str, str]:
    """name -> path of the adapters a vLLM server lists (SGLang has no listing)."""
    body = httpx.get(f"{url}/v1/models", timeout=10).json()
    return {m["id"]: m["root"] for m in body["data"] if m.get("parent") is not None}


@pytest.fixture(params=["vllm", "sglang"])
async def server(request):
    """(kind, url) of a server with runtime LoRA loading."""
    if request.param == "vllm":
        yield "vllm", request.getfixturevalue("vllm_server").url
        return
    srv = SglangProtocolServer(ServerArgs(model_path=str(TINY_MODEL), max_loras_per_batch=4, max_lora_rank=16))
    url = await srv.start()
    try:
        yield "sglang", url
    finally:
        await srv.stop()


# --- the tests -------------------------------------------------------------------------------


async def test_versions_arrive_by_broadcast_stay_servable_and_a_replica_outside_the_group_reads_the_object(
    server, nats_url, tmp_path
):
    kind, url = server
    run = Run(nats_url, tmp_path)
    await run.start()
    run.new_sender()
    tok = models.load_tokenizer(TINY_MODEL)
    prompt = models.encode_prompt(tok, "12+34=")
    try:
        await run.publish(0, tensors_of(0))  # nobody in the group yet: the object path
        a = await run.sidecar(kind, url, "a", run.lora)
        assert await run.loaded(a, 0) == "object"
        await joins(run.sender, 1)  # seeing the handle made it join

        t1 = tensors_of(1)
        ev1 = await run.publish(1, t1)
        assert ev1.xccl_payload().ranks == {"a": 1} and ev1.object_payload().sha256 is None
        assert await run.loaded(a, 1) == "xccl"
        d1 = a.engine.dirs.local(1)
        if SHM is not None:
            assert d1.is_relative_to(SHM)  # memory-backed: no disk, no object store on the hot path
        if kind == "vllm":
            assert server_lists(kind, url)[a.engine.dirs.name(1)] == a.engine.dirs.server(1)
        # generation through the broadcast version is transformers + peft on those weights
        (out,) = await a.engine.generate([GenRequest(prompt_token_ids=prompt, max_new_tokens=6, temperature=0.0)], 1)
        ref_dir = tmp_path / "ref1"
        adapter_io.write_peft_dir(ref_dir, adapter_io.to_bytes(tensors_of(1)), spec())
        want = peft_logprobs(ref_dir, prompt, out[0].token_ids)
        got = torch.tensor(out[0].logprobs, dtype=torch.float64)
        torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), atol=1e-4, rtol=0)

        # v1 pinned by work in flight: it keeps answering while v2 and v3 arrive
        a.book.pin(1)
        answers, errors, stop = [], [], asyncio.Event()

        async def keep_generating() -> None:
            while not stop.is_set():
                try:
                    answers.append(
                        await a.engine.generate(
                            [GenRequest(prompt_token_ids=prompt, max_new_tokens=2, temperature=0.0)], 1
                        )
                    )
                except Exception as exc:  # recorded, asserted below
                    errors.append(exc)

        gen = asyncio.create_task(keep_generating())
        for v in (2, 3):
            await run.publish(v, tensors_of(v))
            assert await run.loaded(a, v) == "xccl"
        stop.set()
        await gen
        assert not errors and len(answers) >= 2, (errors, len(answers))
        assert all(x[0][0].token_ids == answers[0][0][0].token_ids for x in answers)  # still v1's answer
        assert a.loaded() == [1, 2, 3]
        a.book.unpin(1)
        await a.collect()
        assert a.loaded() == [2, 3] and not a.engine.dirs.exists(1)
        if kind == "vllm":
            listed = server_lists(kind, url)
            assert a.engine.dirs.name(1) not in listed and a.engine.dirs.name(3) in listed

        # the durable copies landed behind their events, verified against the sealed marker
        await asyncio.wrap_future(run.sender.durable)
        for v in (1, 2, 3):
            assert durable.read(run.store, run.events[v].object_payload()) == adapter_io.to_bytes(tensors_of(v))

        # a sidecar outside the group: the head by its object copy, then it joins
        b = await run.sidecar(kind, url, "b", f"xb{run.id[-6:]}", check_name=False)
        assert await run.loaded(b, 3) == "object"
        await joins(run.sender, 2)
        ev4 = await run.publish(4, tensors_of(4))
        assert set(ev4.xccl_payload().ranks) == {"a", "b"}
        assert await run.loaded(a, 4) == "xccl" and await run.loaded(b, 4) == "xccl"
    finally:
        await run.close()


async def test_a_trainer_killed_mid_broadcast_never_reaches_the_server(server, nats_url, tmp_path):
    kind, url = server
    run = Run(nats_url, tmp_path)
    await run.start()
    trainer = TrainerChild(kill_version=2, kill_after=2)
    try:
        xp0 = trainer.send(0, seed=0)
        await run.publish_payload(0, tensors_of(0), xp0)
        a = await run.sidecar(kind, url, "a", run.lora)
        assert await run.loaded(a, 0) == "object"
        await wait_until(lambda: a.xccl is not None and a.xccl.joined == ("127.0.0.1", xp0.master_port), timeout=20.0)
        xp1 = trainer.send(1, seed=1)
        assert xp1.ranks == {"a": 1}
        await run.publish_payload(1, tensors_of(1), xp1)
        assert await run.loaded(a, 1) == "xccl"

        trainer.send_and_die(2, seed=2)  # dies after 2 of v2's buckets: no event is ever published
        await wait_until(lambda: a.xccl.group is None, timeout=3 * TIMEOUT_S)
        assert a.xccl._staged == {} and a.loaded() == [0, 1]
        assert not a.engine.dirs.local(2).exists()
        if kind == "vllm":
            assert a.engine.dirs.name(2) not in server_lists(kind, url)
        (out,) = await a.engine.generate([GenRequest(prompt_token_ids=[5, 6, 7], max_new_tokens=2, temperature=0.0)], 1)
        assert out[0].token_ids

        # a restarted trainer (new handle): v2 by the object copy, then the sidecar is in its group
        run.new_sender()
        await run.publish(2, tensors_of(22))
        assert await run.loaded(a, 2) == "object"
        await joins(run.sender, 1)
        await run.publish(3, tensors_of(3))
        assert await run.loaded(a, 3) == "xccl"
    finally:
        trainer.stop()
        await run.close()


async def test_nccl_asked_where_a_rank_has_no_gpu_of_its_own_forms_a_gloo_group(nats_url, tmp_path):
    """The H200 symptom, on CPU: the trainer asks for nccl (`auto` on a GPU) and the sidecar
    cannot take an NCCL rank of its own (here it has no GPU; on one GPU it shares the
    trainer's, which NCCL refuses). The group must still form, as gloo, and the versions
    arrive by broadcast, not every one by the object copy."""
    srv = SglangProtocolServer(ServerArgs(model_path=str(TINY_MODEL), max_loras_per_batch=4, max_lora_rank=16))
    url = await srv.start()
    run = Run(nats_url, tmp_path)
    await run.start()
    run.new_sender(backend="nccl")
    try:
        await run.publish(0, tensors_of(0))
        a = await run.sidecar("sglang", url, "a", run.lora)
        assert await run.loaded(a, 0) == "object"
        await joins(run.sender, 1)
        for v in (1, 2):
            ev = await run.publish(v, tensors_of(v))
            xp = ev.xccl_payload()
            assert xp is not None and xp.ranks == {"a": 1} and xp.backend == "gloo", xp
            assert await run.loaded(a, v) == "xccl"
        assert run.sender.stats.error == "" and run.sender.epoch == 1  # one group, never dropped
    finally:
        await run.close()
        await srv.stop()


# --- a trainer in a process of its own, to be SIGKILLed mid-broadcast -------------------------


def trainer_main(kill_version: int, kill_after: int) -> None:
    sender = XcclSender(address="127.0.0.1", port=0, backend="gloo", bucket_bytes=BUCKET, timeout_s=TIMEOUT_S)
    print(json.dumps({"port": sender.port}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["version"] == kill_version and sender.pg is not None:
            sender.pg = KillAtBroadcast(sender.pg, kill_after)
        payload = sender.send(cmd["version"], tensors_of(cmd["seed"]))
        print(msgspec.json.encode(payload).decode(), flush=True)


class TrainerChild:
    def __init__(self, kill_version: int, kill_after: int):
        self.proc = subprocess.Popen(
            [sys.executable, __file__, str(kill_version), str(kill_after)],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        self.proc.stdout.readline()

    def send_and_die(self, version: int, seed: int) -> None:
        self.proc.stdin.write(json.dumps({"version": version, "seed": seed}) + "\n")
        self.proc.stdin.flush()
        assert self.proc.wait(timeout=30) == -signal.SIGKILL

    def send(self, version: int, seed: int) -> XcclPayload:
        self.proc.stdin.write(json.dumps({"version": version, "seed": seed}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"trainer child exited ({self.proc.poll()})"
        return msgspec.json.decode(line, type=XcclPayload)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


if __name__ == "__main__":
    trainer_main(int(sys.argv[1]), int(sys.argv[2]))
