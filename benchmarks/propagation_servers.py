"""The vLLM cells of benchmarks/propagation.py: "trainer has the adapter in memory" -> "every
vLLM server serves it" (its `/v1/load_lora_adapter` answered), real vLLM CPU servers.

    python benchmarks/propagation.py --vllm [--replicas 1 2] [--reps 3]

A 37 MB adapter needs a model with Qwen2.5-1.5B's module widths: a random-weight Llama with
hidden 1536, intermediate 8960, 12 heads / 2 KV heads of 128 (Qwen2.5-1.5B's shapes), 7 layers
instead of 28 and LoRA rank 64 instead of 16: rank x layers is the same, so the adapter is the
same 36.9 MB in the same tensor widths (fp32 server, bf16 adapter, as the trainer publishes).

Each server has a sidecar process doing what the rollout sidecar does (the real `VllmEngine`,
`XcclReceiver`, `durable.read`), and the trainer side is the real `publish.deliver`:
  vllm_object_s3     serialise -> S3 put -> event -> each sidecar: get + sha256 -> write the PEFT
                     directory -> load endpoint (lorabus's object path into vLLM)
  vllm_object_local  the same through the local-directory store
  vllm_xccl          broadcast (gloo) -> event -> each sidecar: take the staged buckets -> write
                     the directory (/dev/shm) -> load endpoint; the durable copy goes to S3 behind
                     the event (the next rep waits for it)
Every path writes the adapter directory under /dev/shm. Reported per cell: median end to end,
the sidecar's receive (fetch or take), its directory write, and the server's own load time (the
HTTP call to `/v1/load_lora_adapter`, measured in the sidecar), the slowest replica of each rep.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
LAYERS, RANK, HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 7, 64, 1536, 8960, 12, 2, 128
MODULES = {
    "self_attn.q_proj": (HIDDEN, HEADS * HEAD_DIM),
    "self_attn.k_proj": (HIDDEN, KV_HEADS * HEAD_DIM),
    "self_attn.v_proj": (HIDDEN, KV_HEADS * HEAD_DIM),
    "self_attn.o_proj": (HEADS * HEAD_DIM, HIDDEN),
    "mlp.gate_proj": (HIDDEN, INTER),
    "mlp.up_proj": (HIDDEN, INTER),
    "mlp.down_proj": (INTER, HIDDEN),
}
PATHS = ("vllm_object_s3", "vllm_object_local", "vllm_xccl")
ACK, CMD, EVENT = "bench.vllm.ack", "bench.vllm.cmd.{}", "bench.vllm.adapter"


def make_model(directory: Path) -> None:
    """A random-weight Llama of the shapes above, with the tiny example's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tiny = ROOT / "examples" / "tiny" / "model"
    config = LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        vocab_size=json.loads((tiny / "config.json").read_text())["vocab_size"],
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tiny / name, directory / name)


def adapter_tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(LAYERS):
        for module, (fan_in, fan_out) in MODULES.items():
            path = f"base_model.model.model.layers.{i}.{module}"
            out[f"{path}.lora_A.weight"] = (torch.randn(RANK, fan_in, generator=g) * 0.01).to(torch.bfloat16)
            out[f"{path}.lora_B.weight"] = (torch.randn(fan_out, RANK, generator=g) * 0.01).to(torch.bfloat16)
    return out


def bench_config(model_dir: Path, servers: int):
    from services.config.loader import config_from_dict

    return config_from_dict(
        {
            "gconfig": {"lora_name": "bench"},
            "actor": {"path": str(model_dir), "lora_rank": RANK, "lora_alpha": 2 * RANK},
            "rollout": {"engine": "vllm", "replicas": servers, "preload_v0": False, "max_head_offpolicyness": 1},
            "vllm": {
                "max_lora_rank": RANK,
                "max_loras": 2,
                "max_cpu_loras": 3,
                "dtype": "float32",
                "max_model_len": 128,
                "extra_args": ["--enforce-eager"],
            },
            "train_dataset": {"path": "builtin:arith"},
        }
    )


# --- the sidecar process ---------------------------------------------------------------------


