"""The trainer as its own process against a real nats-server and a real object store (local
directory, and S3 through the weed/MinIO fixture): v0 at start, v1 after B accepted groups,
kill -9 and restart resumes at the right version without announcing v0 again."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import msgspec
import pytest
import torch
import yaml

from proto import codec, subjects
from proto.messages import AdapterReady, Completion, TrainerStep, Trajectory
from services.common import adapter_io, streams
from services.common.bus import Bus
from services.common.models import load_base_model
from services.common.store import open_store
from services.config.schema import BusConfig
from tests.fixtures.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
B = 2
N_SAMPLES = 3
TEMPERATURE = 0.9


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    from tests.fixtures.tiny import tiny_qwen2

    path = tmp_path_factory.mktemp("tiny-model")
    tiny_qwen2(vocab_size=64, max_position_embeddings=64, eos_token_id=1).save_pretrained(path)
    return path


@torch.no_grad()
def sample_group(model, prompt: list[int], seed: int, max_new: int = 6) -> list[Completion]:
    """Real ancestral sampling with the tiny model; logprobs under logits / temperature."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(N_SAMPLES):
        ids, lps = list(prompt), []
        for _ in range(max_new):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1] / TEMPERATURE
            logp = torch.log_softmax(logits.float(), -1)
            tok = int(torch.multinomial(logp.exp(), 1, generator=g))
            ids.append(tok)
            lps.append(float(logp[tok]))
            if tok == 1:
                break
        completion = ids[len(prompt) :]
        out.append(
            Completion(
                token_ids=completion,
                logprobs=lps,
                versions=[0] * len(completion),
                reward=float(k % 2 == 0) + 0.1 * len(completion),
            )
        )
    return out


def trajectories(model, run: str, start: int) -> list[Trajectory]:
    groups = []
    for i in range(start, start + B):
        prompt = [2 + i, 5, 7 + i]
        groups.append(
            Trajectory(
                run=run,
                trajectory_id=f"traj-{i}",
                grant_id=f"g-{i}",
                replica="r0",
                prompt_id=f"p{i}",
                prompt_token_ids=prompt,
                completions=sample_group(model, prompt, seed=i),
                started_at=time.time(),
                finished_at=time.time(),
            )
        )
    return groups


def write_config(tmp_path: Path, run: str, nats_url: str, store_cfg, model_dir: Path) -> Path:
    store = msgspec.to_builtins(store_cfg)
    doc = {
        "experiment_name": run,
        "trial_name": "t",
        "run": run,
        "run_dir": str(tmp_path / "run"),
        "total_train_steps": 5,
        "bus": {"url": nats_url},
        "store": store,
        "metrics": {"host": "127.0.0.1", "port": 0},
        "gconfig": {"n_samples": N_SAMPLES, "temperature": TEMPERATURE, "lora_name": "it_lora"},
        "actor": {
            "path": str(model_dir),
            "device": "cpu",
            "dtype": "float32",
            "lora_rank": 4,
            "lora_alpha": 8,
            "checkpoint_every": 1,
            "optimizer": {"lr": 1e-2},
        },
        "rollout": {"consumer_batch_size": B, "max_head_offpolicyness": 2},
        "train_dataset": {"path": "builtin:arith", "reward_fn": "services.common.rewards:arith_reward"},
    }
    path = tmp_path / "trainer.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def start_trainer(config: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "services.trainer", "--config", str(config)],
        cwd=REPO,
        env=env,
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
    )


async def wait_event(bus: Bus, run: str, version: int, proc, log: Path, timeout: float = 120.0) -> AdapterReady:
    async def announced() -> AdapterReady | None:
        try:
            raw = await bus.js.get_last_msg(streams.ADAPTERS(run), subjects.adapter_ready(run, version))
            return codec.decode(raw.data, AdapterReady)
        except Exception:  # not there yet
            pass
        assert proc.poll() is None, f"trainer exited {proc.returncode}:\n{log.read_text()[-4000:]}"
        return None

    return await wait_until(announced, timeout, lambda: f"v{version}:\n{log.read_text()[-4000:]}", interval=0.2)


