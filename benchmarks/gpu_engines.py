"""The rollout engines side by side in one run: embedded, vLLM server, SGLang server.

    python benchmarks/gpu_engines.py --out-dir benchmarks/results            # CUDA, Qwen2.5-1.5B shape
    python benchmarks/gpu_engines.py --tiny --out-dir /tmp/ge                # CPU: tiny model, vLLM CPU build
    python benchmarks/gpu_engines.py --out-dir R --vllm-site /tmp/vsite --sglang-site /tmp/ssite   # all three

All three engines run by default, one after the other in one call (the H200's call sequence
that stages the carried sites is in benchmarks/device/sites.sh). Each server's PYTHONPATH holds
its own engine's site and not the other's (`--vllm-site`/`--sglang-site`: the two pin different
transformers), so both can be staged on one machine.

Every engine runs through the class the rollout service drives (`EmbeddedEngine`, `VllmEngine`,
`SglangEngine`), on one model directory (random weights of the shape, `benchmarks/shapes.py`),
with the same prompts, sampling (T = 1, no top-p/top-k, seeded) and adapters (LoRA r16 on all
linear layers). A server is started by the project's own command line
(`services.rollout.server_cmd`) with the settings `--vllm-arg`/`--sglang-arg` add, one engine at a
time so that each has the GPU to itself. Per engine:

  startup_s         process start (server) or model load (embedded) -> ready to load a version
  load_ms           `load_version` from adapter bytes on this host -> servable (p50 of the loads)
  event_to_token_ms the same plus a one-token request under the new version: "event -> first
                    token, bytes local"
  object_to_token_ms  the object path: local-directory store read with its sha256 check, load,
                    one token
  tokens_per_s      batch B x prompt P x N new tokens, best of R, for
                      base     no adapter (the LoRA-enabled engine's base rows)
                      head     every row on the newest version
                      mixed25  25 % of rows one version older
                      mixed3   50 % head, 25 % each on the two versions before it
                    and each as a ratio of the engine's own base
  peak_gpu_mib      the engine's process, from nvidia-smi (a server preallocates its cache)

Writes gpu_engines.json and prints a table; `--label` names the file (gpu_engines_<label>.json).
"""

from __future__ import annotations

import argparse
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
from collections.abc import Awaitable, Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.adapters import random_lora
from benchmarks.shapes import write_model_dir
from proto.messages import LoraSpec, ObjectPayload
from services.common import adapter_io, durable
from services.common.lora_targets import HF_LINEAR
from services.common.store import LocalStore
from services.local.inference_servers import log_tail
from services.rollout.engines.base import GenRequest

VERSIONS = 6
"""versions loaded in turn (the keep window is 4): load figures are the p50 of the last four"""
KEEP = 4
CASES = ("base", "head", "mixed25", "mixed3")
RANK, ALPHA = 16, 32.0


def tiny_model_dir(directory: Path) -> Path:
    """The tiny task's own model (CPU runs): byte-level tokenizer, 2 layers."""
    if not (directory / "config.json").exists():
        shutil.copytree(REPO / "examples" / "tiny" / "model", directory, dirs_exist_ok=True)
    return directory


def requests(batch: int, prompt_len: int, new_tokens: int, vocab: int) -> list[GenRequest]:
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, vocab, (batch, prompt_len), generator=g).tolist()
    return [
        GenRequest(prompt_token_ids=p, max_new_tokens=new_tokens, temperature=1.0, seed=i)
        for i, p in enumerate(prompts)
    ]


def case_versions(case: str, batch: int, head: int) -> list[int | None]:
    """Each row's version for a case (None: the base model)."""
    q = batch // 4
    if case == "base":
        return [None] * batch
    if case == "head":
        return [head] * batch
    if case == "mixed25":
        return [head - 1] * q + [head] * (batch - q)
    return [head - 2] * q + [head - 1] * q + [head] * (batch - 2 * q)


