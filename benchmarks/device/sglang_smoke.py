"""Real SGLang on the GPU through the rollout's own engine: two adapters loaded at runtime, logprobs
under each, one unloaded, an aborted request; timings as JSON.

    python benchmarks/device/sglang_smoke.py --server-timeout 420 --out "$OUT/sglang_smoke.json"   # H200
    python benchmarks/device/sglang_smoke.py --tiny --dry-run --out /tmp/s.json    # here: args + model only

On the device, after the site has arrived (benchmarks/device/sglang-site.sh packs it; its header
says how the parts travel): `source benchmarks/h200_env.sh` for the project's wheels, then
`export PYTHONPATH=/tmp/ssite:$PYTHONPATH` (the unpacked site first: it carries sglang's pinned
transformers 5.12.1, the image's 5.17 breaks sglang 0.5.17's imports).

The server is `python -m sglang.launch_server` as `services.rollout.server_cmd.sglang_command`
writes it for a config with `rollout.engine: sglang` (LoRA r16 on all linear layers, keep window
2, `--lora-backend triton`), plus `--attention-backend` (triton unless told: the site carries
FlashAttention 3 only when packed with ATTN=fa3). The model is a dense Qwen2 of the Qwen2.5-1.5B
shape (`benchmarks/shapes.py`; `--arch llama` for the Llama-architecture twin that
`benchmarks/gpu_engines.py` uses) with random bf16 weights and the tiny task's byte-level
tokenizer. Steps, each timed:

  startup_s            process start -> /health answers
  load_ms              load_version of v1, then v2 (bytes on this host -> servable)
  first_token_ms       one one-token request under each version right after its load
  generate             a batch of prompts x n completions under each version: new tokens/s,
                       logprobs present, finite and <= 0 for every token, v1 != v2
  unload_ms            unload_version(v1); then v1 refused by the engine, v2 still served,
                       /v1/models lists v2 alone
  abort                a long request on v2 cancelled: SGLang holds nothing afterwards (the
                       unload of v2 returns at once)

Exit status 0 when every check passed; the JSON holds the figures, the checks and, on a
failure, the server log's tail.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

KEEP = 2
RANK, ALPHA = 16, 32.0
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
"""the lending workplace's rule, in the server's environment too"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="the JSON written")
    ap.add_argument("--shape", default="qwen2.5-1.5b", help="a shape of benchmarks/shapes.py")
    ap.add_argument("--arch", choices=["qwen2", "llama"], default="qwen2")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model of the same architecture (CPU checks)")
    ap.add_argument("--attention-backend", choices=["triton", "fa3"], default="triton")
    ap.add_argument("--sglang-arg", action="append", default=[], help="an extra server argument (repeatable)")
    ap.add_argument("--server-python", default=sys.executable, help="the interpreter that runs sglang")
    ap.add_argument("--server-timeout", type=float, default=600.0, help="seconds to wait for /health")
    ap.add_argument("--batch", type=int, default=8, help="prompts per generate")
    ap.add_argument("--n", type=int, default=2, help="completions per prompt")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--work-dir", type=Path, default=None, help="where the model and adapters go (default: a temp dir)")
    ap.add_argument("--dry-run", action="store_true", help="build the model and the command line, start nothing")
    args = ap.parse_args(argv)
    for name in ("batch", "n", "new_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: {getattr(args, name)} must be >= 1")
    return args


