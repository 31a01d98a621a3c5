"""Peak host memory per rank while the FSDP2 trainer starts, 2 gloo ranks on CPU.

    python benchmarks/trainer_start_memory.py [--out benchmarks/results/trainer_start_memory.json]

Two ways to start, each under `torchrun --nproc_per_node=2`, on a Qwen2-shaped model of
about 134 M parameters (fp32, 0.54 GB) saved to a temporary directory:
- `every-rank-loads` (the trainer before issue 12): every rank reads the checkpoint, then
  FSDP2 shards it, so every rank holds a full copy at start;
- `rank0-broadcast` (now): rank 0 reads it, rank 1 builds on the meta device, and the
  weights reach rank 1's shard by `set_model_state_dict(..., broadcast_from_rank0=True)`.
Per rank: peak RSS (`ru_maxrss`), the RSS after the imports (torch, transformers, peft), and
their difference, which is what the start itself cost. On CPU the device is the host, so
this is the device memory too. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SHAPE = dict(
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=4,
    vocab_size=32000,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)
MODES = ("every-rank-loads", "rank0-broadcast")


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def worker(mode: str, model_dir: str, out_dir: str) -> None:
    import torch  # noqa: F401

    from services.common.models import load_base_model
    from services.config.schema import ActorConfig, LorabusConfig
    from services.trainer.engines.base import leave_distributed
    from services.trainer.engines.fsdp2 import FSDP2Engine

    after_imports = peak_rss_mb()
    cfg = LorabusConfig(
        actor=ActorConfig(path=model_dir, device="cpu", dtype="float32", lora_rank=16, lora_alpha=32.0, seed=1)
    )
    t0 = time.perf_counter()
    if mode == "every-rank-loads":
        engine = FSDP2Engine(cfg, load_base_model(model_dir, "float32", "cpu"))
    else:
        engine = FSDP2Engine(cfg)
    seconds = time.perf_counter() - t0
    peak = peak_rss_mb()
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in engine.model.parameters())
    row = {
        "mode": mode,
        "rank": engine.rank,
        "after_imports_mb": after_imports,
        "peak_mb": peak,
        "start_cost_mb": peak - after_imports,
        "start_seconds": seconds,
        "local_params": local,
    }
    Path(out_dir, f"{mode}-{engine.rank}.json").write_text(json.dumps(row))
    leave_distributed()


def save_model(directory: Path) -> int:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**SHAPE))
    model.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=REPO / "benchmarks/results/trainer_start_memory.json")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp, "model")
        params = save_model(model_dir)
        rows = []
        for mode in MODES:
            env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
            proc = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--nproc_per_node=2",
                    "--rdzv_backend=c10d",
                    "--rdzv_endpoint=127.0.0.1:0",
                    __file__,
                    "--worker",
                    mode,
                    str(model_dir),
                    tmp,
                ],
                env=env,
                capture_output=True,
                text=True,
                timeout=900,
            )
            if proc.returncode != 0:
                print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
                return 1
            rows += [json.loads(Path(tmp, f"{mode}-{r}.json").read_text()) for r in (0, 1)]
    import torch

    result = {
        "torch": torch.__version__,
        "model_params": params,
        "model_mb_fp32": params * 4 / 2**20,
        "world_size": 2,
        "backend": "gloo (CPU)",
        "rows": rows,
    }
    print(
        f"trainer start, 2 gloo ranks, Qwen2-shaped {params / 1e6:.0f} M params "
        f"({result['model_mb_fp32']:.0f} MiB fp32); RSS in MiB"
    )
    print(
        f"  {'mode':<18} {'rank':>4} {'after imports':>13} {'peak':>7} {'start cost':>10} "
        f"{'seconds':>7} {'local params':>12}"
    )
    for r in rows:
        print(
            f"  {r['mode']:<18} {r['rank']:>4} {r['after_imports_mb']:>13.0f} {r['peak_mb']:>7.0f} "
            f"{r['start_cost_mb']:>10.0f} {r['start_seconds']:>7.1f} {r['local_params']:>12,}"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(*sys.argv[2:5])
    else:
        sys.exit(main())