def gpu_mib(pid: int) -> float | None:
    """nvidia-smi's memory figure for one process (None without nvidia-smi or a GPU)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in out.splitlines():
        p, _, mib = line.partition(",")
        if p.strip() == str(pid):
            return float(mib)
    return None


class Runner:
    """One engine as the benchmark drives it: `generate(rows, versions)` runs one batch with a
    version per row (None: base) and returns the completion tokens made."""

    def __init__(self, name: str, engine, pid: int, base: Callable[[list[GenRequest]], Awaitable[int]] | None):
        self.name, self.engine, self.pid, self._base = name, engine, pid, base

    async def generate(self, rows: list[GenRequest], versions: list[int | None]) -> int:
        if all(v is None for v in versions):
            if self._base is None:
                raise NotImplementedError(f"{self.name}: no base-model generation")
            return await self._base(rows)
        if hasattr(self.engine, "generate_mixed"):  # one batch, each row on its own version
            outs = await self.engine.generate_mixed(rows, versions)
        else:  # a server batches concurrent requests itself
            by: dict[int, list[int]] = {}
            for i, v in enumerate(versions):
                by.setdefault(v, []).append(i)
            groups = await asyncio.gather(*(self.engine.generate([rows[i] for i in ix], v) for v, ix in by.items()))
            outs = [r for g in groups for r in g]
        return sum(len(r.token_ids) for results in outs for r in results)


async def best_rate(runner: Runner, rows: list[GenRequest], versions: list[int | None], repeats: int) -> float:
    """Completion tokens/s of one batch, best of `repeats` after a warm-up run (graphs captured,
    kernels compiled)."""
    await runner.generate(rows, versions)
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        made = await runner.generate(rows, versions)
        best = max(best, made / (time.perf_counter() - t0))
    return round(best, 1)


async def measure(runner: Runner, adapters: list[bytes], lora: LoraSpec, args, res: dict, work: Path) -> None:
    """Loads, event -> first token, object path, then throughput; fills `res` as it goes."""
    eng = runner.engine
    one = GenRequest(prompt_token_ids=[5, 6, 7, 8], max_new_tokens=1, temperature=1.0, seed=0)
    store = LocalStore(work / f"store-{runner.name}")
    load_s, token_s, object_s = [], [], []
    for v, data in enumerate(adapters):
        loaded = await eng.loaded_versions()
        if len(loaded) >= KEEP:
            await eng.unload_version(min(loaded))
        if v % 2 == 0:  # bytes local
            t0 = time.perf_counter()
            await eng.load_version(v, data, lora)
            t1 = time.perf_counter()
            await eng.generate([one], v)
            t2 = time.perf_counter()
            load_s.append(t1 - t0)
            token_s.append(t2 - t0)
        else:  # the object path: stored copy -> verified read -> load -> one token
            ref = store.put_bytes(durable.adapter_key("bench", v), data)
            payload = ObjectPayload(uri=ref.uri, bytes=ref.bytes, sha256=ref.sha256)
            t0 = time.perf_counter()
            got = await asyncio.to_thread(durable.read, store, payload)
            await eng.load_version(v, got, lora)
            await eng.generate([one], v)
            object_s.append(time.perf_counter() - t0)
    skip = 1  # the first load of each path warms caches (a server compiles its LoRA kernels)
    res["load_ms"] = [round(s * 1e3, 2) for s in load_s]
    res["load_ms_p50"] = round(statistics.median(load_s[skip:]) * 1e3, 2)
    res["event_to_token_ms_p50"] = round(statistics.median(token_s[skip:]) * 1e3, 2)
    res["object_to_token_ms_p50"] = round(statistics.median(object_s[skip:]) * 1e3, 2)
    print(
        f"{runner.name}: load {res['load_ms_p50']} ms, event->token {res['event_to_token_ms_p50']} ms, "
        f"object->token {res['object_to_token_ms_p50']} ms",
        flush=True,
    )
    head = len(adapters) - 1
    rows = requests(args.batch, args.prompt_len, args.new_tokens, args.vocab)
    tps: dict[str, float] = res.setdefault("tokens_per_s", {})
    for case in CASES:
        if case in tps:
            continue
        try:
            tps[case] = await best_rate(runner, rows, case_versions(case, len(rows), head), args.repeats)
        except NotImplementedError as exc:
            res.setdefault("skipped", {})[case] = str(exc)
            continue
        print(f"{runner.name}: {case} {tps[case]:,.0f} tok/s", flush=True)
    if "base" in tps:
        res["vs_base"] = {c: round(tps[c] / tps["base"], 3) for c in tps if c != "base"}
    res["peak_gpu_mib"] = gpu_mib(runner.pid)


# --- engines -----------------------------------------------------------------------------


async def run_embedded(model_dir: Path, adapters, lora, args, work: Path) -> dict:
    from services.common import models
    from services.rollout.engines.embedded import EmbeddedEngine
    from services.rollout.sampling import Row, decode

    res: dict = {"engine": "embedded"}
    t0 = time.perf_counter()
    tok = models.load_tokenizer(model_dir)
    model = models.load_base_model(model_dir, args.dtype, args.device)
    engine = EmbeddedEngine(
        model, eos_ids=models.eos_token_ids(tok), pad_id=models.pad_token_id(tok), slots=KEEP + 1, cuda_graphs=True
    )
    res["startup_s"] = round(time.perf_counter() - t0, 2)
    res["cuda_graphs"] = engine.graphs is not None
    eos = tuple(models.eos_token_ids(tok))

    async def base(rows: list[GenRequest]) -> int:
        # the model without slots: what it costs before any version is installed
        plain = [
            Row(
                prompt=r.prompt_token_ids,
                max_new_tokens=r.max_new_tokens,
                temperature=r.temperature,
                stop_ids=eos,
                seed=r.seed,
            )
            for r in rows
        ]
        outs = await asyncio.to_thread(decode, model, plain, pad_id=engine.pad_id, graphs=engine.graphs)
        return sum(len(o.token_ids) for o in outs)

    runner = Runner("embedded", engine, os.getpid(), base)
    # base first: once a version is installed, the layers are the slots' own
    rows = requests(args.batch, args.prompt_len, args.new_tokens, args.vocab)
    res["tokens_per_s"] = {"base": await best_rate(runner, rows, [None] * len(rows), args.repeats)}
    print(f"embedded: base {res['tokens_per_s']['base']:,.0f} tok/s", flush=True)
    await measure(runner, adapters, lora, args, res, work)
    if torch.cuda.is_available():
        res["torch_peak_reserved_mib"] = round(torch.cuda.max_memory_reserved() / 2**20)
    await engine.close()
    return res  # the model goes with this frame; main empties the CUDA cache


def adapter_root(work: Path) -> Path:
    """Where the server engines write each version for their server to read: memory (/dev/shm)
    where the host has it, as the XCCL sidecar does, so a load times the server, not a disk."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return Path(tempfile.mkdtemp(prefix="lorabus-engines-", dir=shm))
    return work


