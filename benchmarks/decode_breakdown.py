"""Where a decode step of the embedded engine goes: GPU time per kind of kernel, the host's
share, and the fraction of the HBM-bandwidth limit, per batch size and model shape.

    python benchmarks/decode_breakdown.py --out benchmarks/results/decode_breakdown_h200.json
    python benchmarks/decode_breakdown.py --tiny --out /tmp/bd.json           # CPU smoke run
    python benchmarks/decode_breakdown.py --shapes qwen2.5-1.5b --batches 64 \
        --variants fused_rope fused_kv fused_norm_kernel fused_swiglu fused_attention --out /tmp/bd.json

The engine's own decode path (`services.rollout.sampling.decode` with `DecodeGraphs`: static KV
cache, a CUDA graph per step variant) on a Qwen2-shaped model with random bf16 weights and an
r16 all-linear adapter merged as the head (`LoraSlots`, every row on the head: what serving the
newest version costs; `--mixes mixed25 mixed3`: rows on older versions too, whose correction
is in the step). A decode step is isolated by difference: two runs of the same rows, with
1 and with 1 + N new tokens, under the torch profiler; (long - short) / N is one step, prefill
excluded. Kernels are put into kinds by name (`KINDS`); the rest is reported by name, so
nothing is hidden. `host` is the wall time of a step minus the GPU's busy time in it: launch,
Python and synchronisation.

HBM limit: a decode step must read every weight once (bf16) and the KV cache of each row up to
its position; at the device's bandwidth (`--hbm-tbs`, H200: 4.8 TB/s) that takes `limit_ms`;
`fraction_of_limit` = limit_ms / step_ms.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.adapters import random_lora
from benchmarks.shapes import SHAPES
from benchmarks.timing import device_name, sync
from services.rollout.lora_slots import LoraSlots
from services.rollout.sampling import DecodeGraphs, Row, decode

# (kind, pattern on the kernel's name), first match wins
KINDS: list[tuple[str, re.Pattern]] = [
    ("attention", re.compile(r"flash|fmha|attention|attn|sdpa|softmax_warp|efficient", re.I)),
    ("gemm", re.compile(r"gemm|cutlass|xmma|nvjet|cublas|wgmma|matmul|splitK|sm90|Kernel2", re.I)),
    ("lora_correction", re.compile(r"shrink|expand|lora|_stacked|_fused", re.I)),
    # RMSNorm's mean is a reduce kernel too: norms first
    ("norm_rope_act", re.compile(r"rms|norm|rotary|rope|silu|swiglu|gelu|act_and_mul|pow|rsqrt|mean", re.I)),
    # the sampler's integer hash (int32 since the breakdown first ran; int64 before), and
    # sample_kernel's two launches (`_sample` was one, counted as "other" until they were two)
    (
        "sampling",
        re.compile(
            r"_sample_chunk|_sample_combine|sort|topk|multinomial|argmax|cumsum|gumbel|log_softmax|logsoftmax|max_|reduce|"
            r"bitwise|rshift|<long, long|<int, int|log_kernel",
            re.I,
        ),
    ),  # fmt: skip
    # also the casts (direct_copy, bfloat16_copy: 59 of each a step at 28 layers, 57 of them the
    # RMSNorms' to float32 and back until fused_norm_kernel), which are no KV write;
    # services.rollout.kv_write's is `_kv_write` (norm_kernel's `_rms_norm` is a norm, above)
    ("kv_write_copy", re.compile(r"copy|memcpy|memset|index_put|scatter|cat|fill|index|kv_write", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|unrolled|add|mul|where|neg|exp", re.I)),
]


VARIANTS = {
    "own": "the model's own attention (transformers' sdpa) and norms",
    "grouped": "services.rollout.decode_attention for the one-token step",
    "grouped_norm": "grouped, and services.rollout.fused_norm in place of the RMSNorms",
    "fused_rope": "grouped_norm, and services.rollout.rope_kernel for the rotary embedding",
    "fused_kv": "fused_rope, and services.rollout.kv_write for the KV-cache write (no module patched)",
    "fused_norm_kernel": "fused_kv, and services.rollout.norm_kernel for the RMSNorms (one launch each, no casts)",
    "fused_swiglu": "fused_norm_kernel, and services.rollout.swiglu_kernel for the MLPs' silu(gate) * up",
    "fused_attention": "fused_swiglu, and services.rollout.attention_kernel for the one-token attention",
    "fused_residual": "fused_attention, and services.rollout.decoder_layer for the residual adds (the first with the"
    " norm after it; o_proj's and down_proj's LoRA corrections in them)",
    "few_stretches": "fused_residual, and the attention's stretches sized for 128 programs, not 512 (at batch 64 one"
    " a (row, KV head): no merge launch)",
}
"""each variant is the one before it and one change more"""


SIDE_BY_SIDE_FROM = "fused_rope"
"""the first variant that `--side-by-side` takes: the earlier ones leave modules or patches on
the model (fused_norm's RMSNorms, the rope's module function) that the cells after them would
run with, so they are measured variant by variant"""


def stacks_on(variant: str, base: str) -> bool:
    """Whether `variant` includes `base`'s change (it is `base` or comes after it)."""
    order = list(VARIANTS)
    return order.index(variant) >= order.index(base)


