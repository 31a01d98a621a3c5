"""Adapter propagation: "trainer has the new adapter in memory" -> "every replica serves it".

    python benchmarks/propagation.py [--quick] [--out benchmarks/results/propagation.json]

One run on this machine with the real nats-server and the real S3 server (`weed mini`):
adapters of ~4 MB (Qwen2.5-0.5B r=4), 37 MB (Qwen2.5-1.5B r=16, the issue's 18.5 M params)
and ~148 MB (Qwen2.5-1.5B r=64), all-linear, bf16; 1, 2, 4, 8 replicas. A replica is a process
holding a preallocated slot buffer of the adapter's shape; "serves it" = the replica has the
version's AdapterReady event and the version's tensors are in its slot: copied into that
buffer (the embedded engine's in-place slot copy; the head re-merge, a GEMM per module on the
GPU, is timed by gpu_xccl_single.py), or, on the XCCL paths but xccl_copy, the receiver's
staging set the version landed in adopted as the slot (`XcclReceiver.adopt`: a slot store
that holds the tensors as they arrive, no copy; the previous version's set is released to the
receiver), acked on NATS. That is the moment it can serve a request naming
version N: no request names N before the event (the registry grants from events), and the
XCCL replicas hold the staged bytes earlier, at the end of the broadcast.

Paths (all through the real proto events on the real nats-server):
  s3      lorabus object path: safetensors bytes -> S3 put -> AdapterReady -> N gets (sha256
          verified) -> parse -> slot copy
  local   the same through the local-directory store
  xccl    lorabus XCCL path as the trainer runs it: the trainer's adapter_state writes the
          version into the sender's free send set (`fill_views`; here that cast is a copy of
          the same bytes before t0, where the trainer's own cast happens), then
          `publish.deliver`: header + bucket broadcast (XcclSender -> XcclReceiver over gloo)
          beside the `announced` marker, the event, and behind it the durable copy to the
          local directory store, started when the replicas released the version (the next
          rep waits for it). Replicas adopt the staged set as the slot when the event
          arrives, ack, then release the previous version's set
  xccl_copy  the same, but the replicas copy the staged views into their preallocated slot
          and release the set at once (the embedded engine's way: its slots are stacked for
          its fused correction)
  xccl_eager  the same with the durable copy started at once (no wait for the release)
  xccl_pack   the same with the trainer's tensors packed into the send set after t0 (the
          reference path: a resumed checkpoint, the Megatron engine)
  xccl_only  the broadcast (from the filled send set) and the event alone, no durable copy
  peft    AReaL-style: peft save_pretrained to a shared directory, each replica peft
          load_adapter + set_adapter + delete_adapter of the previous one. peft needs a model to
          load into and the real base models are 3-6 GB per process (x8 on 2 cores): each
          replica's base is one Linear(16, in+out-16) per LoRA module, which makes every LoRA
          tensor pair exactly as many bytes as the real model's (only the shapes differ)
Floors, same run, same bytes:
  s3_raw     one put + N gets of the same number of bytes (no parse, no verify, no copy)
  gloo_bare  one flat buffer broadcast over a bare gloo group (same processes)
Reported: median of the repetitions (`--rounds`: the paths are taken in turn that many times,
so load from other jobs falls on all of them alike); ratios s3/s3_raw, xccl*/gloo_bare; the
trainer's own cost (until its part is done) and its 8-vs-1 replica ratio; for the xccl paths
the sender's stages and a per-version timeline (ms after t0 on the one host clock: event
published, and the slowest replica's header, buckets received, staged, event arrived, taken,
copied into its slot; the driver's last ack).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch

from services.trainer.xccl_sender import SETS as SEND_SETS

ACK = "bench.ack"
XCCL_PATHS = ("xccl", "xccl_copy", "xccl_eager", "xccl_pack", "xccl_only")
CMD = "bench.cmd.{}"
EVENT = "bench.adapter"

QWEN = {  # hidden, intermediate, layers, kv dim
    "0.5B": (896, 4864, 24, 128),
    "1.5B": (1536, 8960, 28, 256),
}
SIZES = {"4MB": ("0.5B", 4), "37MB": ("1.5B", 16), "148MB": ("1.5B", 64)}


def lora_modules(model: str) -> list[tuple[str, int, int]]:
    h, inter, layers, kv = QWEN[model]
    shapes = {
        "self_attn.q_proj": (h, h),
        "self_attn.k_proj": (h, kv),
        "self_attn.v_proj": (h, kv),
        "self_attn.o_proj": (h, h),
        "mlp.gate_proj": (h, inter),
        "mlp.up_proj": (h, inter),
        "mlp.down_proj": (inter, h),
    }
    return [(f"model.layers.{i}.{m}", a, b) for i in range(layers) for m, (a, b) in shapes.items()]


def manifest_for(size: str) -> list[list]:
    model, r = SIZES[size]
    out = []
    for path, i, o in lora_modules(model):
        out.append([f"base_model.model.{path}.lora_A.weight", [r, i], "bfloat16"])
        out.append([f"base_model.model.{path}.lora_B.weight", [o, r], "bfloat16"])
    return sorted(out)


def make_tensors(manifest, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s, _ in manifest}


def small_peft_base(size: str):
    """One Linear(16, in+out-16) per LoRA module: LoRA tensors of the real byte count."""
    from torch import nn

    model, _ = SIZES[size]
    base = nn.Module()
    base.mods = nn.ModuleDict(
        {
            f"m{j}": nn.Linear(16, i + o - 16, bias=False, dtype=torch.bfloat16)
            for j, (_, i, o) in enumerate(lora_modules(model))
        }
    )
    return base, [f"m{j}" for j in range(len(base.mods))]


def peft_wrap(size: str):
    from peft import LoraConfig, get_peft_model

    base, targets = small_peft_base(size)
    r = SIZES[size][1]
    return get_peft_model(base, LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, init_lora_weights=False))


# --- replica process ------------------------------------------------------------------------


async def replica_main(index: int, nats_url: str) -> None:
    import nats

    from proto import codec
    from proto.messages import AdapterReady
    from services.common import adapter_io, xccl
    from services.common.store import open_store
    from services.config.schema import StoreConfig
    from services.rollout.xccl_receiver import XcclReceiver

    name = f"rep{index}"
    nc = await nats.connect(nats_url)
    loop = asyncio.get_running_loop()
    st: dict = {"slot": None, "rx": None, "peft": None, "store": None, "bare": None}

    def ack(tag, via="", stamps=None) -> None:
        payload = json.dumps({"replica": name, "tag": tag, "via": via, "stamps": stamps or {}}).encode()
        loop.call_soon_threadsafe(asyncio.ensure_future, nc.publish(ACK, payload))

    def copy_in(tensors) -> None:
        names = sorted(st["slot"])
        torch._foreach_copy_([st["slot"][n] for n in names], [tensors[n] for n in names])

    def on_event(ev: AdapterReady, arrived: float) -> None:
        if st["slot"] is None:
            return  # not in this cell
        xp = ev.xccl_payload()
        rx = st["rx"]
        if xp is not None and rx is not None:
            rx.observe(xp, ev.version)
            got = rx.take(ev.version, xp, wait_s=5.0)
            if got is not None:
                taken = time.monotonic()
                if st["adopt"]:  # the staged set is the version's slot now: no copy
                    st["slot"], previous, st["held"] = got, st["held"], ev.version
                else:
                    copy_in(got)
                copied = time.monotonic()
                # servable from here; the trainer's `released` hint and freeing a set follow,
                # as in the service
                ack(ev.version, "xccl", {**rx.stamps, "event": arrived, "taken": taken, "copied": copied})
                if st["adopt"]:
                    rx.adopt(ev.version)
                    rx.release(previous)
                else:
                    rx.release(ev.version)
                return
            if xp.ranks and name in xp.ranks:
                print(f"{name}: v{ev.version} listed me but nothing staged", file=sys.stderr)
        if ev.object_payload() is None or st["store"] is None:
            return ack(ev.version, "none")
        obj = ev.object_payload()
        data = st["store"].get_bytes(obj.uri, sha256=obj.sha256, size=obj.bytes)
        copy_in(adapter_io.from_bytes(data))
        ack(ev.version, "object")

    def bare_loop(port: int, rank: int, world: int, nbytes: int, prefix: str) -> None:
        store = xccl.connect_store("127.0.0.1", port, 60)
        pg = xccl.new_group("gloo", store, prefix, rank, world, 60)
        buf = torch.zeros(nbytes, dtype=torch.uint8)  # pages touched, as a staging set's are once used
        st["bare"] = pg
        k = 0
        while True:
            try:
                pg.broadcast(buf, 0).wait()
            except Exception:
                return
            ack(f"bare{k}")
            k += 1

    def handle(cmd: dict) -> None:
        op = cmd["op"]
        if op == "setup":
            if st["rx"] is not None:
                st["rx"].close()
            st["slot"] = {n: torch.zeros(s, dtype=xccl.DTYPES[d]) for n, s, d in cmd["manifest"]}
            st["rx"] = XcclReceiver(name, timeout_s=60) if cmd.get("xccl") else None
            st["adopt"], st["held"] = bool(cmd.get("adopt")), -1
            st["store"] = open_store(StoreConfig(**cmd["store"])) if cmd.get("store") else None
            st["peft"] = peft_wrap(cmd["size"]) if cmd.get("peft") else None
            st["peft_prev"] = None
            ack("setup")
        elif op == "idle":
            if st["rx"] is not None:
                st["rx"].close()
            st.update(slot=None, rx=None, peft=None, store=None)
            ack("idle")
        elif op == "raw":
            st["store"].get_bytes(cmd["uri"])
            ack(cmd["ack_tag"])
        elif op == "peft":
            model, adapter = st["peft"], f"v{cmd['version']}"
            model.load_adapter(cmd["dir"], adapter_name=adapter)
            model.set_adapter(adapter)
            if st["peft_prev"]:
                model.delete_adapter(st["peft_prev"])
            st["peft_prev"] = adapter
            ack(cmd["ack_tag"])
        elif op == "bare":
            import threading

            threading.Thread(
                target=bare_loop,
                args=(cmd["port"], cmd["rank"], cmd["world"], cmd["nbytes"], cmd["prefix"]),
                daemon=True,
            ).start()
            ack("bare-ready")
        elif op == "bare_end":
            box, st["bare"] = [st["bare"]], None
            xccl.abort_group(box)
            ack("bare-end")
        elif op == "exit":
            os._exit(0)

    work = asyncio.Lock()

    async def on_cmd(msg) -> None:
        async with work:
            await asyncio.to_thread(handle, json.loads(msg.data))

    async def on_adapter(msg) -> None:
        arrived = time.monotonic()
        ev = codec.decode(msg.data, AdapterReady)
        async with work:
            await asyncio.to_thread(on_event, ev, arrived)

    await nc.subscribe(CMD.format(index), cb=on_cmd)
    await nc.subscribe(EVENT, cb=on_adapter)
    await nc.flush()
    ack("hello")
    await asyncio.Event().wait()


# --- the trainer side / driver --------------------------------------------------------------


class Acks:
    def __init__(self):
        self.got: dict[str, dict[str, tuple[float, str]]] = {}
        self.extras: dict[str, list[dict]] = {}
        """each ack's whole message, by tag (the vLLM sidecars report their timings in it)"""
        self.event = asyncio.Event()

    async def on(self, msg) -> None:
        d = json.loads(msg.data)
        self.got.setdefault(str(d["tag"]), {})[d["replica"]] = (time.perf_counter(), d.get("via", ""))
        self.extras.setdefault(str(d["tag"]), []).append(d)
        self.event.set()

    async def wait(self, tag, n: int, timeout: float = 120.0) -> tuple[float, list[str]]:
        tag = str(tag)
        deadline = time.monotonic() + timeout
        while len(self.got.get(tag, {})) < n:
            self.event.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"ack {tag}: {len(self.got.get(tag, {}))}/{n}")
            try:
                await asyncio.wait_for(self.event.wait(), left)
            except TimeoutError:
                pass
        vals = self.got.pop(tag).values()
        return max(t for t, _ in vals), sorted({v for _, v in vals})


