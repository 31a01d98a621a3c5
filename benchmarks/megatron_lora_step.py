"""A real Megatron LoRA GRPO step, and the proof that its adapter means the same thing in HF.

    torchrun --nproc_per_node=1 benchmarks/megatron_lora_step.py --out DIR   # CUDA + megatron-core
    python benchmarks/megatron_lora_step.py --cpu-check --out DIR             # no megatron needed

megatron-bridge cannot be imported on the GPU image (it needs transformer-engine and
transformers<5), so this builds the model with megatron-core alone: a Qwen3-0.6B-shaped
`GPTModel` (hidden 1024, 16 heads, 8 KV groups, head_dim 128, SwiGLU 3072, RMSNorm, QK-norm,
RoPE 1e6, vocab 151936; `--layers` of its 28) from `get_gpt_layer_local_spec()` (no TE), bf16,
NCCL world size 1. LoRA is attached here in megatron-bridge's module structure
(`<linear>.to_wrap` + `<linear>.adapter.linear_in/linear_out`, out = base(x) + alpha/r *
linear_out(linear_in(x)), the (output, bias) tuple passed through) on linear_qkv, linear_proj,
linear_fc1 and linear_fc2. The train step is the engine's own
(`services.trainer.engines.megatron.step.train_step`: our batching, GRPO advantages,
decoupled PPO loss, fp32-master AdamW), on random token data.

Then the check: the adapter is read out in bridge naming, converted with
`services.common.megatron_to_hf.convert` (via `state.to_hf`), written as a PEFT directory;
the Megatron base weights are converted to an HF `Qwen3ForCausalLM` (fused qkv in Megatron's
per-group order -> q/k/v, fc1 -> gate/up); peft loads the adapter; logits of Megatron+adapter
and HF+peft on the same tokens are compared in fp32 (and bf16), for the trained adapter and
for one with large random B (so that a wrong conversion cannot hide under a small update).

Every stage records its result or its error in the JSON, so one run on a scarce GPU says as
much as it can. `--cpu-check` runs every stage that needs no Megatron: the base and adapter
conversions of a fake Megatron state, checked by loading both into HF+peft and comparing with
the fused-layout math.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from proto.messages import Completion, Trajectory
from services.common import adapter_io, lora_targets
from services.common.megatron_to_hf import ModelShape, target_modules_of
from services.config.schema import OptimizerConfig, PPOConfig
from services.trainer.engines.megatron.state import (
    adapter_named_parameters,
    merge_tp,
    to_hf,
    tp_split,
)
from tests.fixtures.megatron_ref import (
    TARGETS,
    LoRALinear,
    attach_lora,
    fake_megatron_state,
    hf_model,
    megatron_base_to_hf,
    peft_wrap,
)

QWEN3_0_6B = dict(
    hidden=1024, heads=16, groups=8, head_dim=128, ffn=3072, vocab=151936, eps=1e-6, rope_theta=1_000_000.0
)
TINY = dict(hidden=64, heads=4, groups=2, head_dim=32, ffn=96, vocab=128, eps=1e-6, rope_theta=1_000_000.0)


# --- random GRPO data --------------------------------------------------------------------------


def random_groups(
    n_groups: int, samples: int, prompt_len: int, max_new: int, vocab: int, head: int, seed: int
) -> list[Trajectory]:
    rng = random.Random(seed)
    groups = []
    for g in range(n_groups):
        completions = []
        for _ in range(samples):
            n = rng.randint(max_new // 2, max_new)
            completions.append(
                Completion(
                    token_ids=[rng.randrange(vocab) for _ in range(n)],
                    logprobs=[0.0] * n,  # filled with the model's own logprobs below
                    versions=[max(0, head - rng.randint(0, 2))] * n,
                    reward=float(rng.random() < 0.5),
                )
            )
        groups.append(
            Trajectory(
                run="bench",
                trajectory_id=f"t{g}",
                grant_id=f"g{g}",
                replica="r0",
                prompt_id=f"p{g}",
                prompt_token_ids=[rng.randrange(vocab) for _ in range(prompt_len)],
                completions=completions,
                started_at=0.0,
                finished_at=1.0,
            )
        )
    return groups


@torch.no_grad()
def fill_behaviour_logprobs(model, groups, device, noise: float, seed: int) -> None:
    """Behaviour logprobs = the model's own plus noise (a rollout a little off-policy)."""
    from services.trainer import batching
    from services.trainer.engines.megatron.step import target_logprobs

    gen = torch.Generator().manual_seed(seed)
    for traj in groups:
        samples = [
            batching.Sample(
                list(traj.prompt_token_ids) + list(c.token_ids),
                len(traj.prompt_token_ids),
                [0.0] * len(c.token_ids),
                [0] * len(c.token_ids),
                0.0,
            )
            for c in traj.completions
        ]
        lp = target_logprobs(model, batching.collate(samples), device, 1.0).float().cpu()
        for i, c in enumerate(traj.completions):
            n = len(c.token_ids)
            c.logprobs = (lp[i, :n] + noise * torch.randn(n, generator=gen)).tolist()