SWITCHED = {
    "fused_norm_kernel": "LORABUS_FUSED_NORM_KERNEL",
    "fused_swiglu": "LORABUS_FUSED_SWIGLU",
    "fused_attention": "LORABUS_FUSED_ATTENTION",
    "fused_residual": "LORABUS_FUSED_RESIDUAL",
}
"""the variants whose kernel is switched by the environment, read at each call"""

SET = {"few_stretches": ("LORABUS_ATTENTION_PROGRAMS", "128")}
"""the variants that set an environment variable to a value (unset for the others)"""


@contextlib.contextmanager
def kernel_switches(variant: str):
    """The switched kernels on or off for one variant, the environment as it was after. A switch
    is read at each call, so a variant's graphs capture what it said; fused_norm's modules and
    the MLPs' routed forwards stay on the model across variants, and without this the kernels
    (the default on CUDA) would run in every variant that has them."""
    before = {env: os.environ.get(env) for env in [*SWITCHED.values(), *(env for env, _ in SET.values())]}
    for base, env in SWITCHED.items():
        os.environ[env] = "1" if stacks_on(variant, base) else "0"
    for base, (env, value) in SET.items():
        if stacks_on(variant, base):
            os.environ[env] = value
        else:
            os.environ.pop(env, None)
    try:
        yield
    finally:
        for env, value in before.items():
            if value is None:
                os.environ.pop(env, None)
            else:
                os.environ[env] = value


def kind_of(name: str) -> str:
    for kind, pat in KINDS:
        if pat.search(name):
            return kind
    return "other"


def qwen2(shape: str, tiny: bool, device, dtype):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if tiny:
        cfg = Qwen2Config(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024,
        )  # fmt: skip
    else:
        cfg = Qwen2Config(**SHAPES[shape], max_position_embeddings=32768)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg)
    return model.to(dtype).eval()


def kernel_times(fn, device) -> tuple[dict[str, float], dict[str, int]]:
    """GPU (or CPU-op) self time in µs per kernel name, and launch counts, while `fn` runs."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        fn()
        sync(device)
    times: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for ev in prof.events():
        if cuda and ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if not cuda and ev.cpu_parent is not None:  # CPU: top-level ops only, no double counting
            continue
        dur = ev.device_time if cuda else ev.cpu_time
        times[ev.name] += dur
        counts[ev.name] += 1
    return times, counts


def own_rope(model) -> None:
    """Undo `rope_kernel.use`: it patches the modeling module, which outlives one model, so a
    later shape's variants before `fused_rope` would run on the kernel too."""
    for module in {sys.modules[type(m).__module__] for m in model.modules()}:
        own = getattr(getattr(module, "apply_rotary_pos_emb", None), "lorabus_own", None)
        if own is not None:
            module.apply_rotary_pos_emb = own