async def run_bench(args) -> dict:
    import nats

    from benchmarks import workers
    from benchmarks.adapters import adapter_event
    from proto import codec
    from proto.messages import LoraSpec
    from services.common import adapter_io, xccl
    from services.common.store import open_store
    from services.config.schema import StoreConfig
    from services.local.nats_server import start_nats_server
    from services.local.s3_server import start_weed_s3
    from services.trainer.publish import build_payloads, deliver

    work = Path(tempfile.mkdtemp(prefix="lorabus-prop-"))
    nats_srv = start_nats_server(work / "nats")
    s3 = start_weed_s3(work / "weed", die_with_parent=True)
    os.environ["LORABUS_S3_ACCESS_KEY"] = s3.admin.access_key
    os.environ["LORABUS_S3_SECRET_KEY"] = s3.admin.secret_key
    s3_cfg = {"uri": f"s3://prop-{uuid.uuid4().hex[:8]}/bench", "endpoint": s3.endpoint}
    local_cfg = {"uri": f"file://{work / 'store'}"}
    s3_store, local_store = open_store(StoreConfig(**s3_cfg)), open_store(StoreConfig(**local_cfg))
    nc = await nats.connect(nats_srv.url)
    acks = Acks()
    await nc.subscribe(ACK, cb=acks.on)
    if args.vllm:
        from benchmarks import propagation_servers

        try:
            rows = await propagation_servers.run_vllm_cells(args, nats_srv.url, s3_cfg, local_cfg, acks)
        finally:
            await nc.close()
            s3.stop()
            nats_srv.stop()
            shutil.rmtree(work, ignore_errors=True)
        return {"rows": rows, "summary": propagation_servers.summarize(rows)}
    n_max = max(args.replicas)
    procs = [
        workers.spawn([__file__, "--replica", str(i), "--nats", nats_srv.url], work / f"rep{i}.log")
        for i in range(n_max)
    ]
    results: list[dict] = []
    try:
        await acks.wait("hello", n_max, timeout=180)

        async def cmd(reps, tag=None, **c) -> float:
            for i in reps:
                await nc.publish(CMD.format(i), json.dumps(c).encode())
            if tag is not None:
                return (await acks.wait(tag, len(reps)))[0]
            return 0.0

        version = 0
        for size in args.sizes:
            manifest = manifest_for(size)
            tensors = make_tensors(manifest, 1)
            nbytes = len(adapter_io.to_bytes(tensors))
            raw = os.urandom(nbytes)
            lora = LoraSpec(
                rank=SIZES[size][1],
                alpha=2.0 * SIZES[size][1],
                target_modules=["all-linear"],
                dtype="bfloat16",
                base_model=f"Qwen2.5-{SIZES[size][0]}-shaped",
            )
            reps_n = args.reps if size != "148MB" else max(1, args.reps - 1)
            trainer_peft = peft_wrap(size) if "peft" in args.paths else None
            for n in args.replicas:
                active = list(range(n))
                bench_paths = list(args.paths)
                for _round in range(args.rounds):  # paths taken in turn: load drifts alike
                    for path in bench_paths + ["s3_raw", "gloo_bare"]:
                        store_cfg = {
                            "s3": s3_cfg,
                            "s3_raw": s3_cfg,
                            "local": local_cfg,
                            "xccl": local_cfg,
                            "xccl_copy": local_cfg,
                            "xccl_eager": local_cfg,
                            "xccl_pack": local_cfg,
                            "xccl_only": local_cfg,
                        }.get(path)
                        idle = [i for i in range(n_max) if i not in active]
                        if idle:
                            await cmd(idle, "idle", op="idle")
                        await cmd(
                            active,
                            "setup",
                            op="setup",
                            manifest=manifest,
                            size=size,
                            store=store_cfg,
                            xccl=path.startswith("xccl"),
                            adopt=path.startswith("xccl") and path != "xccl_copy",
                            peft=path == "peft",
                        )
                        times, trainer, vias, sends = [], [], set(), []
                        sender = None
                        if path in XCCL_PATHS:
                            sender = workers.gloo_sender(args.bucket_mb, 0.0 if path == "xccl_eager" else None)
                        if path == "gloo_bare":
                            bstore = xccl.host_store("127.0.0.1", 0, 60)
                            prefix = uuid.uuid4().hex[:6]
                            for i in active:
                                await nc.publish(
                                    CMD.format(i),
                                    json.dumps(
                                        {
                                            "op": "bare",
                                            "port": bstore.port,
                                            "rank": i + 1,
                                            "world": n + 1,
                                            "nbytes": nbytes,
                                            "prefix": prefix,
                                        }
                                    ).encode(),
                                )
                            await acks.wait("bare-ready", n)
                            pg = await asyncio.to_thread(xccl.new_group, "gloo", bstore, prefix, 0, n + 1, 60)
                            # real bytes in touched pages, as the trainer's send sets hold: an
                            # untouched buffer reads as the kernel's one zero page, which makes
                            # the floor faster than moving 37 MB from memory
                            flat = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
                        # cold, so not timed: the first put into a bucket, the first peft load,
                        # and on XCCL paths the first version through each send set after the
                        # group forms (gloo's first use of a buffer: 10-30 ms here, paid once
                        # per formation, not per version)
                        warm = SEND_SETS if path in XCCL_PATHS else 1
                        stages: list[dict[str, float]] = []
                        for rep in range(warm + reps_n):
                            version += 1
                            tag = version
                            src: Mapping[str, torch.Tensor] = tensors
                            if sender is not None and path != "xccl_pack" and (fill := sender.fill_views()) is not None:
                                # the trainer's adapter_state(into=fill_views()): its cast lands in
                                # the send set instead of new tensors (the same one pass), t0 after
                                xccl.pack_views(fill, tensors)
                                src = fill
                            published = [0.0]
                            t0 = time.perf_counter()
                            t0m = time.monotonic()
                            if path in ("s3", "local"):
                                store = s3_store if path == "s3" else local_store
                                data = adapter_io.to_bytes(tensors)
                                ref = await asyncio.to_thread(
                                    store.put_bytes, f"bench/v{version}/adapter_model.safetensors", data
                                )
                                ev = adapter_event(version, lora, build_payloads(ref))
                                await nc.publish(EVENT, codec.encode(ev))
                            elif path in XCCL_PATHS:
                                assert sender is not None  # made above for every XCCL path

                                def durable():
                                    return local_store.put_bytes(
                                        f"bench/v{version}/adapter_model.safetensors", adapter_io.to_bytes(tensors)
                                    )

                                if rep == 0:  # the handle the replicas join from (bench warm-up)
                                    ref = await asyncio.to_thread(durable)
                                    h = sender.handle(xccl.manifest_of(tensors), {})
                                    ev = adapter_event(version, lora, build_payloads(ref, h))
                                    await nc.publish(EVENT, codec.encode(ev))
                                    await acks.wait(tag, n)
                                    await workers.joined(sender, n)
                                    version += 1
                                    tag = version
                                    t0 = time.perf_counter()
                                    t0m = time.monotonic()
                                if path != "xccl_only":  # the trainer's own order (publish.deliver)

                                    async def publish(payloads, v=version):
                                        ev = adapter_event(v, lora, payloads)
                                        await nc.publish(EVENT, codec.encode(ev))
                                        published[0] = time.monotonic()

                                    await deliver(
                                        local_store,
                                        run="bench",
                                        version=version,
                                        tensors=src,
                                        publish=publish,
                                        sender=sender,
                                    )
                                else:  # the broadcast alone, no serialising or durable copy at all
                                    xp = await asyncio.to_thread(sender.send, version, src)
                                    ev = adapter_event(version, lora, build_payloads(ref, xp))
                                    await nc.publish(EVENT, codec.encode(ev))
                                    published[0] = time.monotonic()
                            elif path == "peft":
                                d = work / "peft" / f"v{version}"
                                await asyncio.to_thread(trainer_peft.save_pretrained, str(d))
                                await cmd(active, None, op="peft", dir=str(d), version=version, ack_tag=tag)
                            elif path == "s3_raw":
                                ref = await asyncio.to_thread(s3_store.put_bytes, f"raw/v{version}", raw)
                                await cmd(active, None, op="raw", uri=ref.uri, ack_tag=tag)
                            elif path == "gloo_bare":
                                tag = f"bare{rep}"
                                await asyncio.to_thread(lambda: pg.broadcast(flat, 0).wait())
                            t_trainer = time.perf_counter() - t0
                            t_end, via = await acks.wait(tag, n)
                            t_end_m = time.monotonic() - (time.perf_counter() - t_end)
                            extras = acks.extras.pop(str(tag), [])
                            await workers.settled(sender)
                            vias.update(via)
                            if rep >= warm:
                                times.append(t_end - t0)
                                trainer.append(t_trainer)
                                if sender is not None:
                                    st = sender.stats
                                    sends.append(
                                        {
                                            "form_s": st.form_s,
                                            "pack_s": st.pack_s,
                                            "header_s": st.header_s,
                                            "buckets_s": st.buckets_s,
                                            "flag_s": st.flag_s,
                                            "broadcast_s": st.broadcast_s,
                                        }
                                    )
                                    stages.append(stage_stamps(t0m, published[0], extras, t_end_m))
                        if sender is not None:
                            sender.close()
                        if path == "gloo_bare":
                            box, pg = [pg], None
                            xccl.abort_group(box)
                            await cmd(active, "bare-end", op="bare_end")
                        row = {
                            "size": size,
                            "bytes": nbytes,
                            "replicas": n,
                            "path": path,
                            "median_s": statistics.median(times),
                            "min_s": min(times),
                            "trainer_s": statistics.median(trainer),
                            "reps": len(times),
                            "via": sorted(vias),
                            "samples": {"times_s": times, "trainer_s": trainer, "send_s": sends, "stages_ms": stages},
                        }
                        if sends:  # the sender's own share: pack, header + buckets + flag
                            row["send_s"] = {k: statistics.median(x[k] for x in sends) for k in sends[0]}
                            row["stages_ms"] = {k: statistics.median(x[k] for x in stages) for k in stages[0]}
                        results.append(row)
                        print(
                            f"{size:>6} n={n} {path:<9} {row['median_s'] * 1e3:8.1f} ms  trainer "
                            f"{row['trainer_s'] * 1e3:7.1f} ms  via {row['via']}  "
                            f"{ {k: round(v * 1e3, 1) for k, v in row.get('send_s', {}).items()} or '' }",
                            flush=True,
                        )
                        if "stages_ms" in row:
                            print(f"{'':>17} stages (ms after t0, slowest replica): {row['stages_ms']}", flush=True)
    finally:
        await workers.stop(nc, CMD, procs)
        s3.stop()
        nats_srv.stop()
        # every xccl version leaves a 37 MB durable copy there: GBs per run on a shared disk
        shutil.rmtree(work, ignore_errors=True)
    results = pooled(results)
    return {"rows": results, "summary": summarize(results)}


