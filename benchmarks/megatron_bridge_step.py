"""megatron-bridge's LoRA through the project's Megatron engine, without Transformer Engine:
build, GRPO steps, publication, conversion to PEFT, and Megatron's logits against HF + peft.

    # the lent GPU (benchmarks/device/megatron-bridge-site.sh stages the site; its header has the call)
    torchrun --standalone --nproc_per_node=1 benchmarks/megatron_bridge_step.py --out DIR --shape qwen3-0.6b --layers 4
    # CPU, gloo (tests/unit/test_megatron_bridge_cpu.py; needs `make megatron-env`)
    PYTHONPATH=.cache/megatron-site python benchmarks/megatron_bridge_step.py --device cpu --shape tiny --out DIR

What runs is the trainer's own code: `services.trainer.engines.megatron.engine.MegatronEngine`
(megatron-bridge's `AutoBridge` -> provider with megatron-core's local layer spec -> GPTModel
-> bridge's `LoRA(target_modules=[linear_qkv, linear_proj, linear_fc1, linear_fc2])`), its
GRPO step, its `adapter_state()` (PEFT tensors via `services.common.megatron_to_hf`), and the
trainer's `publish_adapter` (object path: safetensors in a LocalStore + `AdapterReady` on a real
nats-server's ADAPTERS stream; one is started here unless `--nats URL`). The published event is
read back from the stream, its object fetched and checked against the event's sha256, written
as a PEFT directory, loaded by peft onto the HF model read from the same HF directory the
bridge loaded, and the logits of both compared on the same tokens: for the trained adapter and
for one with random, large B (so that a wrong conversion cannot hide under a small update).

The base is random: an HF checkpoint of the chosen shape (`--shape`, `--layers`, `--experts`)
is written first, with its norm weights perturbed so that a norm the bridge failed to load
would show in the base logits. `--moe` uses the Qwen3 MoE architecture (the local spec's
experts are a SequentialMLP: one LoRA per expert).

CPU mode, for tests on a machine without CUDA, applies two shims that only this entry point
installs: `typing.override` on Python 3.11 (megatron-core 0.19's `megatron.training`, imported
by megatron-bridge, needs Python 3.12 for it), and the engine's own CPU routing of
megatron-core's CUDA calls (`services/trainer/engines/megatron/cpu.py`).

Every stage records its result or error in DIR/megatron_bridge_step[_LABEL].json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import typing
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.megatron_lora_step import Report, logits_agreement, random_groups, versions

SHAPES = {
    # Qwen3-0.6B: hidden 1024, 16 heads, 8 KV groups, head_dim 128, SwiGLU 3072
    "qwen3-0.6b": dict(hidden=1024, heads=16, groups=8, head_dim=128, ffn=3072, vocab=151936, moe_ffn=768, topk=8),
    # Qwen3-30B-A3B: hidden 2048, 32 heads, 4 KV groups, head_dim 128, 128 experts of 768, top-8
    "qwen3-30b-a3b": dict(hidden=2048, heads=32, groups=4, head_dim=128, ffn=6144, vocab=151936, moe_ffn=768, topk=8),
    "tiny": dict(hidden=64, heads=4, groups=2, head_dim=16, ffn=96, vocab=128, moe_ffn=32, topk=2),
}


def cpu_shims() -> list[str]:
    applied = []
    if not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override  # type: ignore[attr-defined]
        applied.append("typing.override (Python < 3.12)")
    from services.trainer.engines.megatron.cpu import route_cuda_to_cpu

    return applied + route_cuda_to_cpu()  # listed in the report; the engine on CPU routes them as well


def hf_model(args, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """The HF model of `args.shape` at `args.layers` (Qwen3, or Qwen3-MoE with `args.moe`),
    random weights from `args.seed`, built on `device` in `dtype` (a deep MoE shape is tens of
    GB: built where it is initialised fastest, and never in float32 on the host)."""

    d = SHAPES[args.shape]
    common = dict(
        vocab_size=args.vocab or d["vocab"],
        hidden_size=d["hidden"],
        num_hidden_layers=args.layers,
        num_attention_heads=d["heads"],
        num_key_value_heads=d["groups"],
        head_dim=d["head_dim"],
        tie_word_embeddings=False,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
    )
    torch.manual_seed(args.seed)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = _random_model(args, d, common)
    finally:
        torch.set_default_dtype(default_dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # HF initialises norms to 1, as an unloaded Megatron norm would be
                p.copy_(1 + 0.2 * torch.randn_like(p))
    return model


def _random_model(args, d: dict, common: dict):
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    if args.moe:
        config = Qwen3MoeConfig(
            moe_intermediate_size=d["moe_ffn"],
            num_experts=args.experts,
            num_experts_per_tok=min(d["topk"], args.experts),
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
            **common,
        )
        return Qwen3MoeForCausalLM(config)
    return Qwen3ForCausalLM(Qwen3Config(intermediate_size=d["ffn"], **common))


def write_hf_checkpoint(directory: Path, args) -> dict:
    t0 = time.perf_counter()
    model = hf_model(args, args.device, torch.bfloat16 if args.dtype == "bfloat16" else torch.float32)
    model.save_pretrained(directory)
    params = sum(p.numel() for p in model.parameters())
    architecture = type(model).__name__
    del model
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return {
        "path": str(directory),
        "architecture": architecture,
        "parameters": params,
        "bytes": sum(f.stat().st_size for f in directory.iterdir()),
        "seconds": round(time.perf_counter() - t0, 1),
    }


def engine_config(args, hf_dir: Path, run_dir: Path):
    from services.config.loader import config_from_dict

    return config_from_dict(
        {
            "run": "megatron-bridge-step",
            "run_dir": str(run_dir),
            "total_train_steps": args.steps,
            "actor": {
                "backend": "megatron",
                "path": str(hf_dir),
                "device": args.device,
                "dtype": args.dtype,
                "lora_rank": args.rank,
                "lora_alpha": args.alpha,
                "target_modules": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
                "mb_spec_max_tokens": args.max_tokens,
                "megatron": {"bridge_type": "megatron-bridge"},
                "optimizer": {"lr": args.lr, "warmup_steps_proportion": 0.0},
            },
            "train_dataset": {"path": "builtin:arith", "reward_fn": "services.common.rewards:arith_reward"},
        }
    )


def build_engine(cfg) -> tuple[object, dict]:
    from services.trainer.engines.megatron.bridge_import import have_transformer_engine
    from services.trainer.engines.megatron.engine import MegatronEngine

    engine = MegatronEngine(cfg)
    wrapped: dict[str, list[str]] = {}
    for name, module in engine.model.named_modules():
        inner = getattr(module, "to_wrap", None)
        if inner is not None:
            wrapped.setdefault(f"{type(module).__name__}({type(inner).__name__})", []).append(name)
    names = engine.optimizer.names
    info = {
        "transformer_engine": have_transformer_engine(),
        "model": type(engine.model).__name__,
        "params_total": sum(p.numel() for p in engine.model.parameters()),
        "params_adapter": sum(m.numel() for m in engine.optimizer.masters),
        "adapter_tensors": len(names),
        "wrappers": {k: len(v) for k, v in wrapped.items()},
        "first_names": names[:4],
        "expert_names": [n for n in names if ".experts." in n][:2],
        "lora_spec": {"rank": engine.lora_spec().rank, "targets": engine.lora_spec().target_modules},
    }
    return engine, info


def grpo_steps(engine, args, device: torch.device) -> dict:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    vocab = engine.vocab_size
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    before = {n: m.detach().clone() for n, m in engine.optimizer.master_state().items()}
    times, losses, norms, tokens = [], [], [], 0
    for step in range(args.steps):
        groups = random_groups(
            args.groups, args.samples, args.prompt_len, args.max_new, vocab, step + 1, args.seed + step
        )
        tokens = sum(len(c.token_ids) for g in groups for c in g.completions)
        seq_tokens = sum((len(g.prompt_token_ids) + len(c.token_ids)) for g in groups for c in g.completions)
        sync()
        t0 = time.perf_counter()
        stats = engine.train_step(groups, head_version=step + 1)
        sync()
        times.append(round(time.perf_counter() - t0, 4))
        losses.append(stats.loss)
        norms.append(stats.grad_norm)
    after = engine.optimizer.master_state()
    later = times[1:] or times
    median = sorted(later)[len(later) // 2]
    return {
        "step_seconds": times,
        "step_seconds_median_after_first": median,
        "completion_tokens_per_step": tokens,
        "sequence_tokens_per_step": seq_tokens,
        "tokens_per_second": round(seq_tokens / median, 1),
        "loss": losses,
        "grad_norm": norms,
        "adapter_max_abs_change": max(float((after[n] - before[n]).abs().max()) for n in before),
        "peak_memory_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None,
    }


async def _publish_and_read_back(engine, nats_url: str, store_dir: Path, version: int) -> dict:
    from proto import codec, subjects
    from proto.messages import AdapterReady
    from services.common import adapter_io, streams
    from services.common.bus import Bus
    from services.common.store import LocalStore
    from services.config.schema import BusConfig
    from services.trainer.publish import publish_adapter, trainer_epoch

    run = f"mb{os.getpid()}x{version}"
    store = LocalStore(store_dir)
    bus = await Bus.connect(BusConfig(url=nats_url), run=run, service="trainer")
    try:
        await bus.ensure_streams()
        t0 = time.perf_counter()
        tensors = engine.adapter_state()
        t_state = time.perf_counter() - t0
        event = await publish_adapter(
            bus, store, run=run, epoch=trainer_epoch(store, run), lora_name="mb", version=version,
            tensors=tensors, lora=engine.lora_spec(), trainer_step=engine.step,
        )  # fmt: skip
        t_pub = time.perf_counter() - t0
        raw = await bus.last_raw(streams.ADAPTERS(run), subjects.adapter_ready(run, version))
    finally:
        await bus.close()
    if event is None or raw is None:
        raise RuntimeError(f"version {version}: no AdapterReady on the stream")
    read = codec.decode(raw.data, AdapterReady)
    obj = read.object_payload()
    if obj is None or obj.layout != "hf-peft":
        raise RuntimeError(f"the event carries no hf-peft object payload: {read.payloads}")
    data = store.get_bytes(obj.uri, size=obj.bytes)
    if adapter_io.sha256(data) != obj.sha256:
        raise RuntimeError("the stored object does not match the event's sha256")
    return {"event": read, "weights": data, "adapter_state_s": t_state, "publish_s": t_pub}


def publish(engine, args, work: Path, version: int, label: str) -> dict:
    from services.common import adapter_io

    got = asyncio.run(_publish_and_read_back(engine, args.nats_url, work / "store", version))
    event, data = got["event"], got["weights"]
    tensors = adapter_io.from_bytes(data)
    peft_dir = adapter_io.write_peft_dir(work / f"peft-{label}", data, event.lora)
    return {
        "version": event.version,
        "payloads": [type(p).__name__ for p in event.payloads],
        "object_bytes": len(data),
        "hf_tensors": len(tensors),
        "dtype": str(next(iter(tensors.values())).dtype),
        "target_modules": event.lora.target_modules,
        "adapter_state_seconds": round(got["adapter_state_s"], 4),
        "publish_seconds": round(got["publish_s"], 4),
        "peft_dir": str(peft_dir),
    }


def megatron_logits(engine, tokens: torch.Tensor) -> torch.Tensor:
    from services.trainer.engines.megatron.step import causal_mask

    was = engine.model.training
    engine.model.eval()
    try:
        with torch.no_grad():
            ids = tokens.to(engine.device)
            pos = torch.arange(ids.shape[1], device=engine.device).unsqueeze(0).expand(ids.shape[0], -1)
            return engine.model(ids, pos, causal_mask(ids.shape[1], engine.device)).float().cpu()
    finally:
        engine.model.train(was)


def hf_logits(hf_dir: Path, peft_dir: str | None, tokens: torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype, attn_implementation="eager").to(device)
    if peft_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, peft_dir)
    model.eval()
    with torch.no_grad():
        out = model(input_ids=tokens.to(device)).logits.float().cpu()
    del model
    return out


def logits_check(engine, hf_dir: Path, peft_dir: str, args, tokens: torch.Tensor) -> dict:
    dtype = engine._serving
    mg = megatron_logits(engine, tokens)
    hf = hf_logits(hf_dir, peft_dir, tokens, dtype, engine.device)
    base = hf_logits(hf_dir, None, tokens, dtype, engine.device)
    agreement = logits_agreement(mg, hf)
    agreement["adapter_effect_max_abs"] = float((hf - base).abs().max())
    if args.tol is not None:
        tol = args.tol
    elif dtype == torch.float32:
        tol = 2e-4
    else:
        # bf16's own noise on this model, HF against HF in float32: a 128-expert router sends
        # 14-22 % of tokens to another expert in bf16 (bf16_floor.py), so no constant fits every shape
        floor = float((hf - hf_logits(hf_dir, peft_dir, tokens, torch.float32, engine.device)).abs().max())
        agreement["hf_bf16_vs_fp32_max_abs"] = floor
        tol = 2 * floor
    agreement["tolerance"] = tol
    if not agreement["max_abs_diff"] <= tol:
        raise AssertionError(f"Megatron vs HF + peft: max |diff| {agreement['max_abs_diff']:.3g} > {tol} ({agreement})")
    return agreement


def randomise_adapter(engine, seed: int, scale: float) -> dict:
    """Large random A and B in the fp32 masters and the model's copies (a wrong conversion of
    B then moves the logits by far more than any tolerance)."""
    g = torch.Generator().manual_seed(seed)
    opt = engine.optimizer
    with torch.no_grad():
        for name, master, param in zip(opt.names, opt.masters, opt.params):
            value = torch.randn(master.shape, generator=g) * (
                scale if "linear_out" in name else master.shape[-1] ** -0.5
            )
            master.copy_(value.to(master.device, master.dtype))
            param.copy_(master.to(param.dtype))
    return {"scale_b": scale}


class BridgeReport(Report):
    """megatron_lora_step's staged report, written as megatron_bridge_step[_LABEL].json."""

    def __init__(self, out: Path, label: str = ""):
        super().__init__(out)
        self.name = f"megatron_bridge_step{'_' + label if label else ''}.json"

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / self.name).write_text(json.dumps(self.data, indent=2, default=str))