async def sidecar_main(index: int, nats_url: str, url: str, adapter_dir: str) -> None:
    import nats

    from proto import codec
    from proto.messages import AdapterReady
    from services.common import durable, xccl
    from services.common.store import open_store
    from services.config.schema import StoreConfig
    from services.rollout.engines.http import AdapterDirs, Http
    from services.rollout.engines.vllm import VllmEngine
    from services.rollout.xccl_receiver import XcclReceiver

    name = f"sidecar{index}"
    nc = await nats.connect(nats_url)
    engine = VllmEngine([url], AdapterDirs(f"b{index}", adapter_dir), http=Http(timeout_s=300))
    post = engine.http.post
    server_s: list[float] = []

    async def timed_post(u, body, **kw):
        t0 = time.perf_counter()
        try:
            return await post(u, body, **kw)
        finally:
            if u.endswith("/v1/load_lora_adapter"):
                server_s.append(time.perf_counter() - t0)

    engine.http.post = timed_post  # type: ignore[method-assign]
    st: dict = {"rx": None, "store": None}

    async def ack(tag, **extra) -> None:
        await nc.publish(ACK, json.dumps({"replica": name, "tag": tag, **extra}).encode())

    async def on_event(ev: AdapterReady) -> None:
        t0 = time.perf_counter()
        weights, via, xp = None, "object", ev.xccl_payload()
        if xp is not None and st["rx"] is not None:
            st["rx"].observe(xp, ev.version)
            weights = await asyncio.to_thread(st["rx"].take, ev.version, xp, 5.0)
            via = "xccl" if weights is not None else via
        if weights is None:
            obj = ev.object_payload()
            weights = await asyncio.to_thread(
                xccl.fetch_when_stored, lambda: durable.read(st["store"], obj), what=obj.uri
            )
        t1 = time.perf_counter()
        server_s.clear()
        await engine.load_version(ev.version, weights, ev.lora)
        if via == "xccl":
            st["rx"].release(ev.version)
        t2 = time.perf_counter()
        await ack(ev.version, via=via, receive_s=t1 - t0, load_s=t2 - t1, server_s=sum(server_s))
        for old in [v for v in await engine.loaded_versions() if v != ev.version]:
            await engine.unload_version(old)  # untimed: keeps the server's LoRA cache small

    work = asyncio.Lock()

    async def on_cmd(msg) -> None:
        cmd = json.loads(msg.data)
        async with work:
            if cmd["op"] == "setup":
                if st["rx"] is not None:
                    st["rx"].close()
                st["rx"] = XcclReceiver(name, timeout_s=60) if cmd["xccl"] else None
                st["store"] = open_store(StoreConfig(**cmd["store"]))
                await ack("setup")
            elif cmd["op"] == "exit":
                await engine.close()
                os._exit(0)

    async def on_adapter(msg) -> None:
        async with work:
            try:
                await on_event(codec.decode(msg.data, AdapterReady))
            except Exception as exc:
                print(f"{name}: {exc!r}", file=sys.stderr, flush=True)

    await nc.subscribe(CMD.format(index), cb=on_cmd)
    await nc.subscribe(EVENT, cb=on_adapter)
    await nc.flush()
    await ack("hello")
    await asyncio.Event().wait()


# --- the driver ------------------------------------------------------------------------------


def start_servers(cfg, run_dir: Path) -> list[tuple[subprocess.Popen, str]]:
    from services.local import inference_servers
    from services.local.processes import die_with_parent

    python = inference_servers.vllm_python(None)
    out = []
    for plan in inference_servers.plan_vllm_servers(cfg, run_dir, python):
        log = open(run_dir / f"{plan.name}.log", "wb")
        proc = subprocess.Popen(
            plan.argv,
            env={**os.environ, **plan.env},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        out.append((proc, plan.url))
    return out


async def wait_healthy(servers, timeout_s: float = 600.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=2.0) as client:
        for proc, url in servers:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"vLLM server {url} exited with {proc.returncode}")
                try:
                    if (await client.get(f"{url}/health")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"vLLM server {url} not healthy after {timeout_s:.0f} s")
                await asyncio.sleep(1.0)


