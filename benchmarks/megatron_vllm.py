"""AReaL's Megatron + vLLM LoRA example on a GPU, against the same run with the FSDP2 trainer:
train, publish (object or XCCL), vLLM serves each version, and how long that takes.

    python benchmarks/megatron_vllm.py --out-dir OUT --trainer megatron --mode xccl \
        --server-site /tmp/vsite --trainer-site /tmp/msite              # Qwen3-0.6B shape, 28 layers
    python benchmarks/megatron_vllm.py ... --trainer fsdp --mode xccl                 # the same adapter, FSDP2
    python benchmarks/megatron_vllm.py ... --shape qwen3-30b-a3b --moe --experts 128 --layers 2   # the MoE example

Each case is one `lorabus up --config tests/fixtures/areal/gsm8k_grpo_megatron_lora.yaml`, the file
as AReaL ships it, with AReaL-key overrides for one GPU: `actor.backend=megatron:d1p1t1` (or
`fsdp:d1` with the same seven modules under HF's names), `rollout.backend=vllm:d1p1t1`, the vLLM
server at 30 % of the GPU (the trainer shares it), `rollout.max_head_offpolicyness=0` (every
version is loaded before the next batch is generated: each version's delivery is timed on its
own), a reward that differs between completions (a random model never answers GSM8K; see
tests/e2e/test_up_areal_megatron.py, whose CPU run this is at the real shape) and lr 0.05 so
that versions differ in bf16. The model is random weights of the named shape under the example's
model id in a local Hugging Face cache, beside a GSM8K-shaped dataset (tests/fixtures/gsm8k.py),
offline. The held-out evaluator is off: serving is what is measured.

Writes OUT/megatron_vllm_<label>.json: the run summary's delivery figures (step seconds, time
from step end to servable on vLLM per path), the canary and train/inference figures (every
version passes vLLM's load canary computed by the trainer), the versions vLLM loaded, and the
exit code; the run's logs stay in the run directory (`--run-dir`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

EXAMPLE = "tests/fixtures/areal/gsm8k_grpo_megatron_lora.yaml"
HF_TARGETS = "[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"
"""what the converter names linear_qkv, linear_proj, linear_fc1, linear_fc2: the FSDP2 run's
adapter is the Megatron run's, module for module"""
MODEL_ID = {"qwen3-0.6b": "Qwen/Qwen3-0.6B", "qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B-Base", "tiny": "Qwen/Qwen3-0.6B"}


def make_hub(hub: Path, args: argparse.Namespace) -> str:
    """GSM8K and a random model of `args.shape` in a HF cache at `hub`; returns the model id."""
    import torch
    from transformers import AutoTokenizer

    from benchmarks.megatron_bridge_step import hf_model
    from tests.fixtures import gsm8k

    repo_id = MODEL_ID[args.shape]
    snapshot = hub / "hub" / f"models--{repo_id.replace('/', '--')}" / "snapshots" / gsm8k.REVISION
    if (snapshot / "config.json").exists():
        return repo_id
    gsm8k.hf_cache(hub)
    gsm8k.chat_tokenizer(snapshot)
    tok = AutoTokenizer.from_pretrained(snapshot)
    tok.model_max_length = 2048
    tok.save_pretrained(snapshot)
    shape = argparse.Namespace(shape=args.shape, vocab=len(tok), layers=args.layers, moe=args.moe,
                               experts=args.experts, seed=args.seed)  # fmt: skip
    model = hf_model(shape)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.to(getattr(torch, args.dtype)).save_pretrained(snapshot)
    (snapshot.parents[1] / "refs").mkdir(parents=True, exist_ok=True)
    (snapshot.parents[1] / "refs" / "main").write_text(gsm8k.REVISION)
    return repo_id


def overrides(args: argparse.Namespace, repo_id: str) -> list[str]:
    trainer = (
        ["actor.backend=megatron:d1p1t1"]
        if args.trainer == "megatron"
        else ["actor.backend=fsdp:d1", f"actor.target_modules={HF_TARGETS}"]
    )
    return [
        *trainer,
        "rollout.backend=vllm:d1p1t1",
        f"actor.path={repo_id}",
        f"vllm.model={repo_id}",
        f"actor.weight_update_mode={args.mode}",
        f"actor.dtype={args.dtype}",
        f"vllm.dtype={args.dtype}",
        f"vllm.gpu_memory_utilization={args.gpu_memory}",
        f"vllm.max_model_len={args.max_model_len}",
        f"train_dataset.batch_size={args.batch}",
        f"gconfig.max_new_tokens={args.max_new}",
        "rollout.max_head_offpolicyness=0",
        "actor.optimizer.lr=0.05",
        "train_dataset.reward_fn=tests.fixtures.gsm8k:varied_reward",
        *args.extra,
    ]


