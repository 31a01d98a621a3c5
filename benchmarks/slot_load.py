"""Loading a version into the embedded engine's slots: the pool's load against the per-module
copy it replaced, side by side in one run, on the same slot buffers.

    python benchmarks/slot_load.py --out benchmarks/results/slot_load_cpu.json   # CPU, narrow
    python benchmarks/slot_load.py --narrow 1 --out slot_load_h200.json          # CUDA, full size

The decoder layers' linear layers of a Qwen2.5 shape (no embedding, no attention: a load
touches only these), bf16, LoRA r=16 on all seven targets of every layer, and per version:
  pool        `LoraSlots.load`: A by one multi-tensor copy, every shape's B^T by one cat and
              one transposing multiply into the buffer that shape's groups share
  per_module  the previous load: `_foreach_copy_` of A and of B into the slot views, then
              `_foreach_mul_` by the scale. B's views are transposed, so the multi-tensor fast
              path does not apply and each module's B is its own copy and multiply
  merge       `LoraSlots.set_head`, the re-merge of the head from W0 (for the record)
The sources are on the slots' device (a replica copies the adapter there first, its h2d stage).
`--narrow K` divides the widths by K: the copies shrink and what is left is the per-op cost,
the part a GPU launch pays (37 MB at full width is a few microseconds of H200 bandwidth).
"ops" counts the aten calls one load makes (torch.profiler), on a GPU about its launches.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.adapters import random_lora  # noqa: E402
from benchmarks.shapes import SHAPES  # noqa: E402
from benchmarks.timing import device_name, median_ms, timed  # noqa: E402
from services.rollout.lora_slots import LoraSlots  # noqa: E402

RANK, SCALE = 16, 2.0


def decoder_linears(shape: str, narrow: int, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """`model.layers.i.{self_attn,mlp}.*_proj` as in the HF model, and nothing else."""
    cfg = SHAPES[shape]
    hidden, inter = cfg["hidden_size"] // narrow, cfg["intermediate_size"] // narrow
    kv = hidden // cfg["num_attention_heads"] * cfg["num_key_value_heads"]

    def layer() -> nn.Module:
        attn = nn.Module()
        for name, out in (("q_proj", hidden), ("k_proj", kv), ("v_proj", kv), ("o_proj", hidden)):
            setattr(attn, name, nn.Linear(hidden, out, bias=False))
        mlp = nn.Module()
        for name, (i, o) in (
            ("gate_proj", (hidden, inter)),
            ("up_proj", (hidden, inter)),
            ("down_proj", (inter, hidden)),
        ):
            setattr(mlp, name, nn.Linear(i, o, bias=False))
        block = nn.Module()
        block.self_attn, block.mlp = attn, mlp
        return block

    root, model = nn.Module(), nn.Module()
    model.layers = nn.ModuleList(layer() for _ in range(cfg["num_hidden_layers"]))
    root.model = model
    return root.to(dtype=dtype, device=device)


def aten_calls(fn: Callable[[], object]) -> int:
    from torch.profiler import profile

    with profile() as prof:
        fn()
    return sum(1 for e in prof.events() if e.name.startswith("aten::"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen2.5-1.5b", choices=sorted(SHAPES))
    p.add_argument("--narrow", type=int, default=None, help="divide the widths by this (default: 1 on CUDA, 16 on CPU)")
    p.add_argument("--loads", type=int, default=40)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    narrow = args.narrow or (1 if device.type == "cuda" else 16)
    torch.manual_seed(0)
    model = decoder_linears(args.shape, narrow, torch.bfloat16, device)
    versions = [
        {k: t.to(device) for k, t in random_lora(model, RANK, seed=v, dtype=torch.bfloat16, b_scale=0.02).items()}
        for v in range(4)
    ]
    pool = LoraSlots.install(model, versions[0], slots=2)
    layers = list(pool.layers.values())
    paths = list(pool.layers)
    adapter_mb = sum(t.numel() * t.element_size() for t in versions[0].values()) / 1e6

    def pool_load(v: int) -> None:
        pool.load(v, versions[v % len(versions)], SCALE)

    def per_module_load(v: int) -> None:
        tensors = versions[v % len(versions)]
        slot = pool.table.assign(v)
        a_views, b_views = [l.a[slot] for l in layers], [l.b[slot] for l in layers]
        torch._foreach_copy_(a_views, [tensors[f"base_model.model.{q}.lora_A.weight"] for q in paths])
        torch._foreach_copy_(b_views, [tensors[f"base_model.model.{q}.lora_B.weight"] for q in paths])
        torch._foreach_mul_(b_views, SCALE)

    loads = {"pool": pool_load, "per_module": per_module_load}
    pool.load(0, versions[0], SCALE)
    pool.set_head(0)

    def slot_contents(v: int) -> torch.Tensor:
        slot = pool.table.slot_of(v)
        return torch.cat([t for l in layers for t in (l.a[slot].flatten(), l.b[slot].flatten())])

    ops = {}
    for name, load in loads.items():
        ops[name] = aten_calls(lambda: load(1))
        pool.unload(1)
    seconds: dict[str, list[float]] = {name: [] for name in loads}
    merge_s, same = [], True
    for i in range(args.loads + 2):  # the first two rounds warm up
        v = 1 + i
        contents = []
        for name, load in loads.items():
            took = timed(lambda: load(v), device)
            contents.append(slot_contents(v))
            if i >= 2:
                seconds[name].append(took)
            pool.unload(v)
        same &= all(torch.equal(contents[0], c) for c in contents[1:])
        pool.load(v, versions[v % len(versions)], SCALE)
        merge_s.append(timed(lambda: pool.set_head(v), device))
        pool.set_head(0)
        pool.unload(v)

    res = {
        "device": device_name(device),
        "torch": torch.__version__,
        "shape": args.shape,
        "narrow": narrow,
        "modules": len(layers),
        "adapter_mb": round(adapter_mb, 2),
        "loads": args.loads,
        "same_slot_contents": same,
        "load_ms_p50": {name: round(median_ms(s), 3) for name, s in seconds.items()},
        "aten_calls_per_load": ops,
        "merge_ms_p50": round(median_ms(merge_s[2:]), 3),
    }
    res["per_module_over_pool"] = round(res["load_ms_p50"]["per_module"] / res["load_ms_p50"]["pool"], 2)
    print(f"slot load, {args.shape} linears / {narrow}, {len(layers)} modules, {adapter_mb:.1f} MB, {res['device']}")
    print(f"  {'path':<12}{'p50 ms':>9}{'aten calls':>12}")
    for name in loads:
        print(f"  {name:<12}{res['load_ms_p50'][name]:>9.3f}{ops[name]:>12}")
    print(f"  per_module / pool: {res['per_module_over_pool']}x; merge p50 {res['merge_ms_p50']} ms")
    print(f"  both loads wrote the same slot contents: {same}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=2) + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