def run(args) -> int:
    report = BridgeReport(Path(args.out), args.label)
    report.data["mode"] = args.device
    report.data["config"] = {k: v for k, v in vars(args).items() if k not in ("out",)}
    if args.device == "cpu":
        report.data["cpu_shims"] = cpu_shims()
    work = Path(args.work or tempfile.mkdtemp(prefix="mbstep-"))
    hf_dir = work / "hf"
    hf_dir.mkdir(parents=True, exist_ok=True)

    def bridge_versions() -> dict:
        from services.trainer.engines.megatron.bridge_import import import_bridge

        import_bridge()
        info = versions()
        from importlib.metadata import version

        for dist in ("megatron-bridge", "megatron-core"):
            try:
                info[dist] = version(dist)
            except Exception as exc:
                info[dist] = f"? ({type(exc).__name__})"
        info["te_in_sys_modules"] = sorted(m for m in sys.modules if m.split(".")[0] == "transformer_engine")
        return info

    if report.stage("versions", bridge_versions) is None:
        return finish(report)
    if report.stage("write_hf_checkpoint", write_hf_checkpoint, hf_dir, args) is None:
        return finish(report)
    cfg = engine_config(args, hf_dir, work / "run")
    built = report.stage("build_engine_and_lora", build_engine, cfg)
    if built is None:
        return finish(report)
    engine, info = built
    report.data["stages"]["build_engine_and_lora"] = {"ok": True, **info}
    report.save()
    device = engine.device
    report.stage("grpo_steps", grpo_steps, engine, args, device)
    if not args.checks:
        return finish(report)

    server = None
    if not args.nats_url:
        from services.local.nats_server import start_nats_server

        server = report.stage("start_nats_server", start_nats_server, work / "nats")
        args.nats_url = server.url if server is not None else None
    g = torch.Generator().manual_seed(args.seed + 99)
    tokens = torch.randint(0, engine.vocab_size, (2, args.check_len), generator=g)
    try:
        for version, label_, prep in (
            (1, "trained", None),
            (2, "random_b", lambda: randomise_adapter(engine, args.seed, 0.05)),
        ):
            if prep is not None:
                prep()
            pub = (
                report.stage(f"publish_{label_}", publish, engine, args, work, version, label_)
                if args.nats_url
                else None
            )
            if pub is not None:
                report.stage(f"logits_check_{label_}", logits_check, engine, hf_dir, pub["peft_dir"], args, tokens)
    finally:
        if server is not None:
            server.close()
    return finish(report)