def server_config(kind: str, model_dir: Path, args, work: Path):
    from services.config.loader import config_from_dict

    extra = list(args.vllm_arg if kind == "vllm" else args.sglang_arg)
    if kind == "sglang":  # the carried site has no FlashAttention 3 (benchmarks/device/sglang-site.sh)
        extra = [
            "--dtype",
            args.dtype,
            *([] if "--attention-backend" in extra else ["--attention-backend", "triton"]),
            *extra,
        ]
    section = (
        {
            "max_lora_rank": RANK,
            "max_loras": KEEP,
            "max_cpu_loras": KEEP + 2,
            "dtype": args.dtype,
            "max_model_len": args.prompt_len + args.new_tokens + 64,
            "extra_args": extra,
        }
        if kind == "vllm"
        else {"max_lora_rank": RANK, "max_loaded_loras": KEEP + 2, "max_loras_per_batch": KEEP, "extra_args": extra}
    )
    return config_from_dict(
        {
            "gconfig": {"lora_name": "bench"},
            "actor": {"path": str(model_dir), "lora_rank": RANK, "lora_alpha": ALPHA},
            "rollout": {
                "engine": kind,
                "replicas": 1,
                "preload_v0": False,
                "max_head_offpolicyness": KEEP - 2,
                "lora_keep_versions": KEEP,
                "adapter_dir": str(args.adapter_root / f"adapters-{kind}"),
                "request_timeout_s": 600,
            },
            kind: section,
            "train_dataset": {"path": "builtin:arith"},
        }
    )


async def wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=2.0) as client:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{url}: server exited with {proc.returncode}:\n{log_tail(log, 40)}")
            try:
                if (await client.get(f"{url}/health")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url}: not healthy after {timeout_s:.0f} s:\n{log_tail(log, 40)}")
            await asyncio.sleep(0.5)