def pooled(rows: list[dict]) -> list[dict]:
    """One row per (size, replicas, path): the samples of every round together."""
    by: dict[tuple, list[dict]] = {}
    for r in rows:
        by.setdefault((r["size"], r["replicas"], r["path"]), []).append(r)
    out = []
    for parts in by.values():
        sm = {k: [x for p in parts for x in p["samples"][k]] for k in parts[0]["samples"]}
        row = {**parts[0], "samples": sm, "rounds": len(parts), "reps": len(sm["times_s"])}
        row.update(
            median_s=statistics.median(sm["times_s"]),
            min_s=min(sm["times_s"]),
            trainer_s=statistics.median(sm["trainer_s"]),
            via=sorted({v for p in parts for v in p["via"]}),
        )
        for key in ("send_s", "stages_ms"):
            if sm[key]:
                row[key] = {k: statistics.median(x[k] for x in sm[key]) for k in sm[key][0]}
        out.append(row)
    return out


def stage_stamps(t0: float, published: float, extras: list[dict], end: float) -> dict[str, float]:
    """One version's timeline in ms after t0 (time.monotonic, one clock for every process on
    the host): the event's publish on the trainer and, per stage, the slowest replica's
    stamp (header received, buckets received, staged, event arrived, taken, copied into its
    slot), then the last ack at the driver."""
    out = {"published": (published - t0) * 1e3}
    for key in ("header", "received", "staged", "event", "taken", "copied"):
        got = [x["stamps"][key] for x in extras if key in x.get("stamps", {})]
        if got:
            out[key] = (max(got) - t0) * 1e3
    out["acked"] = (end - t0) * 1e3
    return out