# --- stages ----------------------------------------------------------------------------------


class Report:
    def __init__(self, out: Path):
        self.out, self.data = out, {"stages": {}}

    def stage(self, name: str, fn, *args, **kwargs):
        t0 = time.perf_counter()
        print(f"== {name}", flush=True)
        try:
            result = fn(*args, **kwargs)
            self.data["stages"][name] = {
                "ok": True,
                "seconds": round(time.perf_counter() - t0, 3),
                **(result if isinstance(result, dict) else {}),
            }
            print(json.dumps(self.data["stages"][name], default=str)[:2000], flush=True)
            return result
        except Exception as exc:  # record and go on: every stage that can run should
            self.data["stages"][name] = {
                "ok": False,
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc()[-4000:],
            }
            print(self.data["stages"][name]["traceback"], flush=True)
            return None
        finally:
            self.save()

    def save(self):
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "megatron_lora_step.json").write_text(json.dumps(self.data, indent=2, default=str))


def versions() -> dict:
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
    for mod in ("megatron.core", "transformers", "peft", "transformer_engine", "apex"):
        try:
            m = __import__(mod, fromlist=["__version__"])
            info[mod] = getattr(m, "__version__", "?")
        except Exception as exc:
            info[mod] = f"missing ({type(exc).__name__})"
    return info


def logits_agreement(a: torch.Tensor, b: torch.Tensor, base: torch.Tensor | None = None) -> dict:
    a, b = a.float(), b.float()
    out = {
        "max_abs_diff": float((a - b).abs().max()),
        "mean_abs_diff": float((a - b).abs().mean()),
        "logit_scale_max_abs": float(a.abs().max()),
        "argmax_agreement": float((a.argmax(-1) == b.argmax(-1)).float().mean()),
    }
    if base is not None:
        out["adapter_effect_max_abs"] = float((a - base.float()).abs().max())
    return out


# --- CPU check -------------------------------------------------------------------------------


