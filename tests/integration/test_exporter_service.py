"""The exporter as its own process (`python -m services.exporter`) on a real nats-server, with
the local store and the real S3 server: adapter events v0..v2 (hf-peft) and v3
(megatron-bridge) become PEFT directories that load with `PeftModel.from_pretrained` and
reproduce the trainer-side model; a re-sent event and a restart change nothing."""

from __future__ import annotations

import asyncio
import copy
import re
import time
import urllib.request
import uuid
from pathlib import Path

import msgspec
import nats.js.errors
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import Qwen3Config, Qwen3ForCausalLM

from proto import codec, subjects
from proto.messages import AdapterReady, DeadLetter, ExportDone, LoraSpec, ObjectPayload
from services.common import adapter_io, streams
from services.common.bus import Bus
from services.common.lora_targets import HF_LINEAR
from services.common.store import open_store
from services.config.schema import BusConfig, StoreConfig
from tests.fixtures.service_process import ServiceProcess
from tests.fixtures.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
TARGETS = list(HF_LINEAR)
RANK, ALPHA = 4, 8.0
HEADS, GROUPS, HEAD_DIM = 4, 2, 8
MODEL = Qwen3Config(
    vocab_size=80,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=HEADS,
    num_key_value_heads=GROUPS,
    head_dim=HEAD_DIM,
    max_position_embeddings=64,
)


class ExporterProcess(ServiceProcess):
    def __init__(self, config: Path, log: Path):
        super().__init__("services.exporter", config, log)

    def metrics(self) -> str:
        ports = re.findall(r"metrics on port (\d+)", self.log_text())
        assert ports, f"no metrics port in the log:\n{self.log_text()}"
        with urllib.request.urlopen(f"http://127.0.0.1:{ports[-1]}/metrics", timeout=5) as r:
            return r.read().decode()


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert m, f"{name} not exported"
    return float(m.group(1))


@pytest.fixture(params=["local", "s3"])
def store_cfg(request, tmp_path) -> StoreConfig:
    if request.param == "local":
        return StoreConfig(uri=f"file://{tmp_path}/store")
    return request.getfixturevalue("s3_store_config")


def source_model(base, seed: int):
    """The trainer's side of version `seed`: a LoRA model with every A and B random, where the
    A's that Megatron fuses (q/k/v, gate/up) are shared, so both layouts can express it."""
    model = get_peft_model(
        copy.deepcopy(base),
        LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0, task_type="CAUSAL_LM"),
    )
    g = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        for name, p in params.items():
            for shared, owner in (
                ("k_proj.lora_A", "q_proj.lora_A"),
                ("v_proj.lora_A", "q_proj.lora_A"),
                ("up_proj.lora_A", "gate_proj.lora_A"),
            ):
                if shared in name:
                    p.copy_(params[name.replace(shared, owner)])
    return model.eval()


def hf_tensors(model) -> dict[str, torch.Tensor]:
    return {adapter_io.standardize_key(n): p.detach() for n, p in model.named_parameters() if "lora_" in n}


def megatron_tensors(model) -> dict[str, torch.Tensor]:
    """The same adapter as megatron-bridge names and fuses it."""
    t = {adapter_io.parse_peft_key(k): v for k, v in hf_tensors(model).items()}
    out = {}
    qpg = HEADS // GROUPS
    for layer in range(MODEL.num_hidden_layers):
        m, d = f"model.layers.{layer}", f"decoder.layers.{layer}"
        q, k, v = (t[(f"{m}.self_attn.{n}", "B")] for n in ("q_proj", "k_proj", "v_proj"))
        qkv = torch.cat(
            [
                torch.cat(
                    [
                        q[g * qpg * HEAD_DIM : (g + 1) * qpg * HEAD_DIM],
                        k[g * HEAD_DIM : (g + 1) * HEAD_DIM],
                        v[g * HEAD_DIM : (g + 1) * HEAD_DIM],
                    ]
                )
                for g in range(GROUPS)
            ]
        )
        fused = {
            "self_attention.linear_qkv": (t[(f"{m}.self_attn.q_proj", "A")], qkv),
            "self_attention.linear_proj": (t[(f"{m}.self_attn.o_proj", "A")], t[(f"{m}.self_attn.o_proj", "B")]),
            "mlp.linear_fc1": (
                t[(f"{m}.mlp.gate_proj", "A")],
                torch.cat([t[(f"{m}.mlp.gate_proj", "B")], t[(f"{m}.mlp.up_proj", "B")]]),
            ),
            "mlp.linear_fc2": (t[(f"{m}.mlp.down_proj", "A")], t[(f"{m}.mlp.down_proj", "B")]),
        }
        for module, (a, b) in fused.items():
            out[f"{d}.{module}.adapter.linear_in.weight"] = a
            out[f"{d}.{module}.adapter.linear_out.weight"] = b
    return out


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