def server_pythonpath(inherited: str, vllm_site: str | None, sglang_site: str | None, kind: str) -> str:
    """`inherited` without either engine's site, with `kind`'s first."""
    sites = {"vllm": vllm_site, "sglang": sglang_site}
    others = {os.path.realpath(p) for p in sites.values() if p}
    kept = [p for p in inherited.split(os.pathsep) if p and os.path.realpath(p) not in others]
    own = sites.get(kind)
    return os.pathsep.join([own, *kept] if own else kept)


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 30 s."""
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def server_base(kind: str, engine, url: str, cfg) -> Callable[[list[GenRequest]], Awaitable[int]]:
    """Base-model rows on a LoRA-enabled server, one request per row as the engine sends them:
    vLLM's completions under the served model's own name, SGLang's /generate without lora_path."""
    if kind == "vllm":
        from services.rollout.engines.vllm import completion_body, parse_completion

        async def one(r: GenRequest) -> int:
            answer = (await engine.http.post(f"{url}/v1/completions", completion_body(cfg.vllm.model, r))).json()
            return sum(len(x.token_ids) for x in parse_completion(answer, r.n, url))

    else:
        from services.rollout.engines.sglang import generate_body, parse_generate

        async def one(r: GenRequest) -> int:
            body = generate_body("", r, [f"bench-base-{uuid.uuid4().hex}" for _ in range(r.n)])
            del body["lora_path"]
            answer = (await engine.http.post(f"{url}/generate", body)).json()
            return sum(len(x.token_ids) for x in parse_generate(answer, r.n, url))

    async def base(rows: list[GenRequest]) -> int:
        return sum(await asyncio.gather(*map(one, rows)))

    return base


async def run_server(kind: str, model_dir: Path, adapters, lora, args, work: Path) -> dict:
    from services.local.ports import free_port
    from services.rollout import server_cmd

    cfg = server_config(kind, model_dir, args, work)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, **server_cmd.server_env(cfg)}
    if args.device == "cpu" and kind == "vllm":
        from services.local.inference_servers import VLLM_CPU_ENV

        env.update(VLLM_CPU_ENV)
    env["PYTHONPATH"] = server_pythonpath(env.get("PYTHONPATH", ""), args.vllm_site, args.sglang_site, kind)
    argv = server_cmd.server_command(cfg, host="127.0.0.1", port=port, python=args.server_python)
    log = work / f"{kind}.log"
    res: dict = {"engine": kind, "argv": argv[1:], "adapter_dir": cfg.rollout.adapter_dir}
    print(f"{kind}: {server_cmd.shell_line(argv)}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        await wait_healthy(proc, url, log, args.server_timeout)
        res["startup_s"] = round(time.perf_counter() - t0, 1)
        print(f"{kind}: healthy after {res['startup_s']} s", flush=True)
        if kind == "vllm":
            from services.rollout.engines.vllm import VllmEngine as Cls
        else:
            from services.rollout.engines.sglang import SglangEngine as Cls
        engine = Cls.from_config(cfg, [url])
        runner = Runner(kind, engine, proc.pid, server_base(kind, engine, url, cfg))
        await measure(runner, adapters, lora, args, res, work)
        await engine.close()
    except Exception as exc:  # one engine failing must not cost the others' figures
        res["error"] = f"{type(exc).__name__}: {exc}"
        res["log_tail"] = log_tail(log, 40)
        print(f"{kind}: FAILED {res['error']}\n{res['log_tail']}", flush=True)
    finally:
        stop_server(proc)
    shutil.copy(log, args.out_dir / f"gpu_engines_{kind}{'_' + args.label if args.label else ''}.log")
    return res


def print_table(results: list[dict]) -> None:
    head = (
        f"| engine | startup s | load ms | event->token ms | object->token ms | {' | '.join(CASES)} "
        "| head/base | 25%/base | 3 mixed/base | GPU MiB |"
    )
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in results:
        if "error" in r:
            print(f"| {r['engine']} | failed: {r['error'][:80]} |")
            continue
        t, vb = r.get("tokens_per_s", {}), r.get("vs_base", {})
        cells = [
            r["engine"],
            r.get("startup_s"),
            r.get("load_ms_p50"),
            r.get("event_to_token_ms_p50"),
            r.get("object_to_token_ms_p50"),
        ]
        cells += [f"{t[c]:,.0f}" if c in t else "-" for c in CASES]
        cells += [vb.get(c, "-") for c in ("head", "mixed25", "mixed3")]
        cells.append(r.get("peak_gpu_mib"))
        print("| " + " | ".join(str(c) for c in cells) + " |")


async def main_async(args) -> int:
    work = Path(tempfile.mkdtemp(prefix="lorabus-engines-", dir=args.work_dir))
    args.adapter_root = adapter_root(work)
    if args.tiny:
        model_dir = tiny_model_dir(work / "model")
    else:
        model_dir = write_model_dir(args.shape, work / "model", device=args.device)
    cfg = json.loads((model_dir / "config.json").read_text())
    args.vocab = cfg["vocab_size"]
    from services.common import models

    model = models.load_base_model(model_dir, "float32", "cpu") if args.tiny else None
    if model is None:
        from benchmarks.shapes import build

        model = build(args.shape, "meta", torch.bfloat16)
    dtype = adapter_io_dtype(args.dtype)
    adapters = [
        adapter_io.to_bytes(random_lora(model, RANK, seed=100 + v, dtype=dtype, b_scale=0.02)) for v in range(VERSIONS)
    ]
    del model
    lora = LoraSpec(
        rank=RANK,
        alpha=ALPHA,
        target_modules=list(HF_LINEAR),
        dtype=adapter_io.dtype_name(dtype),
        base_model=str(model_dir),
    )
    out: dict = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "shape": "tiny" if args.tiny else args.shape,
        "dtype": args.dtype,
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "rank": RANK,
        "adapter_mb": round(len(adapters[0]) / 1e6, 2),
        "engines": [],
    }
    for kind in args.engines:
        print(f"--- {kind}", flush=True)
        if kind == "embedded":
            try:
                r = await run_embedded(model_dir, adapters, lora, args, work)
            except Exception as exc:  # recorded; the servers still run
                import traceback

                traceback.print_exc()
                r = {"engine": "embedded", "error": f"{type(exc).__name__}: {exc}"}
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        else:
            r = await run_server(kind, model_dir, adapters, lora, args, work)
        out["engines"].append(r)
        path = args.out_dir / f"gpu_engines{'_' + args.label if args.label else ''}.json"
        path.write_text(json.dumps(out, indent=2) + "\n")
    print_table(out["engines"])
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(args.adapter_root, ignore_errors=True)
    return 0 if all("error" not in r for r in out["engines"]) else 1