def model_config(arch: str, shape: str, tiny: bool):
    """The transformers config: `shape`'s dimensions (or 2 tiny layers) in `arch`."""
    from transformers import LlamaConfig, Qwen2Config

    from benchmarks.shapes import SHAPES

    dims = dict(SHAPES[shape])
    if tiny:
        dims.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
        dims.update(num_key_value_heads=2, vocab_size=512)
    cls = Qwen2Config if arch == "qwen2" else LlamaConfig
    return cls(**dims, max_position_embeddings=4096, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def write_model(directory: Path, arch: str, shape: str, tiny: bool, device: str) -> Path:
    """Random bf16 weights saved as an HF directory, with the tiny task's tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.shapes import TOKENIZER_DIR

    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(model_config(arch, shape, tiny))
    finally:
        torch.set_default_dtype(previous)
    model.save_pretrained(directory, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(TOKENIZER_DIR / name, directory / name)
    return directory


def adapters(model_dir: Path, arch: str, shape: str, tiny: bool):
    """Two random r16 adapters on every linear layer, as PEFT bytes, and their LoraSpec."""
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.adapters import random_lora
    from proto.messages import LoraSpec
    from services.common import adapter_io
    from services.common.lora_targets import HF_LINEAR

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config(arch, shape, tiny))
    blobs = [adapter_io.to_bytes(random_lora(model, RANK, seed=v, dtype=torch.bfloat16, b_scale=0.02)) for v in (1, 2)]
    spec = LoraSpec(rank=RANK, alpha=ALPHA, target_modules=list(HF_LINEAR), dtype="bfloat16", base_model=str(model_dir))
    return blobs, spec


def config(model_dir: Path, work: Path, args: argparse.Namespace):
    from services.common.lora_targets import HF_LINEAR
    from services.config.loader import config_from_dict

    extra = ["--dtype", "bfloat16", "--attention-backend", args.attention_backend, *args.sglang_arg]
    return config_from_dict(
        {
            "gconfig": {"lora_name": "smoke"},
            "actor": {"path": str(model_dir), "lora_rank": RANK, "lora_alpha": ALPHA},
            "rollout": {
                "engine": "sglang",
                "replicas": 1,
                "preload_v0": False,
                "max_head_offpolicyness": KEEP - 1,
                "lora_keep_versions": KEEP,
                "adapter_dir": str(work / "adapters"),
                "request_timeout_s": 600,
            },
            # no startup adapter: SGLang then needs the rank and the modules up front
            "sglang": {
                "max_lora_rank": RANK,
                "max_loaded_loras": KEEP + 1,
                "max_loras_per_batch": KEEP,
                "lora_target_modules": list(HF_LINEAR),
                "extra_args": extra,
            },
            "train_dataset": {"path": "builtin:arith"},
        }
    )


def prompts(batch: int, n: int, new_tokens: int, vocab: int, seed: int):
    import random

    from services.rollout.engines.base import GenRequest

    rng = random.Random(seed)
    return [
        GenRequest(
            prompt_token_ids=[rng.randrange(3, vocab) for _ in range(32)],
            n=n,
            max_new_tokens=new_tokens,
            temperature=1.0,
            seed=seed + i,
        )
        for i in range(batch)
    ]


async def smoke(engine, url: str, blobs, spec, args, vocab: int, res: dict) -> None:
    from services.rollout.engines.base import GenRequest
    from services.rollout.engines.http import VersionNotLoaded

    checks = res["checks"]
    res["load_ms"], res["first_token_ms"], res["generate"] = [], [], {}
    one = [GenRequest(prompt_token_ids=[5, 6, 7], max_new_tokens=1, temperature=0.0)]
    for version, blob in ((1, blobs[0]), (2, blobs[1])):
        t0 = time.perf_counter()
        await engine.load_version(version, blob, spec)
        res["load_ms"].append(round((time.perf_counter() - t0) * 1e3, 1))
        t0 = time.perf_counter()
        await engine.generate(one, version)
        res["first_token_ms"].append(round((time.perf_counter() - t0) * 1e3, 1))
    outs = {}
    for version in (1, 2):
        rows = prompts(args.batch, args.n, args.new_tokens, vocab, seed=7)
        t0 = time.perf_counter()
        out = await engine.generate(rows, version)
        dt = time.perf_counter() - t0
        results = [r for per in out for r in per]
        tokens = sum(len(r.token_ids) for r in results)
        res["generate"][f"v{version}"] = {"s": round(dt, 3), "new_tokens": tokens, "tokens_per_s": round(tokens / dt)}
        checks[f"v{version}_n_results"] = [len(per) for per in out] == [args.n] * args.batch
        checks[f"v{version}_logprobs"] = all(
            len(r.logprobs) == len(r.token_ids) and all(math.isfinite(x) and x <= 0 for x in r.logprobs)
            for r in results
        )
        outs[version] = [r.token_ids for r in results]
    checks["versions_differ"] = outs[1] != outs[2]

    t0 = time.perf_counter()
    await engine.unload_version(1)
    res["unload_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
    try:
        await engine.generate(one, 1)
        checks["v1_refused_after_unload"] = False
    except VersionNotLoaded:
        checks["v1_refused_after_unload"] = True
    checks["v2_served_after_unload"] = bool((await engine.generate(one, 2))[0][0].token_ids)
    listed = sorted((await engine.registered(url)).keys())
    res["registered_after_unload"] = listed
    checks["only_v2_registered"] = listed == [engine.dirs.name(2)]

    long = [GenRequest(prompt_token_ids=[5, 6, 7], max_new_tokens=2000, temperature=1.0, stop_token_ids=[], seed=1)]
    task = asyncio.create_task(engine.generate(long, 2))
    await asyncio.sleep(1.0)
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    t0 = time.perf_counter()
    await asyncio.wait_for(engine.unload_version(2), 60)
    res["unload_after_abort_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
    checks["abort_released_hold"] = res["unload_after_abort_ms"] < 5000


async def run(args: argparse.Namespace) -> dict:
    import torch

    from benchmarks.gpu_engines import stop_server, wait_healthy
    from services.local.inference_servers import log_tail
    from services.local.ports import free_port
    from services.rollout import server_cmd
    from services.rollout.engines.sglang import SglangEngine

    work = Path(tempfile.mkdtemp(prefix="sglang-smoke-", dir=args.work_dir))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    res: dict = {"shape": "tiny" if args.tiny else args.shape, "arch": args.arch, "device": device, "checks": {}}
    t0 = time.perf_counter()
    model_dir = write_model(work / "model", args.arch, args.shape, args.tiny, device)
    res["model_write_s"] = round(time.perf_counter() - t0, 1)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    blobs, spec = adapters(model_dir, args.arch, args.shape, args.tiny)
    res["adapter_mb"] = round(len(blobs[0]) / 1e6, 2)
    cfg = config(model_dir, work, args)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = server_cmd.sglang_command(cfg, host="127.0.0.1", port=port, python=args.server_python)
    res["argv"] = argv[1:]
    print(f"sglang: {server_cmd.shell_line(argv)}", flush=True)
    if args.dry_run:
        res["dry_run"] = True
        shutil.rmtree(work, ignore_errors=True)
        return res
    env = {**os.environ, **server_cmd.server_env(cfg), **NO_MULTICAST}
    log = work / "sglang.log"
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    engine = None
    try:
        await wait_healthy(proc, url, log, args.server_timeout)
        res["startup_s"] = round(time.perf_counter() - t0, 1)
        engine = SglangEngine.from_config(cfg, [url])
        res["server_version"] = (await engine.http.get(f"{url}/server_info")).json().get("version")
        await smoke(engine, url, blobs, spec, args, vocab, res)
    except Exception as exc:  # recorded with the server's log, then the exit status says it
        res["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        if engine is not None:
            await engine.close()
        stop_server(proc)
        if "error" in res or not all(res["checks"].values()):
            res["log_tail"] = log_tail(log, 80)
        shutil.copy(log, args.out.with_suffix(".log"))
        shutil.rmtree(work, ignore_errors=True)
    return res


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    res = asyncio.run(run(args))
    args.out.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k != "log_tail"}, indent=2))
    if "log_tail" in res:
        print(res["log_tail"])
    return 0 if "error" not in res and all(res["checks"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