async def wait_export(bus: Bus, proc: ExporterProcess, version: int, timeout: float = 60.0):
    """The EXPORTS stream's ExportDone for `version` and its stream sequence."""
    stream, subject = streams.EXPORTS(bus.run), subjects.export_done(bus.run, version)

    async def exported() -> tuple[ExportDone, int] | None:
        try:
            raw = await bus.js.get_last_msg(stream, subject)
            return codec.decode(raw.data, ExportDone), raw.seq
        except nats.js.errors.NotFoundError:  # until the exporter publishes
            pass
        assert proc.alive(), f"exporter exited:\n{proc.log_text()[-4000:]}"
        return None

    return await wait_until(exported, timeout, lambda: f"the export of v{version}:\n{proc.log_text()[-4000:]}")


def fetch_dir(done: ExportDone, store_cfg: StoreConfig, dest: Path) -> Path:
    """The exported directory as a local path (downloaded from S3 when exported there)."""
    if done.uri.startswith("file://"):
        return Path(done.uri[len("file://") :])
    store = open_store(
        StoreConfig(**{**{f: getattr(store_cfg, f) for f in store_cfg.__struct_fields__}, "uri": done.uri})
    )
    dest.mkdir(parents=True)
    for name in done.files:
        (dest / name).write_bytes(store.get_bytes(store.uri_for(name)))
    return dest


def start_exporter(
    tmp_path: Path, nats_url: str, store_cfg: StoreConfig, run: str, base_dir: Path
) -> tuple[ExporterProcess, str]:
    export_uri = (
        f"file://{tmp_path}/export"
        if store_cfg.uri.startswith("file://")
        else store_cfg.uri.rsplit("/", 1)[0] + "/export"
    )
    config = tmp_path / "exporter.yaml"
    config.write_text(f"""
experiment_name: {run}
trial_name: t
run: {run}
bus: {{url: "{nats_url}"}}
store: {{uri: "{store_cfg.uri}", endpoint: {store_cfg.endpoint or "null"},
         access_key_env: {store_cfg.access_key_env}, secret_key_env: {store_cfg.secret_key_env}}}
metrics: {{host: 127.0.0.1, port: 0}}
actor: {{path: "{base_dir}"}}
train_dataset: {{path: "builtin:arith"}}
exporter: {{uri: "{export_uri}"}}
""")
    proc = ExporterProcess(config, tmp_path / "exporter.log")
    proc.start()
    return proc, export_uri