def vllm_loaded(run_dir: Path) -> list[int]:
    """Versions the vLLM server's own log says it loaded under the example's lora_name."""
    log = run_dir / "vllm-0.log"
    text = log.read_text(errors="replace") if log.exists() else ""
    return sorted({int(v) for v in re.findall(r"name 'lora-gsm8k-v(\d+)'", text)})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--label", default="")
    ap.add_argument("--trainer", choices=["megatron", "fsdp"], default="megatron")
    ap.add_argument("--mode", choices=["xccl", "disk"], default="xccl")
    ap.add_argument("--shape", choices=sorted(MODEL_ID), default="qwen3-0.6b")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--moe", action="store_true")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=4, help="prompts per step (x 4 samples)")
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--gpu-memory", default="0.3")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hub", type=Path, default=Path("/tmp/mv_hub"))
    ap.add_argument("--run-dir", type=Path, default=None)
    ap.add_argument("--server-site", default=None, help="pip --target site of vLLM (the server's only)")
    ap.add_argument("--vllm-python", default=None, help="a python that has vLLM (the CPU venv here)")
    ap.add_argument("--trainer-site", default=None, help="the megatron-bridge site (the trainer's only)")
    ap.add_argument("--timeout", type=float, default=420.0)
    ap.add_argument("extra", nargs="*", help="more overrides (AReaL or lorabus keys)")
    args = ap.parse_args(argv)
    label = args.label or f"{args.trainer}_{args.mode}_{args.shape}{'_moe' if args.moe else ''}"
    run_dir = args.run_dir or Path(f"/tmp/mv_run_{label}")
    hub = args.hub / f"{args.shape}-{args.layers}-{args.experts if args.moe else 0}-{args.dtype}"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    repo_id = make_hub(hub, args)
    hub_s = time.monotonic() - t0
    flags = [f"--server-site={args.server_site}"] if args.server_site else []
    flags += [f"--vllm-python={args.vllm_python}"] if args.vllm_python else []
    flags += [f"--trainer-site={args.trainer_site}"] if args.trainer_site else []
    cmd = [sys.executable, "-m", "services.local.launcher", "--config", EXAMPLE, *flags, "--no-evaluate",
           "--timeout", str(args.timeout), "--progress-every", "10", f"run_dir={run_dir}",
           f"total_train_steps={args.steps}", *overrides(args, repo_id)]  # fmt: skip
    env = {**os.environ, "HF_HOME": str(hub), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    print("+", " ".join(cmd), flush=True)
    t1 = time.monotonic()
    log = args.out_dir / f"megatron_vllm_{label}_up.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            f.write(line)
        rc = proc.wait()
    result: dict = {"label": label, "exit_code": rc, "args": {k: str(v) for k, v in vars(args).items()},
                    "hub_s": round(hub_s, 1), "up_wall_s": round(time.monotonic() - t1, 1)}  # fmt: skip
    summary_path = run_dir / "summary.json"
    if summary_path.exists():
        s = json.loads(summary_path.read_text())
        keys = ("trainer_steps", "trajectories", "loaded", "adapter_versions_given_up", "delivery", "canary",
                "train_infer_mismatch", "exported", "restarts")  # fmt: skip
        result.update({k: s.get(k) for k in keys})
    result["vllm_loaded_versions"] = vllm_loaded(run_dir)
    trainer_log = run_dir / "trainer.log"
    if trainer_log.exists():
        text = trainer_log.read_text(errors="replace")
        result["trainer_lines"] = [x for x in text.splitlines() if "Megatron" in x or "LoRA r=" in x][:6]
        result["trainer_tail"] = text.splitlines()[-15:] if rc else []
    (args.out_dir / f"megatron_vllm_{label}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result.get(k) for k in ("label", "exit_code", "trainer_steps", "delivery",
                                                "vllm_loaded_versions")}, indent=2))  # fmt: skip
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
