"""A replica's adapter load, event received to version servable, by stage; against the in-slot
swap it cannot beat, measured side by side in one run.

    python benchmarks/adapter_load.py --out benchmarks/results/adapter_load_h200.json   # CUDA
    python benchmarks/adapter_load.py --tiny --out /tmp/adapter_load.json              # CPU smoke

For each shape and LoRA rank (all-linear, bf16): an embedded engine on a model with random weights
and a local directory store holding the versions (the bytes are local: written just before, so
in the page cache). Each measured load runs the replica's own code:
  fast      `load_path.Stager.load` (what a replica runs on `adapter.vN.ready`): fetch into a
            pinned buffer, parse in place, one H2D copy, copy into the slot, head re-merge;
            sha256 on a background thread (its time is reported, not part of "servable")
  verified  the verify-first path (what a server engine or a retry after a failed check runs):
            `store.get_bytes` with size and sha256 checked, safetensors parse, load from host
  swap      the in-slot swap alone: copy from tensors already on the device + re-merge
  inline    what hashing while reading would cost: fetch + sha256 in sequence (the fast
            path's own measured stages)
Targets (issue 13): fast <= 2x the swap and <= 25 ms for the 37 MB adapter of the
Qwen2.5-1.5B shape (r=16) on an H200, and linear in adapter size.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.adapters import adapter_event, random_lora
from benchmarks.shapes import build
from benchmarks.timing import device_name, median_ms, sync
from proto.messages import LoraSpec, ObjectPayload
from services.common import adapter_io
from services.common.lora_targets import HF_LINEAR
from services.common.store import LocalStore
from services.rollout.engines.embedded import EmbeddedEngine
from services.rollout.load_path import Stager

SLOTS = 4


def p50(xs: list[float]) -> float:
    return round(median_ms(xs), 3)


def measure(shape: str, rank: int, loads: int, device: torch.device, dtype: torch.dtype, tiny: bool) -> dict:
    model = build(shape, device, dtype) if not tiny else build_tiny(device, dtype)
    engine = EmbeddedEngine(model, eos_ids=[2], pad_id=0, slots=SLOTS, cuda_graphs=False)
    lora = LoraSpec(rank=rank, alpha=2.0 * rank, target_modules=list(HF_LINEAR), base_model=shape)
    versions = 3  # distinct weights, cycled
    tensors = [random_lora(model, rank, seed=v, dtype=dtype, b_scale=0.01) for v in range(versions)]
    data = [adapter_io.to_bytes(t) for t in tensors]
    on_device = [{k: v.to(device) for k, v in t.items()} for t in tensors]
    with tempfile.TemporaryDirectory() as tmp:
        store = LocalStore(tmp)
        refs = [store.put_bytes(f"run/adapters/v{v}/adapter_model.safetensors", d) for v, d in enumerate(data)]
        stager = Stager(engine, lambda uri: store)
        rows: dict[str, list[float]] = {k: [] for k in ("fast", "verified", "swap", "inline")}
        stages: dict[str, list[float]] = {k: [] for k in ("fetch", "parse", "h2d", "copy", "merge", "verify")}
        version = 0

        def free_a_slot() -> None:
            assert engine.slots is not None
            loaded = engine.slots.versions()
            if len(loaded) >= SLOTS:
                engine._unload(min(v for v in loaded if v != engine.slots.head))

        warmup = 2
        for i in range(warmup + loads):
            for way in ("fast", "verified", "swap"):
                if engine.slots is not None:
                    free_a_slot()
                k = version % versions
                ref = refs[k]
                ev = adapter_event(
                    version, lora, [ObjectPayload(uri=ref.uri, bytes=ref.bytes, sha256=ref.sha256)], run="run"
                )
                sync(device)
                t0 = time.perf_counter()
                if way == "fast":
                    staged = stager.load(ev)
                    elapsed = time.perf_counter() - t0
                    staged.verified.result(timeout=60)
                    t = staged.times
                    if i >= warmup:
                        for stage in stages:
                            stages[stage].append(getattr(t, stage))
                        rows["inline"].append(t.servable_s + (t.verify or 0.0))
                elif way == "verified":
                    raw = store.get_bytes(ref.uri, sha256=ref.sha256, size=ref.bytes)
                    engine.swap_in(version, adapter_io.from_bytes(raw), lora)
                    elapsed = time.perf_counter() - t0
                else:
                    engine.swap_in(version, on_device[k], lora)
                    elapsed = time.perf_counter() - t0
                if i >= warmup:
                    rows[way].append(elapsed)
                version += 1
        stager.close()
    mb = len(data[0]) / 1e6
    out = {
        "shape": shape,
        "rank": rank,
        "adapter_mb": round(mb, 2),
        "tensors": len(tensors[0]),
        "loads": loads,
        "p50_ms": {k: p50(v) for k, v in rows.items()},
        "stages_p50_ms": {k: p50(v) for k, v in stages.items()},
    }
    out["fast_vs_swap"] = round(out["p50_ms"]["fast"] / out["p50_ms"]["swap"], 2)
    out["verified_vs_fast"] = round(out["p50_ms"]["verified"] / out["p50_ms"]["fast"], 1)
    return out


def build_tiny(device, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=259,
    )  # fmt: skip
    return LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def linear_fit(points: list[tuple[float, float]]) -> dict:
    """Least squares ms = a + b * MB, and the worst relative deviation of a point from it."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    a = my - b * mx
    worst = max(abs(y - (a + b * x)) / y for x, y in points)
    return {"ms_at_0_mb": round(a, 3), "ms_per_mb": round(b, 4), "worst_relative_residual": round(worst, 3)}