async def test_exporter_writes_loadable_versions(tmp_path, nats_url, store_cfg):
    run = f"exp{uuid.uuid4().hex[:8]}"
    torch.manual_seed(0)
    base_dir = tmp_path / "base"
    base = Qwen3ForCausalLM(MODEL).eval()
    base.save_pretrained(base_dir)
    proc, export_uri = start_exporter(tmp_path, nats_url, store_cfg, run, base_dir)
    bus = await Bus.connect(BusConfig(url=nats_url), run=run, service="tester")
    await bus.ensure_streams()
    store = open_store(store_cfg)
    spec = LoraSpec(rank=RANK, alpha=ALPHA, target_modules=TARGETS, base_model=str(base_dir))
    ids = torch.randint(0, MODEL.vocab_size, (2, 10), generator=torch.Generator().manual_seed(1))

    async def publish(version: int, tensors, layout: str, msg_id: str) -> None:
        ref = await asyncio.to_thread(
            store.put_bytes, f"{run}/adapters/v{version}/adapter_model.safetensors", adapter_io.to_bytes(tensors)
        )
        event = AdapterReady(
            run=run,
            trainer_epoch="e0",
            lora_name="default_lora",
            version=version,
            trainer_step=version,
            created_at=time.time(),
            lora=spec,
            payloads=[ObjectPayload(uri=ref.uri, bytes=ref.bytes, sha256=ref.sha256, layout=layout)],
        )
        await bus.publish(subjects.adapter_ready(run, version), event, msg_id=msg_id)

    async def check(version: int, source) -> tuple[ExportDone, int]:
        done, seq = await wait_export(bus, proc, version)
        assert (done.run, done.version, done.lora_name) == (run, version, "default_lora")
        assert done.uri == f"{export_uri}/v{version}"
        assert sorted(done.files) == sorted([adapter_io.CONFIG_NAME, adapter_io.WEIGHTS_NAME])
        directory = await asyncio.to_thread(fetch_dir, done, store_cfg, tmp_path / f"dl-{version}-{seq}")
        weights = (directory / adapter_io.WEIGHTS_NAME).read_bytes()
        assert (len(weights), adapter_io.sha256(weights)) == (done.bytes, done.sha256)
        loaded = PeftModel.from_pretrained(copy.deepcopy(base), directory).eval()
        torch.testing.assert_close(logits(loaded, ids), logits(source, ids), rtol=0, atol=1e-5)
        assert (logits(loaded, ids) - logits(base, ids)).abs().max() > 0.05
        return done, seq

    try:
        sources = {v: source_model(base, seed=v) for v in range(4)}
        for v in range(3):
            await publish(v, hf_tensors(sources[v]), "hf-peft", msg_id=f"adapter-v{v}")
        first = {v: await check(v, sources[v]) for v in range(3)}

        # The same event again as a new stream message (what a trainer retrying after the
        # dedup window, or a replayed stream, looks like), then a restart of the exporter:
        # nothing is rewritten or re-announced, and the durable resumes where it was.
        await publish(1, hf_tensors(sources[1]), "hf-peft", msg_id="adapter-v1-resent")
        deadline = time.monotonic() + 30
        while "already written, already announced" not in proc.log_text():
            assert proc.alive() and time.monotonic() < deadline, proc.log_text()[-4000:]
            await asyncio.sleep(0.1)
        proc.stop()
        assert proc.proc.returncode == 0, proc.log_text()[-4000:]
        proc.start()
        await publish(3, megatron_tensors(sources[3]), "megatron-bridge", msg_id="adapter-v3")
        await check(3, sources[3])
        for v in range(3):
            done, seq = await wait_export(bus, proc, v)
            assert (done, seq) == first[v], f"v{v} was announced again"
        assert "Traceback" not in proc.log_text(), proc.log_text()[-4000:]

        # the restarted process saw only v3
        m = proc.metrics()
        assert metric(m, f'lorabus_exporter_exports_total{{run="{run}"}}') == 1.0
        assert metric(m, f'lorabus_exporter_last_version{{run="{run}"}}') == 3.0
        assert metric(m, f'lorabus_exporter_export_seconds_count{{run="{run}"}}') == 1.0
        assert metric(m, f'lorabus_exporter_failures_total{{run="{run}",stage="convert"}}') == 0.0
    finally:
        proc.stop()
        await bus.close()