def summarize(rows: list[dict]) -> list[dict]:
    by = {(r["size"], r["replicas"], r["path"]): r for r in rows}
    out = []
    for (size, n, path), r in by.items():
        if path not in ("s3", "local", *XCCL_PATHS, "peft"):
            continue
        floor = by.get((size, n, "gloo_bare" if path.startswith("xccl") else "s3_raw"))
        one = by.get((size, 1, path))
        out.append(
            {
                "size": size,
                "replicas": n,
                "path": path,
                "median_s": r["median_s"],
                "floor": floor["path"] if floor else None,
                "ratio_to_floor": r["median_s"] / floor["median_s"] if floor else None,
                "trainer_ratio_vs_1": r["trainer_s"] / one["trainer_s"] if one else None,
                "floor_trainer_ratio_vs_1": (
                    floor["trainer_s"] / floor_one["trainer_s"]
                    if floor and (floor_one := by.get((size, 1, floor["path"])))
                    else None
                ),
            }
        )
    return out


def print_table(summary: list[dict]) -> None:
    print(
        f"\n{'size':>6} {'n':>2} {'path':<9} {'time ms':>9} {'floor':<9} {'x floor':>7} {'trainer xN/x1':>13}"
        f" {'floor xN/x1':>11}"
    )
    for s in summary:
        print(
            f"{s['size']:>6} {s['replicas']:>2} {s['path']:<9} {s['median_s'] * 1e3:9.1f} "
            f"{s['floor'] or '-':<9} {s['ratio_to_floor'] or 0:7.2f} {s['trainer_ratio_vs_1'] or 0:13.2f}"
            f" {s['floor_trainer_ratio_vs_1'] or 0:11.2f}"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4MB+37MB, 1/2/4 replicas... (CI smoke)")
    ap.add_argument("--sizes", nargs="*", default=None, choices=list(SIZES))
    ap.add_argument("--replicas", nargs="*", type=int, default=None)
    ap.add_argument("--paths", nargs="*", default=["s3", "local", "xccl", "xccl_only", "peft"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1, help="take the paths in turn this many times, reps each")
    ap.add_argument("--bucket-mb", type=float, default=64.0)
    ap.add_argument("--vllm", action="store_true", help="the vLLM server cells only (propagation_servers.py)")
    ap.add_argument("--out", default=None, help="default: benchmarks/results/propagation[_vllm].json")
    ap.add_argument("--replica", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--nats", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.replica is not None:
        torch.set_num_threads(1)
        asyncio.run(replica_main(args.replica, args.nats))
        return 0
    if args.quick:
        args.sizes = args.sizes or ["4MB", "37MB"]
        args.replicas = args.replicas or [1, 8]
        args.reps = 2
    if args.vllm:
        args.sizes, args.replicas, args.paths = ["37MB"], args.replicas or [1, 2], []
    args.sizes = args.sizes or list(SIZES)
    args.replicas = args.replicas or [1, 2, 4, 8]
    args.out = args.out or str(ROOT / f"benchmarks/results/propagation{'_vllm' if args.vllm else ''}.json")
    t0 = time.time()
    load_before = os.getloadavg()
    out = asyncio.run(run_bench(args))
    out["config"] = {
        "sizes": args.sizes,
        "replicas": args.replicas,
        "paths": args.paths,
        "reps": args.reps,
        "rounds": args.rounds,
        "bucket_mb": args.bucket_mb,
        "wall_s": time.time() - t0,
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "load_avg_before": load_before,  # 1/5/15 min: other jobs share these cores
        "load_avg_after": os.getloadavg(),
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    if args.vllm:
        from benchmarks import propagation_servers

        propagation_servers.print_table(out["summary"])
    else:
        print_table(out["summary"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"\nwrote {args.out} ({out['config']['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