def cpu_check(report: Report, args) -> None:
    shape = ModelShape(num_layers=2, hidden=64, num_attention_heads=4, num_query_groups=2, head_dim=32, ffn_hidden=96)
    vocab, rank, alpha = 128, 8, 16.0
    gen = torch.Generator().manual_seed(0)
    base, adapter = fake_megatron_state(shape, vocab, rank, gen)
    dims = {"eps": 1e-6, "rope_theta": 1_000_000.0}

    def names():
        named = [(n, nn.Parameter(t)) for n, t in adapter.items()]
        got = adapter_named_parameters([("module." + n, p) for n, p in named])
        return {"adapter_tensors": len(got)}

    def tp_round_trip():
        shards = [{} for _ in range(2)]
        for n, t in adapter.items():
            for r, part in enumerate(tp_split(n, t, 2)):
                shards[r][n] = part
        merged = merge_tp(shards)
        assert all(torch.equal(merged[n], adapter[n]) for n in adapter)
        return {"tp": 2, "tensors": len(merged)}

    def merged_weight_math():
        """For each fused layer: HF-side W + s*B@A (per split projection) == the split of the
        fused W + s*B@A. Exact algebra, no model forward."""
        hf_base = megatron_base_to_hf(base, shape)
        hf_adapter = to_hf(adapter, shape)
        s, worst = alpha / rank, 0.0
        for L in range(shape.num_layers):
            for module in ("self_attention.linear_qkv", "mlp.linear_fc1"):
                p = f"decoder.layers.{L}.{module}"
                fused = base[p + ".to_wrap.weight"] + s * (
                    adapter[p + ".adapter.linear_out.weight"] @ adapter[p + ".adapter.linear_in.weight"]
                )
                split = megatron_base_to_hf({p + ".weight": fused}, shape)
                for key, w in split.items():
                    mod = key[: -len(".weight")]
                    a = hf_adapter[adapter_io.peft_key(mod, "A")]
                    b = hf_adapter[adapter_io.peft_key(mod, "B")]
                    worst = max(worst, float((hf_base[key] + s * b @ a - w).abs().max()))
        assert worst < 1e-5, worst
        return {"max_abs_diff": worst}

    def hf_peft_load():
        hf_base = megatron_base_to_hf(base, shape)
        model = hf_model(shape, vocab, dims, hf_base, torch.float32, "cpu")
        tokens = torch.randint(0, vocab, (2, 12), generator=gen)
        with torch.no_grad():
            plain = model(input_ids=tokens).logits
            with tempfile.TemporaryDirectory() as d:
                wrapped = peft_wrap(model, to_hf(adapter, shape), rank, alpha, Path(d))
                adapted = wrapped(input_ids=tokens).logits
        effect = float((adapted - plain).abs().max())
        assert effect > 1e-3, "the converted adapter did not change the HF model's output"
        return {"adapter_effect_max_abs": effect, "target_modules": lora_targets.to_hf(TARGETS)}

    report.stage("versions", versions)
    report.stage("adapter_names", names)
    report.stage("tp_split_merge", tp_round_trip)
    report.stage("merged_weight_math", merged_weight_math)
    report.stage("hf_peft_load", hf_peft_load)


# --- GPU run ---------------------------------------------------------------------------------


def build_gpt(layers: int, dims: dict, dtype, device):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=layers,
        hidden_size=dims["hidden"],
        num_attention_heads=dims["heads"],
        num_query_groups=dims["groups"],
        kv_channels=dims["head_dim"],
        ffn_hidden_size=dims["ffn"],
        normalization="RMSNorm",
        layernorm_epsilon=dims["eps"],
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        qk_layernorm=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        gradient_accumulation_fusion=False,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=device.type == "cpu",
        init_method_std=0.02,
    )
    spec = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    model = GPTModel(
        config,
        spec,
        vocab_size=dims["vocab"],
        max_sequence_length=4096,
        position_embedding_type="rope",
        rotary_base=int(dims["rope_theta"]),
        share_embeddings_and_output_weights=False,
        parallel_output=True,
    )
    return model.to(device)


def init_megatron(seed: int, device: torch.device):
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    if "RANK" not in os.environ:
        os.environ.update(
            RANK="0",
            LOCAL_RANK="0",
            WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=os.environ.get("MASTER_PORT", "29561"),
        )
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    if cuda:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return {"world_size": dist.get_world_size(), "backend": dist.get_backend()}


