"""XCCL on one GPU: the parts one process can time (the broadcast itself needs two GPUs, issue 8).

    python benchmarks/gpu_xccl_single.py [--out gpu_xccl_single.json] [--reps 20]

Qwen2.5-1.5B-shaped model with random weights (bf16 on cuda), LoRA r=16 on all linear layers
(37 MB bf16). Timed, cuda-synchronised, median of `--reps`:
  pack     adapter tensors (as the trainer holds them, on the GPU) -> flat buckets
           (`services.common.xccl.pack`, `actor.xccl_bucket_mb` per bucket)
  unpack   bucket views for the receiver (`xccl.unpack`, no copy)
  copy     staged views -> a free version slot (`LoraSlots.load`: in-place copies)
  swap     merge the new head into every weight (`LoraSlots.set_head`: one addmm per module)
  total    pack + unpack + copy + swap, i.e. everything but the wire
Imports torch, transformers and our torch-only modules (`services.common.xccl` imports
`proto.messages`, which needs msgspec: the lead carries the wheel in benchmarks/wheels/).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.shapes import SHAPES
from benchmarks.timing import device_name, median_ms, timed
from services.common import xccl
from services.common.lora_targets import HF_LINEAR
from services.rollout.lora_slots import LoraSlots


def build(device: torch.device, tiny: bool):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if tiny:
        cfg = Qwen2Config(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=512,
        )
    else:
        cfg = Qwen2Config(**SHAPES["qwen2.5-1.5b"])
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg)
    return model.to(torch.bfloat16).eval()


def targets(model) -> list[tuple[str, int, int]]:
    return [
        (name, mod.in_features, mod.out_features)
        for name, mod in model.named_modules()
        if isinstance(mod, torch.nn.Linear) and name.rsplit(".", 1)[-1] in HF_LINEAR
    ]


def adapter(mods, rank: int, seed: int, device) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, i, o in mods:
        base = f"base_model.model.{name}"
        out[f"{base}.lora_A.weight"] = torch.randn(rank, i, generator=g, device=device).bfloat16()
        out[f"{base}.lora_B.weight"] = torch.randn(o, rank, generator=g, device=device).bfloat16()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--bucket-mb", type=float, default=64.0)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run on a 2-layer model")
    ap.add_argument("--out", default="gpu_xccl_single.json")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    model = build(device, args.tiny)
    mods = targets(model)
    first = adapter(mods, args.rank, 0, device)
    manifest = xccl.manifest_of(first)
    plan = xccl.plan_buckets(manifest, xccl.bucket_bytes_of(args.bucket_mb))
    nbytes = sum(b.nbytes for b in plan)
    send_bufs = xccl.alloc_buckets(plan, device)
    recv_bufs = xccl.alloc_buckets(plan, device)  # what the broadcast would fill
    slots = LoraSlots.install(model, first, slots=4)
    scale = 2.0
    slots.load(0, first, scale)
    slots.set_head(0)

    times: dict[str, list[float]] = {k: [] for k in ("pack", "unpack", "copy", "swap", "total")}
    for rep in range(args.reps + 2):
        version = rep + 1
        tensors = adapter(mods, args.rank, version, device)
        t_pack = timed(lambda: xccl.pack(plan, tensors, send_bufs), device)
        torch._foreach_copy_(recv_bufs, send_bufs)  # stands in for the wire (two GPUs: issue 8)
        box = {}
        t_unpack = timed(lambda: box.update(v=xccl.unpack(plan, recv_bufs)), device)
        for old in [v for v in slots.versions() if v != slots.head]:
            slots.unload(old)
        t_copy = timed(lambda: slots.load(version, box["v"], scale), device)
        t_swap = timed(lambda: slots.set_head(version), device)
        if rep >= 2:  # warm-up: allocator, cuBLAS handles
            for k, v in zip(times, (t_pack, t_unpack, t_copy, t_swap, t_pack + t_unpack + t_copy + t_swap)):
                times[k].append(v)
        # the served head is exactly this version: W = W0 + s B A for one module
        path = next(iter(slots.layers))
        layer = slots.layers[path]
        a, b = tensors[f"base_model.model.{path}.lora_A.weight"], tensors[f"base_model.model.{path}.lora_B.weight"]
        ref = torch.addmm(layer.w0.float(), (scale * b).float(), a.float())
        assert torch.allclose(layer.weight.float(), ref, atol=0.1, rtol=0.02), "head merge mismatch"

    result = {
        "device": device_name(device),
        "adapter_bytes": nbytes,
        "tensors": len(manifest),
        "buckets": len(plan),
        "bucket_mb": args.bucket_mb,
        "rank": args.rank,
        "reps": args.reps,
        "torch": torch.__version__,
        "median_ms": {k: median_ms(v) for k, v in times.items()},
        "min_ms": {k: min(v) * 1e3 for k, v in times.items()},
    }
    print(f"{result['device']}: {nbytes / 1e6:.1f} MB in {len(plan)} buckets, {len(manifest)} tensors")
    for k in times:
        print(f"  {k:<7} {result['median_ms'][k]:8.2f} ms (min {result['min_ms'][k]:.2f})")
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