def finish(report: Report) -> int:
    report.data["ok"] = all(s.get("ok") for s in report.data["stages"].values())
    report.save()
    print(f"all stages ok: {report.data['ok']}", flush=True)
    return 0 if report.data["ok"] else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmark's arguments; tests that reuse its helpers build them here so no field is missing."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--label", default="", help="suffix of the JSON file's name")
    ap.add_argument("--work", default=None, help="scratch directory (HF checkpoint, store, PEFT dirs)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    ap.add_argument("--moe", action="store_true", help="Qwen3 MoE architecture (qwen3-30b-a3b's shape by default)")
    ap.add_argument("--experts", type=int, default=8, help="experts per MoE layer (--moe)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=0, help="override the shape's vocabulary size")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--check-len", type=int, default=32)
    ap.add_argument(
        "--tol", type=float, default=None,
        help="max |logit diff| (default 2e-4 fp32; bf16: twice HF's own bf16-vs-fp32 difference)",
    )  # fmt: skip
    ap.add_argument(
        "--checks", action=argparse.BooleanOptionalAction, default=True,
        help="publish and compare with HF + peft after the steps (--no-checks: the steps only, for a "
        "depth whose HF model in float32 would not fit beside it)",
    )  # fmt: skip
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--nats-url", default="", help="a running nats-server (default: start one)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