async def subject_counts(bus: Bus, run: str) -> dict[str, int]:
    info = await bus.js.stream_info(streams.ADAPTERS(run), subjects_filter=">")
    return dict(info.state.subjects or {})


def fetch_adapter(store, event: AdapterReady) -> dict[str, torch.Tensor]:
    obj = event.object_payload()
    data = store.get_bytes(obj.uri, sha256=obj.sha256, size=obj.bytes)
    assert adapter_io.sha256(data) == obj.sha256 and len(data) == obj.bytes
    return adapter_io.from_bytes(data)


@pytest.mark.parametrize("store_kind", ["local", "s3"])
async def test_trainer_publishes_trains_and_resumes(store_kind, request, tmp_path, nats_url, tiny_model_dir):
    if store_kind == "local":
        from services.config.schema import StoreConfig

        store_cfg = StoreConfig(uri=f"file://{tmp_path / 'store'}")
    else:
        store_cfg = request.getfixturevalue("s3_store_config")
    run = f"tr{uuid.uuid4().hex[:8]}"
    config = write_config(tmp_path, run, nats_url, store_cfg, tiny_model_dir)
    store = open_store(store_cfg)
    model = load_base_model(tiny_model_dir, "float32", "cpu").eval()
    log = tmp_path / "trainer.log"
    bus = await Bus.connect(BusConfig(url=nats_url), run=run, service="tester")
    proc = start_trainer(config, log)
    try:
        await bus.ensure_streams()
        v0 = await wait_event(bus, run, 0, proc, log)
        assert v0.parent_version is None and v0.trainer_step == 0 and v0.lora_name == "it_lora"
        assert v0.lora.rank == 4 and "q_proj" in v0.lora.target_modules
        w0 = fetch_adapter(store, v0)
        assert all(torch.count_nonzero(t) == 0 for k, t in w0.items() if "lora_B" in k)

        for traj in trajectories(model, run, 0):
            await bus.publish(subjects.accepted(run), traj, msg_id=traj.trajectory_id)
        v1 = await wait_event(bus, run, 1, proc, log)
        assert v1.parent_version == 0 and v1.trainer_step == 1
        assert v1.object_payload().uri.endswith(f"{run}/adapters/v1/adapter_model.safetensors")
        w1 = fetch_adapter(store, v1)
        assert w1.keys() == w0.keys()
        assert any(not torch.equal(w0[k], w1[k]) for k in w0 if "lora_B" in k)
        raw = await bus.js.get_last_msg(streams.TRAINER(run), subjects.trainer_step(run))
        step = codec.decode(raw.data, TrainerStep)
        assert (step.step, step.version, step.groups) == (0, 1, B)
        assert step.tokens == sum(len(c.token_ids) for t in trajectories(model, run, 0) for c in t.completions)

        # the acks follow the publish: wait until the durable has no pending message
        for _ in range(100):
            ci = await bus.js.consumer_info(streams.ACCEPTED(run), "trainer")
            if ci.num_ack_pending == 0 and ci.num_pending == 0:
                break
            await asyncio.sleep(0.1)
        assert ci.num_ack_pending == 0

        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        proc = start_trainer(config, log)
        for traj in trajectories(model, run, 10):
            await bus.publish(subjects.accepted(run), traj, msg_id=traj.trajectory_id)
        v2 = await wait_event(bus, run, 2, proc, log)
        assert v2.parent_version == 1 and v2.trainer_step == 2
        w2 = fetch_adapter(store, v2)
        assert any(not torch.equal(w1[k], w2[k]) for k in w1 if "lora_B" in k)
        counts = await subject_counts(bus, run)
        # v0 and v1 announced once each, even though the restarted trainer re-announced v1
        assert counts == {subjects.adapter_ready(run, v): 1 for v in (0, 1, 2)}, counts
        # the re-uploaded v1 (from the checkpoint) still matches v1's event
        fetch_adapter(store, v1)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
        await bus.close()
