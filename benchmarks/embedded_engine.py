"""Embedded engine vs peft: adapter hot-swap latency and generation tokens/s, in one run.

    python benchmarks/embedded_engine.py --out results.json          # CUDA, Qwen2.5-1.5B shape
    python benchmarks/embedded_engine.py --tiny --out tiny.json      # CPU smoke run
    TRITON_INTERPRET=1 python benchmarks/embedded_engine.py --tiny --static-cpu --skip-peft \
        --profile --out tiny.json    # CPU dry run of every GPU variant, kernels interpreted (~4 min)

Random weights from the Qwen2.5-1.5B config (bf16), LoRA r=16 on all linear layers (37 MB).
Every generation variant runs through the same decode loop (`services.rollout.sampling`), so
the differences are the LoRA serving path alone:
  base           the model without any adapter
  slots_head     our slots, every row on the merged head version
  slots_mixed25  our slots, 25% of rows pinned to an older version (low-rank correction)
  slots_mixed3   our slots, 50% head, 25% each on two older versions
  slots_*_graphs the slot pool's default on a GPU, `correction="auto"` with nothing measured:
                 `lora_kernels.DEFAULT_CHOICE` for every shape
  slots_*_tuned  "auto" after the per-shape tuning (`benchmarks/lora_tuning.py`, run first,
                 figures under "fused_tuning"): each shape's fastest correction
  slots_*_triton the two Triton kernels beside the layer's cuBLAS matmul (shrink on a side
                 stream, then the expand)
  slots_*_stacked  one cuBLAS matmul over W and the slots' A rows, then one expand kernel
  slots_*_fusedall  the fused GEMM+correction kernel for every shape, each shape's fastest tiles
  slots_*_torch  the correction in plain torch (the reference path) in the captured graphs
                 (eager forwards on a GPU always run the torch path)
  peft_unmerged  peft with one unmerged adapter
  peft_mixed2    peft, two adapters mixed in the batch through `adapter_names`
Each of base and slots_* runs twice: eager (DynamicCache, one Python forward per step) and
`*_graphs` (static KV cache, CUDA-graph replay of the decode step; CUDA only). Ratios are to
the base of the same technique: eager variants to eager base, graph variants to graph base.
Hot-swap: ours = copy into a free slot + re-merge of the head from W0 (cuda-synchronised),
from GPU-resident and from pinned host tensors; peft `load_adapter` from disk and peft
`hotswap_adapter` from disk. Imports torch/transformers/peft/safetensors and our torch-only
rollout modules only (the GPU image has nothing else).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import lora_tuning
from benchmarks.adapters import random_lora
from benchmarks.shapes import SHAPES
from benchmarks.timing import device_name, median_ms, sync, timed
from services.common.lora_targets import HF_LINEAR
from services.rollout import lora_kernels
from services.rollout.lora_slots import LoraSlots
from services.rollout.sampling import DecodeGraphs, Row, decode

TARGETS = list(HF_LINEAR)


def model_config(tiny: bool) -> Qwen2Config:
    if tiny:
        return Qwen2Config(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=512,
            max_position_embeddings=1024,
        )
    return Qwen2Config(**SHAPES["qwen2.5-1.5b"], max_position_embeddings=32768)


def build_model(cfg: Qwen2Config, device: torch.device, dtype: torch.dtype) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg)
    return model.to(dtype).eval()


def write_peft_dir(directory: Path, tensors: dict[str, torch.Tensor], rank: int, alpha: float) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": TARGETS,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "use_rslora": False,
        "use_dora": False,
        "base_model_name_or_path": "qwen2.5-1.5b-shaped",
    }
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory


def make_rows(batch: int, prompt_len: int, new_tokens: int, vocab: int) -> list[Row]:
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, vocab, (batch, prompt_len), generator=g).tolist()
    # no stop ids: every row runs the full length, so all variants do identical work
    return [Row(prompt=p, max_new_tokens=new_tokens, temperature=1.0, seed=i) for i, p in enumerate(prompts)]


def tokens_per_s(model, rows, device, step_context=None, forward_kwargs=None, repeats=2, graphs=None) -> float:
    kwargs = {"step_context": step_context} if step_context else {}
    # Graphs: warm up on the real shapes (the warm run captures); eager: a short run suffices.
    warm = rows if graphs is not None else [Row(prompt=r.prompt, max_new_tokens=4, seed=r.seed) for r in rows]
    decode(model, warm, forward_kwargs=forward_kwargs, graphs=graphs, **kwargs)
    best = min(
        timed(lambda: decode(model, rows, forward_kwargs=forward_kwargs, graphs=graphs, **kwargs), device)
        for _ in range(repeats)
    )
    return sum(r.max_new_tokens for r in rows) / best


def agreement(a, b) -> dict:
    """How close two decodes of the same rows are: first-token logprob, token agreement."""
    first = max(abs(x.logprobs[0] - y.logprobs[0]) for x, y in zip(a, b))
    same = sum(p == q for x, y in zip(a, b) for p, q in zip(x.token_ids, y.token_ids))
    total = sum(min(len(x.token_ids), len(y.token_ids)) for x, y in zip(a, b))
    prefix = [
        next((i for i, (p, q) in enumerate(zip(x.token_ids, y.token_ids)) if p != q), len(x.token_ids))
        for x, y in zip(a, b)
    ]
    return {
        "first_logprob_max_abs_diff": first,
        "token_match_frac": same / max(total, 1),
        "identical_prefix_mean": statistics.mean(prefix),
    }


def run_peft(model, versions, rows, device, args, res, tps, peft_loads, swaps, rank):
    """peft's load_adapter and hotswap_adapter latency, unmerged and two-adapter generation;
    returns the plain base model again (peft layers removed)."""
    from peft import LoraConfig, get_peft_model
    from peft.utils.hotswap import hotswap_adapter

    batch = len(rows)
    with tempfile.TemporaryDirectory() as tmp:
        dirs = [write_peft_dir(Path(tmp) / f"v{v}", versions[v], rank, args.alpha) for v in range(peft_loads + 1)]
        lcfg = LoraConfig(r=rank, lora_alpha=args.alpha, target_modules=TARGETS, lora_dropout=0.0)
        pm = get_peft_model(model, lcfg, adapter_name="default")
        pm.load_adapter(str(dirs[0]), adapter_name="default", is_trainable=False)
        pm.eval()
        load_s = []
        for i in range(1, peft_loads + 1):
            name = f"x{i}"
            load_s.append(
                timed(
                    lambda m=pm, d=dirs[i], n=name: m.load_adapter(str(d), adapter_name=n, is_trainable=False), device
                )
            )
            pm.delete_adapter(name)
        pm.set_adapter("default")
        hot_s = [
            timed(
                lambda m=pm, d=dirs[1 + i % peft_loads]: hotswap_adapter(
                    m, str(d), adapter_name="default", torch_device=str(device)
                ),
                device,
            )
            for i in range(swaps)
        ]
        res["peft_load_adapter_ms_p50"] = median_ms(load_s)
        res["peft_hotswap_adapter_ms_p50"] = median_ms(hot_s)
        tps["peft_unmerged"] = tokens_per_s(pm, rows, device)
        pm.load_adapter(str(dirs[0]), adapter_name="other", is_trainable=False)
        names = ["default" if i % 2 == 0 else "other" for i in range(batch)]
        tps["peft_mixed2"] = tokens_per_s(pm, rows, device, forward_kwargs={"adapter_names": names}, repeats=1)
        return pm.unload()


def kernel_profile(fn, device: torch.device) -> str:
    """The kernels `fn` ran, by self device time (torch profiler)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        sync(device)
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=30)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny model on CPU (smoke run)")
    ap.add_argument("--out", type=Path, required=True, help="JSON results file")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--swaps", type=int, default=None)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument(
        "--profile",
        action="store_true",
        help="kernel tables (torch profiler) of 32-token decodes into the JSON: head, 25%% older (two kernels, fused)",
    )
    ap.add_argument("--skip-peft", action="store_true", help="leave out the peft variants (unchanged by our code)")
    ap.add_argument(
        "--static-cpu",
        action="store_true",
        help="with --tiny: run the *_graphs variants' static-cache path eagerly (no capture)",
    )
    args = ap.parse_args(argv)

    tiny = args.tiny
    device = torch.device("cpu" if tiny or not torch.cuda.is_available() else "cuda")
    if not tiny and device.type != "cuda":
        print("no CUDA device: use --tiny for a CPU smoke run", file=sys.stderr)
        return 2
    dtype = torch.float32 if tiny else torch.bfloat16
    batch = args.batch or (4 if tiny else 64)
    new_tokens = args.new_tokens or (8 if tiny else 128)
    prompt_len = args.prompt_len or (8 if tiny else 128)
    swaps = args.swaps or (5 if tiny else 20)
    peft_loads = 3 if tiny else 5
    rank, scale = args.rank, args.alpha / args.rank
    keep = 3
    cfg = model_config(tiny)
    res: dict = {
        "device": device_name(device),
        "torch": torch.__version__,
        "dtype": str(dtype),
        "batch": batch,
        "new_tokens": new_tokens,
        "prompt_len": prompt_len,
        "rank": rank,
        "tiny": tiny,
    }
    import peft
    import transformers

    res["transformers"], res["peft"] = transformers.__version__, peft.__version__
    model = build_model(cfg, device, dtype)
    versions = {v: random_lora(model, rank, seed=100 + v, dtype=dtype, b_scale=0.02) for v in range(swaps + 2)}
    adapter_bytes = sum(t.numel() * t.element_size() for t in versions[0].values())
    res["adapter_mb"] = adapter_bytes / 1e6
    res["adapter_params"] = sum(t.numel() for t in versions[0].values())
    rows = make_rows(batch, prompt_len, new_tokens, cfg.vocab_size)
    tps: dict[str, float] = {}
    print(f"device {res['device']}, adapter {res['adapter_mb']:.1f} MB, batch {batch} x {new_tokens} new tokens")

    errors: dict[str, str] = {}
    res["errors"] = errors
    capture = device.type == "cuda"
    use_graphs = capture or args.static_cpu

    def save() -> None:
        res["tokens_per_s"] = tps
        args.out.write_text(json.dumps(res, indent=2))

    def attempt(name, fn):
        """Graph variants are new: one failing must not cost the run's other figures."""
        try:
            out = fn()
        except Exception as e:  # recorded in the results and printed
            import traceback

            errors[name] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
            out = None
        save()
        return out

    tps["base"] = tokens_per_s(model, rows, device)
    print(f"base eager {tps['base']:.0f} tok/s", flush=True)
    if use_graphs:
        base_graphs = DecodeGraphs(model, capture=capture)
        tps_g = attempt("base_graphs", lambda: tokens_per_s(model, rows, device, graphs=base_graphs, repeats=3))
        if tps_g:
            tps["base_graphs"] = tps_g
            print(f"base graphs {tps_g:.0f} tok/s", flush=True)
            check = rows[: min(16, batch)]
            res["base_graphs_vs_eager"] = attempt(
                "base_graphs_check", lambda: agreement(decode(model, check), decode(model, check, graphs=base_graphs))
            )
        del base_graphs
        if capture:
            torch.cuda.empty_cache()

    # --- peft: load_adapter from disk, hotswap_adapter, unmerged generation ---
    if not args.skip_peft:
        model = run_peft(model, versions, rows, device, args, res, tps, peft_loads, swaps, rank)

    tps["base_again"] = tokens_per_s(model, rows, device)  # run-to-run noise, same model
    if use_graphs and "base_graphs" in tps:
        base_graphs = DecodeGraphs(model, capture=capture)
        tps_g = attempt("base_graphs_again", lambda: tokens_per_s(model, rows, device, graphs=base_graphs, repeats=3))
        if tps_g:
            tps["base_graphs_again"] = tps_g
        del base_graphs
        if capture:
            torch.cuda.empty_cache()
    save()

    # --- our slots ---
    slots = LoraSlots.install(model, versions[0], slots=keep + 1)
    res["w0_copy_gb"] = sum(l.w0.numel() * l.w0.element_size() for l in slots.layers.values()) / 1e9
    res["slot_buffers_gb"] = sum((l.a.numel() + l.b.numel()) * l.a.element_size() for l in slots.layers.values()) / 1e9
    on_gpu = {v: {k: t.to(device) for k, t in versions[v].items()} for v in versions}
    pinned = (
        {v: {k: t.pin_memory() for k, t in versions[v].items()} for v in versions}
        if device.type == "cuda"
        else versions
    )
    copy_s, merge_s, total_s, host_total_s = [], [], [], []
    for v in range(swaps + 2):
        source = on_gpu if v % 2 == 0 else pinned
        if len(slots.versions()) == keep + 1:
            slots.unload(min(slots.versions()))
        sync(device)
        t0 = time.perf_counter()
        slots.load(v, source[v], scale)
        sync(device)
        t1 = time.perf_counter()
        slots.set_head(v)
        sync(device)
        t2 = time.perf_counter()
        if v >= 2:  # the first loads warm up kernels and allocator
            (total_s if source is on_gpu else host_total_s).append(t2 - t0)
            if source is on_gpu:
                copy_s.append(t1 - t0)
                merge_s.append(t2 - t1)
    res["slots_swap_ms_p50_from_gpu"] = median_ms(total_s)
    res["slots_swap_ms_p50_from_pinned_host"] = median_ms(host_total_s)
    res["slots_copy_ms_p50"] = median_ms(copy_s)
    res["slots_merge_ms_p50"] = median_ms(merge_s)
    res["correction"] = slots.routing.correction
    head = slots.head
    assert head is not None
    older = sorted(v for v in slots.versions() if v != head)

    def routed(row_versions):
        return lambda: slots.route(row_versions)

    q = batch // 4
    mixes = {
        "slots_head": [head] * batch,
        "slots_mixed25": [older[-1]] * q + [head] * (batch - q),
        "slots_mixed3": [older[-2]] * q + [older[-1]] * q + [head] * (batch - 2 * q),
    }
    mixed25 = mixes["slots_mixed25"]
    for name, mix in mixes.items():
        got = attempt(name, lambda: tokens_per_s(model, rows, device, step_context=routed(mix)))
        if got is None and slots.routing.correction != "torch":
            # a kernel that does not run here must not cost the other figures: the reference
            slots.routing.correction = "torch"
            res["correction"] = "torch (kernel failed)"
            got = attempt(f"{name}_torch", lambda: tokens_per_s(model, rows, device, step_context=routed(mix)))
        if got:
            tps[name] = got
            print(f"{name} eager {got:.0f} tok/s", flush=True)
    kernels = slots.routing.correction != "torch"

    # the fused kernel's tiles (and where it beats the two kernels), measured per group shape
    tuning = None
    if kernels:
        res["stacked_tiles"] = attempt(
            "stacked_tiles", lambda: lora_tuning.sweep_stacked(slots, mixes["slots_mixed3"], device, capture)
        )
        tuning = attempt("fused_tuning", lambda: lora_tuning.tune(slots, mixes["slots_mixed3"], device, capture))
        if tuning:
            res["fused_tuning"] = tuning.report
    if use_graphs and "base_graphs" in tps:
        # Each correction in its own graphs, one after another: "" the pool's default (the
        # reference where kernels do not run), "_tuned" the tuned choice per shape, then every
        # path forced on every shape.
        variants: list[tuple[str, lora_kernels.Mode, dict]] = [("", slots.routing.correction, {})]
        if tuning:
            variants.append(("_tuned", "auto", tuning.chosen))
        if kernels:
            variants += [("_triton", "triton", {}), ("_stacked", "stacked", {})]
        if tuning:
            variants.append(("_fusedall", "fused", tuning.best_fused))
        if kernels:
            variants.append(("_torch", "torch", {}))
        check = rows[: min(16, batch)]
        mix3 = mixes["slots_mixed3"]
        mix_check = [mix3[i * batch // len(check)] for i in range(len(check))]  # every version present
        for suffix, correction, tuned in variants:
            slots.routing.correction = correction
            lora_kernels.TUNED.clear()
            lora_kernels.TUNED.update(tuned)
            slot_graphs = DecodeGraphs(model, capture=capture)
            for name in mixes if not suffix else ("slots_mixed25", "slots_mixed3"):
                got = attempt(
                    f"{name}{suffix}_graphs",
                    lambda: tokens_per_s(
                        model, rows, device, step_context=routed(mixes[name]), graphs=slot_graphs, repeats=3
                    ),
                )
                if got:
                    tps[f"{name}{suffix}_graphs"] = got
                    print(f"{name}{suffix} graphs {got:.0f} tok/s", flush=True)
            if not suffix:
                res["graph_captures_slots"] = slot_graphs.captures
            if suffix in ("", "_tuned"):
                res[f"slots_mixed3{suffix}_graphs_vs_eager"] = attempt(
                    f"slots{suffix}_graphs_check",
                    lambda: agreement(
                        decode(model, check, step_context=routed(mix_check)),
                        decode(model, check, step_context=routed(mix_check), graphs=slot_graphs),
                    ),
                )
            for name in ("slots_head", "slots_mixed25") if args.profile and suffix in ("", "_tuned") else ():
                if name == "slots_head" and suffix:
                    continue  # no row corrected: the same graph whatever the correction
                short = [Row(prompt=r.prompt, max_new_tokens=32, seed=r.seed) for r in rows]
                decode(model, short, step_context=routed(mixes[name]), graphs=slot_graphs)  # captures
                res.setdefault("profile", {})[f"{name}{suffix}_graphs"] = attempt(
                    f"profile_{name}{suffix}",
                    lambda: kernel_profile(
                        lambda: decode(model, short, step_context=routed(mixes[name]), graphs=slot_graphs), device
                    ),
                )
            del slot_graphs
        slots.routing.correction = variants[0][1]
        lora_kernels.TUNED.clear()

    # the kernels against the reference correction, op by op on the first layer's groups
    if kernels:

        def kernel_vs_reference() -> dict:
            cols = slots.columns(mixes["slots_mixed3"])
            assert cols is not None
            worst = {"two_kernels": 0.0, "stacked": 0.0, "fused": 0.0}
            for group in slots.groups[:4]:
                n, groups = group.segs[-1], len(group.segs) - 1
                x = torch.randn(batch, group.in_features, device=device, dtype=dtype)
                y0 = torch.nn.functional.linear(x, group.weight, group.bias)
                want, got = y0.clone(), y0.clone()
                lora_kernels.correct_reference_(want, x, group._a_all, group._bt_all, group.segs, cols, 1)
                lora_kernels.correct_kernel_(got, x, group._a_all, group._bt_all, group._segs_dev, cols, 1)
                config = lora_kernels.default_config(batch, n, cols.shape[1])
                if tuning and tuning.best_fused:
                    config = tuning.best_fused.get((batch, n, group.in_features, groups, cols.shape[1]), config)
                fused = lora_kernels.linear_fused(x, group.weight, group.bias, group._a_all, group._bt_all,
                                                  group._segs_dev, cols, 1, config)  # fmt: skip
                ya = torch.nn.functional.linear(x, group._stacked, group._stacked_bias)
                stacked = lora_kernels.expand_stacked(ya[:, :n], ya[:, n:], group._bt_all, group.segs, cols, 1)
                size = (want.float() - y0.float()).abs().max().item()
                for key, out in (("two_kernels", got), ("stacked", stacked), ("fused", fused)):
                    worst[key] = max(worst[key], (out.float() - want.float()).abs().max().item() / size)
            return {f"{key}_max_abs_diff_over_max_correction": value for key, value in worst.items()}

        res["kernel_vs_reference"] = attempt("kernel_vs_reference", kernel_vs_reference)

    # correctness spot check: our routed rows vs W0 + s B A computed directly, on one layer
    layer_name, layer = next(iter(slots.layers.items()))
    x = torch.randn(batch, 3, layer.in_features, device=device, dtype=dtype)
    key = f"base_model.model.{layer_name}.lora_"
    with torch.no_grad(), slots.route(mixed25):
        got = layer(x)
    worst = 0.0
    for row, v in enumerate(mixed25):
        a, b = versions[v][key + "A.weight"].to(device).float(), versions[v][key + "B.weight"].to(device).float()
        w = layer.w0.float() + scale * b @ a
        want = x[row].float() @ w.T
        worst = max(worst, ((got[row].float() - want).abs().max() / want.abs().max()).item())
    res["slots_max_rel_error_vs_reference"] = worst

    res["tokens_per_s"] = tps
    base = (tps["base"] + tps["base_again"]) / 2
    graph_runs = [tps[k] for k in ("base_graphs", "base_graphs_again") if k in tps]
    base_g = sum(graph_runs) / len(graph_runs) if graph_runs else None
    res["ratio_to_base"] = {
        k: v / (base_g if k.endswith("_graphs") or k.endswith("_graphs_again") else base)
        for k, v in tps.items()
        if base_g is not None or "_graphs" not in k
    }
    print(f"\n{'variant':<24}{'tokens/s':>12}{'x base':>9}   (x base of the same technique: mean of its two base runs)")
    for k, v in tps.items():
        print(f"{k:<24}{v:>12.0f}{res['ratio_to_base'][k]:>9.2f}")
    if errors:
        print(f"errors: {errors}")
    print(f"\n{'hot-swap (p50)':<40}{'ms':>9}")
    for k in (
        "slots_swap_ms_p50_from_gpu",
        "slots_swap_ms_p50_from_pinned_host",
        "slots_copy_ms_p50",
        "slots_merge_ms_p50",
        "peft_hotswap_adapter_ms_p50",
        "peft_load_adapter_ms_p50",
    ):
        if k in res:
            print(f"{k:<40}{res[k]:>9.2f}")
    print(
        f"\nW0 copy {res['w0_copy_gb']:.2f} GB, slot buffers {res['slot_buffers_gb']:.2f} GB, "
        f"max rel error vs W0+sBA {worst:.2e}"
    )
    args.out.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
