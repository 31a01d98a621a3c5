"""Trainer step time and tokens/s of the FSDP2 engine on a Qwen2.5-1.5B-shaped model.

    python benchmarks/trainer_step.py --out trainer_step.json          # CUDA, bf16
    python benchmarks/trainer_step.py --tiny --out tiny.json           # CPU smoke run

Random weights from the Qwen2.5-1.5B config, LoRA r=16 on all linear layers, one GRPO batch
of `--groups` prompts x `--samples` completions with random token ids (the step's cost does
not depend on what the tokens are). Per step it times the whole `train_step` (proximal
logprobs without grad, forward/backward over micro-batches, clip, AdamW) and, separately,
what publishing a version costs the trainer: gathering the adapter and serializing it.
Imports torch/transformers/peft and the trainer's own modules only.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.shapes import SHAPES
from benchmarks.timing import device_name, sync
from proto.messages import Completion, Trajectory
from services.common import adapter_io
from services.config.schema import (
    ActorConfig,
    GenerationConfig,
    LorabusConfig,
    OptimizerConfig,
)
from services.trainer.engines.fsdp2 import FSDP2Engine

QWEN25_15B = dict(SHAPES["qwen2.5-1.5b"], max_position_embeddings=4096)
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=256,
)


def build_base(shape: dict, dtype: torch.dtype, device: torch.device):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(**shape)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    return model.to(dtype)


def make_batch(groups: int, samples: int, prompt: int, completion: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    out = []
    uniform = -math.log(vocab)
    for i in range(groups):
        comps = []
        for _ in range(samples):
            comps.append(
                Completion(
                    token_ids=torch.randint(0, vocab, (completion,), generator=g).tolist(),
                    logprobs=(uniform - 0.1 * torch.rand(completion, generator=g)).tolist(),
                    versions=[0] * completion,
                    reward=float(torch.rand(1, generator=g)),
                )
            )
        out.append(
            Trajectory(
                run="bench",
                trajectory_id=f"s{seed}g{i}",
                grant_id="x",
                replica="r",
                prompt_id=str(i),
                prompt_token_ids=torch.randint(0, vocab, (prompt,), generator=g).tolist(),
                completions=comps,
                started_at=0.0,
                finished_at=0.0,
            )
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny model on CPU (smoke run)")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--completion-tokens", type=int, default=256)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--mb-tokens", type=int, default=8192, help="actor.mb_spec_max_tokens")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)

    if args.tiny:
        shape, dtype, device = TINY, "float32", "cpu"
        args.groups, args.samples = min(args.groups, 2), min(args.samples, 2)
        args.prompt_tokens, args.completion_tokens = min(args.prompt_tokens, 8), min(args.completion_tokens, 16)
        args.steps, args.warmup = min(args.steps, 2), min(args.warmup, 1)
    else:
        if not torch.cuda.is_available():
            print("no CUDA device; use --tiny for a CPU smoke run", file=sys.stderr)
            return 2
        shape, dtype, device = QWEN25_15B, "bfloat16", "cuda"

    cfg = LorabusConfig(
        gconfig=GenerationConfig(temperature=1.0, n_samples=args.samples),
        actor=ActorConfig(
            path="qwen2.5-1.5b-shape",
            dtype=dtype,
            device=device,
            lora_rank=args.rank,
            lora_alpha=2.0 * args.rank,
            mb_spec_max_tokens=args.mb_tokens,
            optimizer=OptimizerConfig(lr=1e-5),
        ),
    )
    t0 = time.perf_counter()
    base = build_base(shape, adapter_io.DTYPES[dtype], torch.device(device))
    engine = FSDP2Engine(cfg, base)
    build_s = time.perf_counter() - t0
    lora_params = sum(p.numel() for p in engine.params)
    dev = engine.device
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)

    step_s, gather_s, serialize_s, tok_s = [], [], [], []
    weights = b""
    for i in range(args.warmup + args.steps):
        batch = make_batch(
            args.groups, args.samples, args.prompt_tokens, args.completion_tokens, shape["vocab_size"], seed=i
        )
        sync(dev)
        t = time.perf_counter()
        stats = engine.train_step(batch, head_version=i)
        sync(dev)
        t1 = time.perf_counter()
        adapter = engine.adapter_state()
        t2 = time.perf_counter()
        weights = adapter_io.to_bytes(adapter)
        t3 = time.perf_counter()
        if i >= args.warmup:
            step_s.append(t1 - t)
            gather_s.append(t2 - t1)
            serialize_s.append(t3 - t2)
            tok_s.append(stats.tokens / (t1 - t))
        assert math.isfinite(stats.loss), f"step {i}: loss {stats.loss}"

    seqs = args.groups * args.samples
    result = {
        "device": device_name(dev),
        "torch": torch.__version__,
        "model": "tiny" if args.tiny else "qwen2.5-1.5b-shape",
        "dtype": dtype,
        "lora_rank": args.rank,
        "lora_params": lora_params,
        "adapter_bytes": len(weights),
        "batch": {
            "groups": args.groups,
            "samples": args.samples,
            "sequences": seqs,
            "prompt_tokens": args.prompt_tokens,
            "completion_tokens": args.completion_tokens,
            "mb_spec_max_tokens": args.mb_tokens,
        },
        "build_seconds": build_s,
        "step_seconds_median": statistics.median(step_s),
        "step_seconds": step_s,
        "completion_tokens_per_second": statistics.median(tok_s),
        "total_tokens_per_second": statistics.median(
            seqs * (args.prompt_tokens + args.completion_tokens) / s for s in step_s
        ),
        "adapter_gather_seconds_median": statistics.median(gather_s),
        "adapter_serialize_seconds_median": statistics.median(serialize_s),
        "peak_memory_gib": torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None,
    }
    rows = [
        (
            "model",
            f"{result['model']} {dtype}, LoRA r={args.rank} all-linear "
            f"({lora_params / 1e6:.2f} M params, {len(weights) / 1e6:.1f} MB)",
        ),
        (
            "batch",
            f"{args.groups} groups x {args.samples} samples, prompt {args.prompt_tokens} "
            f"+ completion {args.completion_tokens} tokens",
        ),
        ("train_step median", f"{result['step_seconds_median'] * 1e3:.1f} ms"),
        ("completion tokens/s", f"{result['completion_tokens_per_second']:.0f}"),
        ("all tokens/s", f"{result['total_tokens_per_second']:.0f}"),
        ("adapter gather", f"{result['adapter_gather_seconds_median'] * 1e3:.1f} ms"),
        ("adapter serialize", f"{result['adapter_serialize_seconds_median'] * 1e3:.1f} ms"),
        ("peak GPU memory", f"{result['peak_memory_gib']:.1f} GiB" if result["peak_memory_gib"] else "-"),
    ]
    width = max(len(k) for k, _ in rows)
    print(f"trainer step on {result['device']} (torch {torch.__version__})")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
