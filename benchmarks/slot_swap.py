"""The two halves of a hot-swap in the embedded engine's slots, each against the per-module way
it replaced, side by side in one run on the same slot buffers.

    python benchmarks/slot_swap.py --out benchmarks/results/slot_swap_cpu.json   # CPU, narrow
    python benchmarks/slot_swap.py --narrow 1 --out slot_swap_h200.json          # CUDA, full size

The decoder layers' linear layers of a Qwen2.5 shape (no embedding, no attention: a swap
touches only these), bf16, LoRA r=16 on all seven targets of every layer, and per version:
  load  pool        `LoraSlots.load`: A by one multi-tensor copy, every shape's B^T by one cat
                    and one transposing multiply into the buffer that shape's groups share
        per_module  `_foreach_copy_` of A and of B into the slot views, then `_foreach_mul_`
                    by the scale. B's views are transposed, so the multi-tensor fast path does
                    not apply to them: each module's B is its own copy and multiply
  merge pool        `LoraSlots.set_head`: one batched matmul per member of each group shape
                    (torch's baddbmm: W0 copied into W, then a GEMM that reads and writes W)
        per_module  `addmm(W0, B, A, out=W)` for each module
        pool_triton `set_head` with `merge_kernel`: `lora_merge`'s kernel reads W0 and writes W
                    once (where Triton runs: a CUDA device in half precision)
The sources are on the slots' device (a replica copies the adapter there first, its h2d stage).
`--narrow K` divides the widths by K: the bytes shrink and what is left is the per-op cost,
the part a GPU launch pays (37 MB at full width is a few microseconds of H200 bandwidth).
"aten calls" counts what one call makes (torch.profiler); on a GPU, about its launches. Both
ways must write the same slot bytes; the merged weights are compared (matmuls of another
shape may round differently).
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
from benchmarks.adapters import random_lora
from benchmarks.shapes import SHAPES
from benchmarks.timing import device_name, median_ms, timed
from services.rollout import lora_kernels
from services.rollout.lora_slots import LoraSlots

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
    p.add_argument("--loads", type=int, default=40, help="timed rounds (after two warm-up rounds)")
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

    def per_module_merge(v: int) -> None:
        slot = pool.table.slot_of(v)
        for l in layers:
            torch.addmm(l.w0, l.b[slot], l.a[slot], out=l.weight.data)

    def pool_triton_merge(v: int) -> None:
        pool.merge_kernel = True
        try:
            pool.set_head(v)
        finally:
            pool.merge_kernel = False

    ways: dict[str, dict[str, Callable[[int], None]]] = {
        "load": {"pool": pool_load, "per_module": per_module_load},
        "merge": {"pool": pool.set_head, "per_module": per_module_merge},
    }
    if lora_kernels.kernel_available(device, torch.bfloat16):
        ways["merge"]["pool_triton"] = pool_triton_merge

    def slot_bytes(v: int) -> torch.Tensor:
        slot = pool.table.slot_of(v)
        return torch.cat([t for l in layers for t in (l.a[slot].flatten(), l.b[slot].flatten())])

    pool.load(0, versions[0], SCALE)
    pool.set_head(0)
    calls: dict[str, dict[str, int]] = {stage: {} for stage in ways}
    for name, load in ways["load"].items():
        calls["load"][name] = aten_calls(lambda: load(1))
        pool.unload(1)
    pool.load(1, versions[1], SCALE)
    merged: list[torch.Tensor] = []
    merge_diff: dict[str, float] = {}
    for name, merge in ways["merge"].items():
        calls["merge"][name] = aten_calls(lambda: merge(1))
        if not merged:
            merged = [l.weight.detach().clone() for l in layers]
        else:
            merge_diff[name] = max(float((l.weight.float() - w.float()).abs().max()) for l, w in zip(layers, merged))
        pool.set_head(0)
    del merged
    pool.unload(1)
    seconds: dict[str, dict[str, list[float]]] = {stage: {name: [] for name in ways[stage]} for stage in ways}
    same = True
    for i in range(args.loads + 2):  # the first two rounds warm up
        v = 2 + i
        written = []
        for name, load in ways["load"].items():
            seconds["load"][name].append(timed(lambda: load(v), device))
            written.append(slot_bytes(v))
            pool.unload(v)
        same &= torch.equal(written[0], written[1])
        pool.load(v, versions[v % len(versions)], SCALE)
        for name, merge in ways["merge"].items():
            seconds["merge"][name].append(timed(lambda: merge(v), device))
            pool.set_head(0)
        pool.unload(v)

    p50 = {stage: {name: round(median_ms(s[2:]), 3) for name, s in by.items()} for stage, by in seconds.items()}
    res = {
        "device": device_name(device),
        "torch": torch.__version__,
        "shape": args.shape,
        "narrow": narrow,
        "modules": len(layers),
        "adapter_mb": round(adapter_mb, 2),
        "rounds": args.loads,
        "ms_p50": p50,
        "aten_calls": calls,
        "per_module_over_pool": {stage: round(by["per_module"] / by["pool"], 2) for stage, by in p50.items()},
        "over_pool": {stage: {name: round(ms / by["pool"], 2) for name, ms in by.items()} for stage, by in p50.items()},
        "same_slot_bytes": same,
        "merged_max_abs_diff": merge_diff,
    }
    print(
        f"hot-swap halves, {args.shape} linears / {narrow}, {len(layers)} modules, {adapter_mb:.1f} MB, {res['device']}"
    )
    print(f"  {'stage':<7}{'way':<12}{'p50 ms':>9}{'aten calls':>12}")
    for stage, by in p50.items():
        for name, ms in by.items():
            print(f"  {stage:<7}{name:<12}{ms:>9.3f}{calls[stage][name]:>12}")
    ratio = res["per_module_over_pool"]
    print(f"  per_module / pool: load {ratio['load']}x, merge {ratio['merge']}x")
    print(f"  same slot bytes: {same}; merged weights' largest difference from the pool's: {merge_diff}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=2) + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