async def test_bad_payloads_are_dead_lettered_and_do_not_block(tmp_path, nats_url):
    run = f"exp{uuid.uuid4().hex[:8]}"
    store_cfg = StoreConfig(uri=f"file://{tmp_path}/store")
    base_dir = tmp_path / "base"
    torch.manual_seed(0)
    base = Qwen3ForCausalLM(MODEL).eval()
    base.save_pretrained(base_dir)
    proc, export_uri = start_exporter(tmp_path, nats_url, store_cfg, run, base_dir)
    bus = await Bus.connect(BusConfig(url=nats_url), run=run, service="tester")
    await bus.ensure_streams()
    store = open_store(store_cfg)
    spec = LoraSpec(rank=RANK, alpha=ALPHA, target_modules=TARGETS, base_model=str(base_dir))

    def ready_event(version: int) -> AdapterReady:
        return AdapterReady(
            run=run, trainer_epoch="e0", lora_name="default_lora", version=version, trainer_step=version,
            created_at=time.time(), lora=spec,
            payloads=[ObjectPayload(uri=f"file://{tmp_path}/store/{run}/adapters/v0/adapter_model.safetensors",
                                    bytes=1, sha256="0" * 64)],
        )  # fmt: skip

    async def publish(version, data: bytes, layout="hf-peft", sha256=None, again=""):
        ref = store.put_bytes(f"{run}/adapters/v{version}/adapter_model.safetensors", data)
        event = AdapterReady(
            run=run,
            trainer_epoch="e0",
            lora_name="default_lora",
            version=version,
            trainer_step=version,
            created_at=time.time(),
            lora=spec,
            payloads=[ObjectPayload(uri=ref.uri, bytes=ref.bytes, sha256=sha256 or ref.sha256, layout=layout)],
        )
        await bus.publish(subjects.adapter_ready(run, version), event, msg_id=f"adapter-v{version}{again}")

    try:
        good = hf_tensors(source_model(base, seed=2))
        await publish(0, adapter_io.to_bytes(good), sha256="0" * 64)  # swapped/corrupted object
        wrong = {
            "decoder.layers.0.mlp.linear_fc2.adapter.linear_in.weight": torch.zeros(RANK, 47),
            "decoder.layers.0.mlp.linear_fc2.adapter.linear_out.weight": torch.zeros(32, RANK),
        }
        await publish(1, adapter_io.to_bytes(wrong), layout="megatron-bridge")
        await publish(2, adapter_io.to_bytes(good))
        done, _ = await wait_export(bus, proc, 2)  # not held up by the failing two
        assert done.sha256 == adapter_io.sha256(adapter_io.to_bytes(good))

        stream = streams.DEADLETTER(run)
        deadline = time.monotonic() + 60
        while (await bus.js.stream_info(stream)).state.messages < 2:
            assert proc.alive() and time.monotonic() < deadline, proc.log_text()[-4000:]
            await asyncio.sleep(0.2)
        letters = [codec.decode((await bus.js.get_msg(stream, seq)).data, DeadLetter) for seq in (1, 2)]
        errors = {subjects.parse_adapter_ready(d.subject)[1]: d for d in letters}
        assert all(d.reason == "handler" and d.service == "exporter" for d in letters)
        assert "sha256" in errors[0].error
        assert "linear_fc2.adapter.linear_in.weight: shape [4, 47] does not match [r, 48]" in errors[1].error
        for v in (0, 1):
            with pytest.raises(nats.js.errors.NotFoundError):
                await bus.js.get_last_msg(streams.EXPORTS(run), subjects.export_done(run, v))

        m = proc.metrics()
        # corrupt: given up at once
        assert metric(m, f'lorabus_exporter_failures_total{{run="{run}",stage="fetch"}}') == 1.0
        assert metric(m, f'lorabus_exporter_failures_total{{run="{run}",stage="convert"}}') == 5.0
        assert metric(m, f'lorabus_exporter_exports_total{{run="{run}"}}') == 1.0

        # Issue 17: exports are write-once (v2 re-announced with other weights must not
        # overwrite export/v2), only the run's trainer epoch is exported, no version jumps,
        # and no object outside the run's store is read (`file:///etc/passwd`).
        other = adapter_io.to_bytes(hf_tensors(source_model(base, seed=3)))
        await publish(2, other, again="-again")
        forged = msgspec.structs.replace(ready_event(3), trainer_epoch="forger")
        jump = ready_event(1_000_000)
        passwd = msgspec.structs.replace(
            ready_event(3), payloads=[ObjectPayload(uri="file:///etc/passwd", bytes=10, sha256="0" * 64)]
        )
        for event in (forged, jump, passwd):
            await bus.publish(
                subjects.adapter_ready(run, event.version), event, msg_id=f"bad-{event.version}-{id(event)}"
            )
        while (await bus.js.stream_info(stream)).state.messages < 6:
            assert proc.alive() and time.monotonic() < deadline + 60, proc.log_text()[-4000:]
            await asyncio.sleep(0.2)
        later = [codec.decode((await bus.js.get_msg(stream, seq)).data, DeadLetter) for seq in (3, 4, 5, 6)]
        text = " | ".join(d.error for d in later)
        assert "write-once" in text and "trainer_epoch" in text and "jumps more than" in text, text
        assert "outside" in text or "run's store" in text, text
        assert "root:" not in text  # nothing of /etc/passwd was read into a letter
        weights = (Path(export_uri[len("file://") :]) / "v2" / adapter_io.WEIGHTS_NAME).read_bytes()
        assert adapter_io.sha256(weights) == done.sha256  # export/v2 kept its first weights
        assert proc.alive()
    finally:
        proc.stop()
        await bus.close()