def gpu_run(report: Report, args) -> None:
    from services.config.schema import ActorConfig, LorabusConfig
    from services.trainer.engines.base import make_optimizer
    from services.trainer.engines.megatron.optim import MasterAdapterOptimizer
    from services.trainer.engines.megatron.step import train_step

    dims = dict(TINY if args.tiny else QWEN3_0_6B)
    if args.vocab:
        dims["vocab"] = args.vocab
    shape = ModelShape(
        num_layers=args.layers,
        hidden=dims["hidden"],
        num_attention_heads=dims["heads"],
        num_query_groups=dims["groups"],
        head_dim=dims["head_dim"],
        ffn_hidden=dims["ffn"],
    )
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        if args.device == "cuda"
        else torch.device(args.device)
    )
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    report.data["config"] = {
        **dims,
        "layers": args.layers,
        "rank": args.rank,
        "alpha": args.alpha,
        "groups": args.groups,
        "samples": args.samples,
        "prompt_len": args.prompt_len,
        "max_new": args.max_new,
        "steps": args.steps,
        "lr": args.lr,
    }
    report.stage("versions", versions)
    if report.stage("init_megatron", init_megatron, args.seed, device) is None:
        return
    ctx: dict = {}

    def build():
        torch.manual_seed(args.seed)
        model = build_gpt(args.layers, dims, torch.bfloat16, device)
        attach_lora(model, args.rank, args.alpha)
        model.train()
        named = adapter_named_parameters(model.named_parameters())
        cfg = LorabusConfig(actor=ActorConfig(optimizer=OptimizerConfig(lr=args.lr)))
        ctx["model"], ctx["named"] = model, named
        ctx["opt"] = MasterAdapterOptimizer(named, lambda ps: make_optimizer(ps, cfg))
        total = sum(p.numel() for p in model.parameters())
        return {
            "params_total": total,
            "params_adapter": sum(p.numel() for _, p in named),
            "adapter_dtype": str(named[0][1].dtype),
            "adapter_tensors": len(named),
            "first_names": [n for n, _ in named[:4]],
        }

    if report.stage("build_model_and_lora", build) is None:
        return
    model, opt = ctx["model"], ctx["opt"]

    def train():
        groups = random_groups(
            args.groups, args.samples, args.prompt_len, args.max_new, dims["vocab"], head=2, seed=args.seed
        )
        fill_behaviour_logprobs(model, groups, device, noise=0.05, seed=args.seed)
        ppo = PPOConfig()
        times, losses, norms, tokens = [], [], [], 0
        before = {n: p.detach().float().clone() for n, p in ctx["named"]}
        for i in range(args.steps):
            sync()
            t0 = time.perf_counter()
            stats = train_step(
                model, opt, groups, 2, ppo=ppo, max_tokens=args.max_tokens, device=device, step_index=i, lr=args.lr
            )
            sync()
            times.append(time.perf_counter() - t0)
            losses.append(stats.loss)
            norms.append(stats.grad_norm)
            tokens = stats.tokens
        moved = max(float((p.detach().float() - before[n]).abs().max()) for n, p in ctx["named"])
        base_frozen = all(p.grad is None for n, p in model.named_parameters() if ".adapter." not in n)
        steady = times[1:] or times
        seq_tokens = sum(len(g.prompt_token_ids) + len(c.token_ids) for g in groups for c in g.completions)
        return {
            "step_seconds": [round(t, 4) for t in times],
            "step_seconds_median_after_first": round(statistics.median(steady), 4),
            "completion_tokens_per_step": tokens,
            "sequence_tokens_per_step": seq_tokens,
            "tokens_per_second": round(seq_tokens / statistics.median(steady), 1),
            "loss": losses,
            "grad_norm": norms,
            "adapter_max_abs_change": moved,
            "base_frozen": base_frozen,
            "peak_memory_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
            if device.type == "cuda"
            else None,
        }

    report.stage("grpo_steps", train)

    def extract():
        bridge_state = opt.master_state()  # fp32 masters: what the engine publishes
        hf_adapter = to_hf(bridge_state, shape)
        ctx["bridge_state"], ctx["hf_adapter"] = bridge_state, hf_adapter
        return {
            "bridge_tensors": len(bridge_state),
            "hf_tensors": len(hf_adapter),
            "hf_target_modules": target_modules_of(hf_adapter),
            "example_keys": sorted(hf_adapter)[:3],
            "b_max_abs": max(float(v.abs().max()) for k, v in hf_adapter.items() if "lora_B" in k),
        }

    if report.stage("extract_and_convert", extract) is None:
        return

    def compare(adapter_state: dict, label: str) -> dict:
        # fp32 Megatron copy of the same weights (base + this adapter) vs HF fp32 + peft
        full = {k: v.float() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
        if not set(adapter_state) <= set(full):
            raise RuntimeError(f"adapter names not in the model: {sorted(set(adapter_state) - set(full))[:3]}")
        full.update({k: v.float() for k, v in adapter_state.items()})
        m32 = build_gpt(args.layers, dims, torch.float32, device)
        attach_lora(m32, args.rank, args.alpha)
        missing, unexpected = m32.load_state_dict(full, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise RuntimeError(f"fp32 copy: missing {missing[:3]} unexpected {unexpected[:3]}")
        m32.eval()
        gen = torch.Generator().manual_seed(123)
        tokens = torch.randint(0, dims["vocab"], (2, args.check_len), generator=gen).to(device)
        pos = torch.arange(args.check_len, device=device).unsqueeze(0).expand(2, -1)
        from services.trainer.engines.megatron.step import causal_mask

        mask = causal_mask(args.check_len, device)
        hf_base = megatron_base_to_hf(full, shape)
        hf_adapter = to_hf(adapter_state, shape)
        out = {}
        with torch.no_grad():
            mg32 = m32(tokens, pos, mask).float()
            for mod in m32.modules():
                if isinstance(mod, LoRALinear):
                    mod.adapter.scale_saved, mod.adapter.scale = mod.adapter.scale, 0.0
            mg32_base = m32(tokens, pos, mask).float()
            for mod in m32.modules():
                if isinstance(mod, LoRALinear):
                    mod.adapter.scale = mod.adapter.scale_saved
            del m32
            hf = hf_model(shape, dims["vocab"], dims, hf_base, torch.float32, device)
            hf_plain = hf(input_ids=tokens).logits.float()
            with tempfile.TemporaryDirectory() as d:
                wrapped = peft_wrap(hf, hf_adapter, args.rank, args.alpha, Path(d) / label)
                hf_lora = wrapped(input_ids=tokens).logits.float()
            out["fp32_base_megatron_vs_hf"] = logits_agreement(mg32_base, hf_plain)
            out["fp32_lora_megatron_vs_hf_peft"] = logits_agreement(mg32, hf_lora, base=mg32_base)
            # bf16: the trained bf16 Megatron model itself vs HF bf16 + peft
            if label == "trained":
                mg16 = model.eval()(tokens, pos, mask).float()
                model.train()
                hf16 = wrapped.to(torch.bfloat16)
                out["bf16_lora_megatron_vs_hf_peft"] = logits_agreement(mg16, hf16(input_ids=tokens).logits.float())
            del hf, wrapped
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return out

    report.stage("logits_check_trained_adapter", compare, ctx["bridge_state"], "trained")

    def random_adapter():
        gen = torch.Generator().manual_seed(7)
        rnd = {}
        for k, v in ctx["bridge_state"].items():
            rnd[k] = v if "linear_in" in k else torch.randn(v.shape, generator=gen) * 0.02
        return compare(rnd, "random")

    report.stage("logits_check_random_adapter", random_adapter)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu-check", action="store_true", help="conversion checks without megatron")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="directory for the JSON")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=0, help="override the Qwen3 vocab (0: 151936)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--check-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--tiny", action="store_true", help="hidden 64, 2 heads/group, vocab 128")
    ap.add_argument(
        "--device", default="cuda", help="cuda; cpu only with megatron's CUDA calls patched out (a development dry run)"
    )
    args = ap.parse_args(argv)
    report = Report(Path(args.out))
    report.data["mode"] = "cpu-check" if args.cpu_check else "gpu"
    (cpu_check if args.cpu_check else gpu_run)(report, args)
    report.data["ok"] = all(s.get("ok") for s in report.data["stages"].values())
    report.save()
    print(f"wrote {Path(args.out) / 'megatron_lora_step.json'}; all stages ok: {report.data['ok']}")
    return 0 if report.data["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