def table(results: list[dict]) -> str:
    head = (
        "| shape | rank | MB | servable (fast) | fetch | parse | h2d | copy | merge | verify (beside) "
        "| swap alone | fast / swap | verify-first path |\n|" + "---|" * 13
    )
    lines = [head]
    for r in results:
        s, p = r["stages_p50_ms"], r["p50_ms"]
        lines.append(
            f"| {r['shape']} | {r['rank']} | {r['adapter_mb']} | **{p['fast']:.1f}** | {s['fetch']:.1f} | "
            f"{s['parse']:.2f} | {s['h2d']:.1f} | {s['copy']:.1f} | {s['merge']:.1f} | {s['verify']:.1f} | "
            f"{p['swap']:.1f} | {r['fast_vs_swap']:.2f} | {p['verified']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny model on CPU (smoke run)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--loads", type=int, default=10)
    ap.add_argument("--ranks", default="4,8,16,32,64", help="ranks for the 1.5B shape")
    ap.add_argument("--big-rank", type=int, default=16, help="rank for the 7B shape (0: skip it)")
    args = ap.parse_args(argv)
    tiny = args.tiny
    device = torch.device("cuda" if torch.cuda.is_available() and not tiny else "cpu")
    dtype = torch.float32 if tiny else torch.bfloat16
    plan = [("qwen2.5-1.5b", int(r)) for r in args.ranks.split(",")]
    if args.big_rank:
        plan.append(("qwen2.5-7b", args.big_rank))
    if tiny:
        plan = [("tiny", r) for r in (2, 4, 8)]
    res: dict = {
        "device": device_name(device),
        "torch": torch.__version__,
        "dtype": str(dtype),
        "results": [],
        "errors": {},
    }
    for shape, rank in plan:
        try:
            row = measure(shape, rank, 3 if tiny else args.loads, device, dtype, tiny)
        except Exception as exc:  # one shape failing must not lose the others' figures
            res["errors"][f"{shape} r{rank}"] = repr(exc)
            print(f"{shape} r{rank}: {exc!r}", file=sys.stderr)
            continue
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the model of this shape is gone with measure()'s frame
        res["results"].append(row)
        print(json.dumps(row), flush=True)
        args.out.write_text(json.dumps(res, indent=2) + "\n")
    small = [r for r in res["results"] if r["shape"] != "qwen2.5-7b"]
    if len(small) >= 2:
        res["fast_linear_fit"] = linear_fit([(r["adapter_mb"], r["p50_ms"]["fast"]) for r in small])
    args.out.write_text(json.dumps(res, indent=2) + "\n")
    print(table(res["results"]))
    if "fast_linear_fit" in res:
        print(f"fit: {res['fast_linear_fit']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