async def run_vllm_cells(args, nats_url: str, s3_cfg: dict, local_cfg: dict, acks) -> list[dict]:
    """One row per (servers, path); `acks` is propagation.Acks subscribed to ACK."""
    import nats

    from benchmarks import workers
    from benchmarks.adapters import adapter_event
    from proto import codec
    from proto.messages import LoraSpec
    from services.common import adapter_io, xccl
    from services.common.store import open_store
    from services.config.schema import StoreConfig
    from services.trainer.publish import deliver

    work = Path(tempfile.mkdtemp(prefix="lorabus-prop-vllm-"))
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else work
    adapter_root = shm / f"lorabus-bench-{uuid.uuid4().hex[:6]}"
    n_max = max(args.replicas)
    t_start = time.perf_counter()
    make_model(work / "model")
    cfg = bench_config(work / "model", n_max)
    print(f"vllm: model written in {time.perf_counter() - t_start:.0f} s; starting {n_max} servers", flush=True)
    servers = start_servers(cfg, work)
    nc = await nats.connect(nats_url)
    await nc.subscribe(ACK, cb=acks.on)
    sidecars = []
    rows: list[dict] = []
    try:
        await wait_healthy(servers)
        print(f"vllm: servers healthy after {time.perf_counter() - t_start:.0f} s", flush=True)
        for i, (_, url) in enumerate(servers):
            sidecars.append(
                workers.spawn([__file__, str(i), nats_url, url, str(adapter_root / f"s{i}")], work / f"sidecar{i}.log")
            )
        await acks.wait("hello", n_max, timeout=120)
        stores = {"s3": open_store(StoreConfig(**s3_cfg)), "local": open_store(StoreConfig(**local_cfg))}
        lora = LoraSpec(
            rank=RANK,
            alpha=2.0 * RANK,
            target_modules=sorted(m.split(".")[1] for m in MODULES),
            dtype="bfloat16",
            base_model=str(work / "model"),
        )
        tensors = adapter_tensors(1)
        nbytes = adapter_io.serialized_size(tensors)
        version = 0
        for n in args.replicas:
            active = list(range(n))
            for path in PATHS:
                store_name = "local" if path == "vllm_object_local" else "s3"
                store = stores[store_name]
                for i in active:
                    cmd = {
                        "op": "setup",
                        "xccl": path == "vllm_xccl",
                        "store": s3_cfg if store_name == "s3" else local_cfg,
                    }
                    await nc.publish(CMD.format(i), json.dumps(cmd).encode())
                await acks.wait("setup", n)
                sender = None
                if path == "vllm_xccl":
                    sender = workers.gloo_sender(64)
                run = f"bench{uuid.uuid4().hex[:6]}"
                times, extras, vias = [], [], set()
                for rep in range(1 + args.reps):  # rep 0 warms (and, for xccl, lets the sidecars join)
                    version += 1
                    active_sender = sender if rep > 0 else None

                    async def publish(payloads, v=version):
                        if sender is not None and len(payloads) == 1:  # the warm-up names the group to join
                            payloads = [payloads[0], sender.handle(xccl.manifest_of(tensors), {})]
                        await nc.publish(EVENT, codec.encode(adapter_event(v, lora, payloads)))

                    t0 = time.perf_counter()
                    await deliver(
                        store, run=run, version=version, tensors=tensors, publish=publish, sender=active_sender
                    )
                    t_end, via = await acks.wait(version, n, timeout=300)
                    got = acks.extras.pop(str(version), [])
                    await workers.settled(sender)
                    if rep == 0:
                        if sender is not None:
                            await workers.joined(sender, n)
                        continue
                    times.append(t_end - t0)
                    vias.update(via)
                    extras.append({k: max(e[k] for e in got) for k in ("receive_s", "load_s", "server_s")})
                if sender is not None:
                    sender.close()
                row = {
                    "size": "37MB",
                    "bytes": nbytes,
                    "replicas": n,
                    "path": path,
                    "median_s": statistics.median(times),
                    "min_s": min(times),
                    "reps": len(times),
                    "via": sorted(vias),
                    **{f"{k}_median": statistics.median(e[k] for e in extras) for k in extras[0]},
                }
                rows.append(row)
                print(
                    f"  37MB n={n} {path:<17} {row['median_s'] * 1e3:8.1f} ms  receive "
                    f"{row['receive_s_median'] * 1e3:7.1f}  write+load {row['load_s_median'] * 1e3:7.1f}  "
                    f"server load {row['server_s_median'] * 1e3:7.1f} ms  via {row['via']}",
                    flush=True,
                )
    finally:
        await workers.stop(nc, CMD, sidecars)
        for proc, _ in servers:
            try:
                os.killpg(proc.pid, 15)
                proc.wait(30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(proc.pid, 9)
        shutil.rmtree(adapter_root, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    by = {(r["replicas"], r["path"]): r for r in rows if r["path"] in PATHS}
    out = []
    for (n, path), r in sorted(by.items()):
        obj = by.get((n, "vllm_object_s3"))
        out.append(
            {
                "replicas": n,
                "path": path,
                "median_s": r["median_s"],
                "server_load_s": r["server_s_median"],
                "ratio_to_object_s3": r["median_s"] / obj["median_s"] if obj else None,
                "ratio_to_object_local": (
                    r["median_s"] / loc["median_s"] if (loc := by.get((n, "vllm_object_local"))) else None
                ),
            }
        )
    return out


def print_table(summary: list[dict]) -> None:
    print(f"\n{'n':>2} {'path':<17} {'time ms':>9} {'server load ms':>14} {'x object_s3':>11} {'x object_local':>14}")
    for s in summary:
        print(
            f"{s['replicas']:>2} {s['path']:<17} {s['median_s'] * 1e3:9.1f} {s['server_load_s'] * 1e3:14.1f} "
            f"{s['ratio_to_object_s3'] or 0:11.2f} {s['ratio_to_object_local'] or 0:14.2f}"
        )


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    torch.set_num_threads(1)
    asyncio.run(sidecar_main(int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]))