MIXES = {
    "head": "every row on the newest version (merged into the weights)",
    "mixed25": "25 % of rows one version older (their low-rank correction in the step)",
    "mixed3": "50 % head, 25 % each on the two versions before it",
}
"""the rows' versions (`--mixes`), as benchmarks/embedded_engine.py mixes them"""


def row_versions(mix: str, batch: int, versions: list[int]) -> list[int]:
    """Each row's version for `mix`, `versions` oldest first (the last is the head)."""
    q, head = batch // 4, versions[-1]
    if mix == "mixed25":
        return [versions[-2]] * q + [head] * (batch - q)
    if mix == "mixed3":
        return [versions[-3]] * q + [versions[-2]] * q + [head] * (batch - 2 * q)
    return [head] * batch


def step_breakdown(
    model, slots, batch: int, prompt_len: int, steps: int, device, variant: str, versions: list[int]
) -> dict:
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, model.config.vocab_size, (batch, prompt_len), generator=g).tolist()
    graphs = DecodeGraphs(
        model,
        capture=device.type == "cuda",
        grouped_attention=stacks_on(variant, "grouped"),
        fused_norms=stacks_on(variant, "grouped_norm"),
        fused_rope=stacks_on(variant, "fused_rope"),
        # a cache of this DecodeGraphs' own: nothing outlives the variant, unlike the rope's patch
        fused_kv_write=stacks_on(variant, "fused_kv"),
        fused_mlp=stacks_on(variant, "fused_swiglu"),
        fused_residual=stacks_on(variant, "fused_residual"),
    )

    def run(new: int):
        rows = [Row(prompt=p, max_new_tokens=new, temperature=1.0, seed=i) for i, p in enumerate(prompts)]
        return lambda: decode(model, rows, step_context=lambda: slots.route(versions), graphs=graphs)

    short, long = run(1), run(1 + steps)
    long()  # captures every graph the long run needs (the short run's are a subset)
    short()

    def wall(fn, reps=3):
        best = float("inf")
        for _ in range(reps):
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            best = min(best, time.perf_counter() - t0)
        return best

    step_ms = (wall(long) - wall(short)) / steps * 1e3
    t_long, c_long = kernel_times(long, device)
    t_short, c_short = kernel_times(short, device)
    per_kernel = {
        k: ((t_long[k] - t_short.get(k, 0.0)) / steps, (c_long[k] - c_short.get(k, 0)) / steps) for k in t_long
    }
    by_kind: dict[str, float] = defaultdict(float)
    for name, (us, _) in per_kernel.items():
        by_kind[kind_of(name)] += us
    busy_ms = sum(by_kind.values()) / 1e3
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:25]
    cfg = model.config
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # KV read per step: every layer's K and V of each row up to its mean position
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    mean_len = prompt_len + steps / 2
    kv_bytes = 2 * cfg.num_hidden_layers * batch * mean_len * cfg.num_key_value_heads * head_dim * 2
    return {
        "batch": batch,
        "variant": variant,
        "step_ms": round(step_ms, 3),
        "tokens_per_s": round(batch / step_ms * 1e3, 1),
        "gpu_busy_ms": round(busy_ms, 3),
        "host_ms": round(step_ms - busy_ms, 3),
        "by_kind_ms": {k: round(v / 1e3, 4) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "kernels_per_step": round(sum(c for _, c in per_kernel.values()), 1),
        "top_kernels": [
            {"name": n[:120], "kind": kind_of(n), "us_per_step": round(us, 2), "launches_per_step": round(c, 2)}
            for n, (us, c) in top
        ],
        "weight_gb": round(weight_bytes / 1e9, 3),
        "kv_read_gb": round(kv_bytes / 1e9, 4),
        "graph_captures": graphs.captures,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tiny", action="store_true", help="tiny model on the CPU (smoke run)")
    ap.add_argument("--shapes", nargs="+", default=["qwen2.5-1.5b", "qwen2.5-7b"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64, help="decode steps measured (the long run's minus one)")
    ap.add_argument("--hbm-tbs", type=float, default=4.8, help="HBM bandwidth, TB/s")
    ap.add_argument(
        "--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS),
        help="decode paths side by side, run in this order (grouped_norm and the ones after it change the model "
        "for good: the norms and the rope's patch; the rope's is undone per shape, and the norm kernel is switched "
        "per variant)",
    )  # fmt: skip
    ap.add_argument("--mixes", nargs="+", choices=MIXES, default=["head"], help="the rows' versions (MIXES)")
    ap.add_argument(
        "--side-by-side", action="store_true",
        help="cells batch by batch and mix by mix, the variants next to each other in each (a call cut short "
        f"still brings pairs); for variants from {SIDE_BY_SIDE_FROM} on only",
    )  # fmt: skip
    args = ap.parse_args(argv)
    early = [v for v in args.variants if not stacks_on(v, SIDE_BY_SIDE_FROM)]
    if args.side_by_side and early:
        print(
            f"--side-by-side: variants {early} come before {SIDE_BY_SIDE_FROM}, whose rope patch stays on the "
            "model for the cells after it; drop them or --side-by-side",
            file=sys.stderr,
        )
        return 2
    device = torch.device("cpu" if args.tiny else "cuda")
    if not args.tiny and not torch.cuda.is_available():
        print("no CUDA device: use --tiny for a CPU run", file=sys.stderr)
        return 2
    dtype = torch.float32 if args.tiny else torch.bfloat16
    shapes = ["tiny"] if args.tiny else args.shapes
    batches = [1, 4] if args.tiny else args.batches
    out: dict = {"device": device_name(device), "torch": torch.__version__, "prompt_len": args.prompt_len,
                 "steps": args.steps, "hbm_tbs": args.hbm_tbs, "runs": []}  # fmt: skip
    for shape in shapes:
        model = qwen2(shape, args.tiny, device, dtype)
        own_rope(model)
        # three versions, oldest first, the newest the head; made before the slots replace the layers
        adapters = [random_lora(model, 16, seed=100 + v, dtype=dtype, b_scale=0.02) for v in range(3)]
        slots = LoraSlots.install(model, adapters[0], slots=4)
        for v, adapter in enumerate(adapters):
            slots.load(v, adapter, 2.0)
        slots.set_head(2)
        own = model.config._attn_implementation
        cells = [(v, mix, b) for v in VARIANTS if v in args.variants for mix in args.mixes for b in batches]
        if args.side_by_side:
            cells = [(v, mix, b) for b in batches for mix in args.mixes for v in VARIANTS if v in args.variants]
        for variant, mix, batch in cells:
            model.config._attn_implementation = own  # "grouped" switches it; "own" runs on what was loaded
            versions = row_versions(mix, batch, [0, 1, 2])
            try:
                with kernel_switches(variant):
                    r = step_breakdown(model, slots, batch, args.prompt_len, args.steps, device, variant, versions)
            except torch.OutOfMemoryError as exc:
                r = {"batch": batch, "variant": variant, "error": f"out of memory: {exc}"[:300]}
                torch.cuda.empty_cache()
            r["shape"], r["mix"] = shape, mix
            if "step_ms" in r:
                limit_ms = (r["weight_gb"] + r["kv_read_gb"]) / (args.hbm_tbs * 1e3) * 1e3
                r["limit_ms"] = round(limit_ms, 4)
                r["fraction_of_limit"] = round(limit_ms / r["step_ms"], 3)
                kinds = ", ".join(f"{k} {v:.2f}" for k, v in list(r["by_kind_ms"].items())[:6])
                print(
                    f"{shape} batch {batch} {r['variant']} {mix}: step {r['step_ms']:.2f} ms "
                    f"({r['tokens_per_s']:,.0f} tok/s), GPU busy "
                    f"{r['gpu_busy_ms']:.2f}, host {r['host_ms']:.2f}; {kinds}; {r['kernels_per_step']:.0f} "
                    f"kernels; limit {limit_ms:.3f} ms = {r['fraction_of_limit']:.1%}",
                    flush=True,
                )
            out["runs"].append(r)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(out, indent=2) + "\n")
        del model, slots
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