def adapter_io_dtype(name: str) -> torch.dtype:
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--label", default="", help="results file gpu_engines_<label>.json")
    ap.add_argument("--tiny", action="store_true", help="the tiny task's model on the CPU (smoke run)")
    ap.add_argument("--shape", default="qwen2.5-1.5b")
    ap.add_argument(
        "--engines", nargs="+", default=["embedded", "vllm", "sglang"], choices=["embedded", "vllm", "sglang"]
    )
    ap.add_argument("--vllm-site", default=None, help="pip --target site of vLLM (the vLLM server's path only)")
    ap.add_argument("--sglang-site", default=None, help="pip --target site of SGLang (the SGLang server's only)")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--server-python", default=None, help="the python that has vLLM/SGLang (default: python3)")
    ap.add_argument("--server-timeout", type=float, default=600.0)
    ap.add_argument("--vllm-arg", action="append", default=[], help="an extra vLLM server argument (repeatable)")
    ap.add_argument("--sglang-arg", action="append", default=[], help="an extra SGLang server argument (repeatable)")
    ap.add_argument("--work-dir", default=None, help="where model and adapter directories go (default: the temp dir)")
    args = ap.parse_args(argv)
    args.device = "cpu" if args.tiny else "cuda"
    args.dtype = "float32" if args.tiny else "bfloat16"
    args.batch = args.batch or (8 if args.tiny else 64)
    args.prompt_len = args.prompt_len or (8 if args.tiny else 128)
    args.new_tokens = args.new_tokens or (8 if args.tiny else 128)
    if args.tiny and args.server_python is None:
        from services.local.inference_servers import vllm_python

        args.server_python = vllm_python(None)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.tiny and not torch.cuda.is_available():
        print("no CUDA device: use --tiny for a CPU run", file=sys.stderr)
        return 2
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    raise SystemExit(main())
