"""The Megatron engine: megatron-bridge builds the model from the HF checkpoint and applies LoRA;
the step, optimizer and checkpoints are this package's plain-torch parts.

    bridge = AutoBridge.from_hf_pretrained(actor.path)      # HF config + weights
    provider = bridge.to_megatron_provider(load_weights=True)
    provider.<parallel sizes>, gradient_accumulation_fusion = False; provider.finalize()
    model = provider.provide_distributed_model(wrap_with_ddp=False)   # [chunk]
    model = LoRA(target_modules, dim=rank, alpha, dropout=0.0)(model, training=True)

LoRA constraints (AReaL's, enforced by `services.config.rules.check_megatron`):
`bridge_type: megatron-bridge`; no gradient-accumulation fusion (the fused wgrad kernel
writes into `main_grad` buffers the frozen base weights do not have); no distributed optimizer
(the adapter's fp32 masters and Adam moments live in `MasterAdapterOptimizer`, replicated
over data-parallel ranks, sliced like the adapter over tensor-parallel ranks); no DCP
checkpoints: each rank saves its own slices with torch.save (`checkpoint.py`).

Published versions are HF PEFT tensors in the serving dtype `actor.dtype`, cast once from the
fp32 masters as the FSDP2 engine does (`adapter_state`, layout `hf-peft`, its `LoraSpec` from
the trainer's one builder, `engines.base.lora_spec`): the TP slices are
gathered, merged (`state.merge_tp`) and converted with `services.common.megatron_to_hf.convert`
on every rank, so the trainer service publishes and checkpoints them exactly as it does the
FSDP2 engine's, and vLLM/SGLang/the embedded engine load them without a Megatron step in
between. `bridge_adapter_state` gives the gathered bridge-named state for consumers that want
the `megatron-bridge` layout.

This file needs megatron-core and megatron-bridge; it raises `MegatronNotInstalled` naming the
`lorabus[megatron]` extra when they are missing. Transformer Engine is optional: without it the
model is built from megatron-core's local layer spec (`configure_provider`, `bridge_import`).
It runs on CUDA; on CPU (gloo) for tests only (`cpu.py` routes megatron-core's CUDA calls).

Pipeline parallelism: each rank builds its stage (megatron-core's parallel_state, the
provider's `pipeline_model_parallel_size`) and the step runs megatron-core's pipeline
schedule (`pipeline.py`); logprobs and the loss come from the last stage. Expert parallelism:
each rank builds its share of every MoE layer's experts; expert adapter gradients reduce over
the expert-data-parallel group (`optim.py`). The published adapter is every stage's and expert
rank's tensors renamed to the full model's layer and expert numbers and gathered
(`layout.py`), so the converter sees the full-depth adapter with every expert.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from proto.messages import Canary, LoraSpec, Trajectory
from services.common import lora_targets
from services.common.adapter_io import DTYPES
from services.common.megatron_to_hf import ModelShape
from services.common.models import resolve_device
from services.config.megatron_layout import model_problems
from services.config.rules import check_megatron
from services.config.schema import LorabusConfig
from services.trainer.engines.base import StepStats, lora_spec, make_optimizer
from services.trainer.engines.megatron import checkpoint as shards
from services.trainer.engines.megatron import pipeline as mpipe
from services.trainer.engines.megatron import step as mstep
from services.trainer.engines.megatron.bridge_import import have_transformer_engine, import_bridge
from services.trainer.engines.megatron.canary import megatron_canary
from services.trainer.engines.megatron.cpu import cuda_factories_on_cpu, route_cuda_to_cpu
from services.trainer.engines.megatron.deps import require
from services.trainer.engines.megatron.layout import assemble, globalize, layer_offset
from services.trainer.engines.megatron.optim import MasterAdapterOptimizer
from services.trainer.engines.megatron.state import (
    adapter_named_parameters,
    megatron_targets,
    to_hf,
    tp_split,
)
from services.trainer.schedule import make_scheduler

require("megatron.core")
import_bridge()  # megatron-bridge, with or without Transformer Engine (bridge_import.py)
from megatron.bridge import AutoBridge  # noqa: E402
from megatron.bridge.models.gpt_provider import local_layer_spec  # noqa: E402
from megatron.bridge.peft.lora import LoRA  # noqa: E402
from megatron.core import parallel_state, tensor_parallel  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402

log = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_megatron(cfg: LorabusConfig) -> torch.device:
    """Join (or, outside torchrun, create a one-rank) process group and Megatron's parallel state:
    NCCL on CUDA; gloo on CPU, which is for tests (megatron-core's CUDA calls routed, `cpu.py`)."""
    device = resolve_device(cfg.actor.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if "RANK" not in os.environ:  # a plain `python -m services.trainer`: one rank
        os.environ.update(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port())
        )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif device.type == "cpu":
        route_cuda_to_cpu()
    else:
        raise ValueError(f"actor.device: {cfg.actor.device!r}, the Megatron engine runs on cuda (or cpu for tests)")
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    m = cfg.actor.megatron
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=m.tensor_model_parallel_size,
            pipeline_model_parallel_size=m.pipeline_model_parallel_size,
            expert_model_parallel_size=m.expert_model_parallel_size,
        )
    if device.type == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(cfg.actor.seed)
    else:
        # no CUDA RNG to fork; nothing random runs under the tracker (dropout is 0 with LoRA here)
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True)
    return device


def fixed_shapes(cfg: LorabusConfig, device: torch.device, moe: bool) -> bool:
    """Whether the step pads every micro-batch to one shape (`step.fixed_shape_plans`): on CPU
    a MoE model has the allgather dispatcher, which needs it under pipeline or expert
    parallelism."""
    m = cfg.actor.megatron
    split = m.pipeline_model_parallel_size > 1 or m.expert_model_parallel_size > 1
    return device.type == "cpu" and moe and split


def configure_provider(provider: Any, cfg: LorabusConfig, dtype: torch.dtype, device: torch.device) -> None:
    """Parallel sizes, dtypes and, without Transformer Engine, megatron-core's local layer spec
    with the fusions that need TE or CUDA extensions off (`LoRA` then wraps plain
    Column/RowParallelLinear layers: the TE op fuser is never asked for)."""
    m = cfg.actor.megatron
    moe = bool(getattr(provider, "num_moe_experts", None))
    provider.tensor_model_parallel_size = m.tensor_model_parallel_size
    provider.pipeline_model_parallel_size = m.pipeline_model_parallel_size
    provider.expert_model_parallel_size = m.expert_model_parallel_size
    provider.gradient_accumulation_fusion = False
    if moe:
        # the GRPO loss alone, as the FSDP2 engine optimises (HF's Qwen3-MoE adds its router
        # loss only with output_router_logits): the router is frozen under LoRA, so the
        # balancing loss could only push the adapters, and it would make the loss depend on
        # how tokens are grouped into micro-batches
        provider.moe_aux_loss_coeff = 0.0
    if m.pipeline_model_parallel_size > 1:
        # micro-batches differ in rows and length: stages exchange shapes before tensors
        # (unless padded to one shape); each micro-batch's loss is already its share of the
        # batch (no division by the schedule)
        provider.variable_seq_lengths = not fixed_shapes(cfg, device, moe)
        provider.calculate_per_token_loss = True
        # plain isend/irecv pairs: what gloo runs natively (batched p2p adds a CUDA sync)
        provider.batch_p2p_comm = device.type == "cuda"
        if not moe:
            # megatron-core refuses variable lengths with its default allgather dispatcher even
            # for a dense model, which has no dispatcher at all
            provider.moe_token_dispatcher_type = "alltoall"
    if cfg.actor.disable_dropout:
        provider.hidden_dropout = 0.0
        provider.attention_dropout = 0.0
    provider.params_dtype = dtype
    provider.pipeline_dtype = dtype
    provider.bf16 = dtype == torch.bfloat16
    provider.fp16 = dtype == torch.float16
    provider.use_cpu_initialization = device.type == "cpu"
    if not have_transformer_engine():
        provider.transformer_layer_spec = local_layer_spec
        provider.use_transformer_engine_full_layer_spec = False
        provider.use_transformer_engine_op_fuser = False
        provider.apply_rope_fusion = False
        provider.masked_softmax_fusion = False
        provider.persist_layer_norm = False
        # MoE: the local spec's experts are a SequentialMLP of Column/RowParallelLinear (one
        # LoRA per expert); TE's grouped GEMM and fused token permutation are not there
        provider.moe_grouped_gemm = False
        provider.moe_permute_fusion = False
    if device.type == "cpu" and getattr(provider, "num_moe_experts", None):
        # the alltoall dispatcher makes a CUDA stream when built; allgather is the same routing
        # without one, given equal token counts on every expert rank (CPU is for tests)
        provider.moe_token_dispatcher_type = "allgather"
    for name in ("hidden_dropout", "attention_dropout"):
        setattr(provider, name, 0.0)  # the step's proximal and trained logprobs must agree


class MegatronEngine:
    """A `TrainEngine`. `lora` is megatron-bridge's LoRA transform (it has `dim`, not `rank`);
    the service reads the adapter's shape from `lora_spec()`."""

    def __init__(self, cfg: LorabusConfig, base: nn.Module | None = None, *, pad_id: int = 0):
        if base is not None:
            raise ValueError(
                "base: the Megatron engine builds its model from actor.path with "
                "megatron-bridge; an in-memory HF model cannot be passed"
            )
        problems = check_megatron(cfg, world=int(os.environ.get("WORLD_SIZE", "1")))
        if problems:
            raise ValueError("; ".join(problems))
        self.cfg, self.actor, self.pad_id = cfg, cfg.actor, pad_id
        self.temperature = 1.0 if cfg.gconfig.greedy else cfg.gconfig.temperature
        if self.temperature <= 0:
            raise ValueError(f"gconfig.temperature: {self.temperature} must be > 0")
        self.targets = megatron_targets(self.actor)
        self.device = init_megatron(cfg)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.tp_size = parallel_state.get_tensor_model_parallel_world_size()
        self.dp_group = parallel_state.get_data_parallel_group()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.pp_group = parallel_state.get_pipeline_model_parallel_group()
        self.pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        self.is_last_stage = parallel_state.is_pipeline_last_stage()
        self.last_stage_rank = parallel_state.get_pipeline_model_parallel_last_rank()
        self.ep_size = parallel_state.get_expert_model_parallel_world_size()
        self.ep_rank = parallel_state.get_expert_model_parallel_rank()
        dtype = DTYPES[self.actor.dtype]  # the base's and the published adapter's

        torch.manual_seed(self.actor.seed)  # identical LoRA A init on every DP replica
        bridge = AutoBridge.from_hf_pretrained(self.actor.path, trust_remote_code=True, dtype=dtype)
        hf_config = bridge.hf_pretrained.config
        self.shape = ModelShape.from_hf_config(hf_config)
        self.vocab_size = int(hf_config.vocab_size)
        experts = getattr(hf_config, "num_experts", None)
        problems = model_problems(cfg.actor.megatron, int(hf_config.num_hidden_layers), experts)
        if problems:
            raise ValueError("; ".join(problems))
        provider = bridge.to_megatron_provider(load_weights=True)
        configure_provider(provider, cfg, dtype, self.device)
        provider.finalize()
        chunks = provider.provide_distributed_model(
            wrap_with_ddp=False,
            use_cpu_initialization=self.device.type == "cpu",
            bf16=dtype == torch.bfloat16,
            fp16=dtype == torch.float16,
        )
        self.lora = LoRA(
            target_modules=self.targets, dim=self.actor.lora_rank, alpha=self.actor.lora_alpha, dropout=0.0
        )
        chunks = self.lora(chunks, training=True)
        if hasattr(self.lora, "set_params_to_save"):
            self.lora.set_params_to_save(chunks)
        if len(chunks) != 1:
            raise RuntimeError(f"expected one model chunk (no virtual pipeline stages), got {len(chunks)}")
        self.model = chunks[0]
        self.model.train()
        named = adapter_named_parameters(self.model.named_parameters())
        # this rank's layers and experts in the full model's numbering (layout.py)
        self.layer_offset = layer_offset([layer.layer_number for layer in _decoder(self.model).layers])
        self.expert_offset = self.ep_rank * (experts or 0) // self.ep_size
        self.optimizer = MasterAdapterOptimizer(
            named,
            lambda params: make_optimizer(params, cfg),
            dp_group=self.dp_group,
            mp_group=parallel_state.get_model_parallel_group(),
            expert_dp_group=parallel_state.get_expert_data_parallel_group() if experts else None,
            expert_mp_group=parallel_state.get_expert_tensor_model_pipeline_parallel_group() if experts else None,
        )
        self.fixed_shape = fixed_shapes(cfg, self.device, bool(experts))
        self.scheduler = make_scheduler(self.optimizer.optimizer, self.actor.optimizer, cfg.total_train_steps)
        self.step = 0
        self._lora = lora_spec(self.actor, lora_targets.to_hf(self.targets))
        self._serving = dtype
        log.info(
            "megatron engine: tp %d pp %d ep %d dp %d, %d adapter tensors on %s",
            self.tp_size,
            self.pp_size,
            self.ep_size,
            self.dp_size,
            len(named),
            ", ".join(self.targets),
        )

    # --- the step ------------------------------------------------------------------------

    def train_step(self, groups: list[Trajectory], head_version: int) -> StepStats:
        if self.pp_size > 1:
            stats = mpipe.train_step(
                self.model,
                self.optimizer,
                groups,
                head_version,
                schedule=get_forward_backward_func(),
                schedule_context=cuda_factories_on_cpu,
                is_last_stage=self.is_last_stage,
                last_stage_rank=self.last_stage_rank,
                pp_group=self.pp_group,
                **self._step_args(),
            )
        else:
            stats = mstep.train_step(self.model, self.optimizer, groups, head_version, **self._step_args())
        self.scheduler.step()
        self.step += 1
        return stats

    def _step_args(self) -> dict[str, Any]:
        return dict(
            ppo=self.actor.ppo,
            dp_rank=self.dp_rank,
            dp_size=self.dp_size,
            dp_group=self.dp_group,
            max_tokens=self.actor.mb_spec_max_tokens,
            pad_id=self.pad_id,
            device=self.device,
            temperature=self.temperature,
            grad_clip=self.actor.optimizer.gradient_clipping,
            step_index=self.step,
            lr=float(self.scheduler.get_last_lr()[0]),
            cross_entropy=tensor_parallel.vocab_parallel_cross_entropy,
            fixed_shape=self.fixed_shape,
        )

    def canary(self) -> Canary | None:
        """The load canary of the adapter the model holds now (`megatron/canary.py`); None under
        pipeline or expert parallelism. Collective under TP: every rank calls it."""
        if self.pp_size > 1 or self.ep_size > 1:
            return None
        gather = tensor_parallel.gather_from_tensor_model_parallel_region if self.tp_size > 1 else None
        return megatron_canary(self.model, self.vocab_size, self.actor.seed, self.actor.dtype, gather)

    # --- adapter and checkpoint state ----------------------------------------------------

    def bridge_adapter_state(self) -> dict[str, torch.Tensor]:
        """The whole adapter in bridge naming and the full model's layer and expert numbers,
        fp32, on CPU; a collective over every rank (each holds its stage's, expert rank's and
        TP slice's tensors: `layout.assemble`)."""
        local = globalize(self.optimizer.master_state(), self.layer_offset, self.expert_offset)
        if self.world_size == 1:
            return local
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, (tp_rank, local))
        return assemble(gathered, self.tp_size)

    def load_bridge_adapter(self, state: Mapping[str, torch.Tensor]) -> None:
        """Set the adapter from a whole one in bridge naming (full-model numbers, as
        `bridge_adapter_state` gives): each rank takes its stage's, experts' and TP slice's
        tensors, into the fp32 masters and the model."""
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        opt = self.optimizer
        names = list(globalize(dict.fromkeys(opt.names, torch.empty(0)), self.layer_offset, self.expert_offset))
        with torch.no_grad():
            for name, master, param in zip(names, opt.masters, opt.params):
                if name not in state:
                    raise ValueError(f"state: has no {name}; pass the whole adapter of this model and targets")
                part = tp_split(name, state[name], self.tp_size)[tp_rank]
                master.copy_(part.to(master.device, master.dtype))
                if param is not master:
                    param.copy_(master.to(param.dtype))

    def adapter_state(self, into: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The whole adapter as PEFT-standard tensors in the serving dtype (`lora_spec().dtype`),
        cast once from the fp32 masters, as the FSDP2 engine publishes; call on every rank.
        `into` is ignored: `to_hf` builds new tensors anyway (the XCCL sender packs them)."""
        return {k: v.to(self._serving) for k, v in to_hf(self.bridge_adapter_state(), self.shape).items()}

    def lora_spec(self) -> LoraSpec:
        return self._lora

    def _layout(self) -> dict[str, int]:
        layout = {"world_size": self.world_size, "rank": self.rank, "tp": self.tp_size, "pp": self.pp_size}
        layout["dp"] = self.dp_size
        if self.ep_size > 1:  # absent at 1, so shards written before expert parallelism still load
            layout["ep"] = self.ep_size
        return layout

    def optimizer_state(self) -> dict[str, Any]:
        """Writes this rank's shard and returns the reference the service checkpoint stores."""
        root = self.actor.checkpoint_dir
        shards.save_shard(root, self.step, self._layout(), self.optimizer.state_dict())
        dist.barrier()  # every shard is on disk before rank 0 writes the checkpoint naming it
        if self.rank == 0:
            shards.prune(root)
        return {"megatron_shards": {"step": self.step, "world_size": self.world_size}}

    def load_state(self, adapter: dict[str, torch.Tensor], optimizer: dict[str, Any] | None, step: int) -> None:
        ref = (optimizer or {}).get("megatron_shards")
        if ref is None:
            raise ValueError(
                "checkpoint has no Megatron adapter shards (written by another backend?); a "
                "Megatron run resumes only from its own checkpoints: start a fresh "
                "actor.checkpoint_dir"
            )
        self.optimizer.load_state_dict(shards.load_shard(self.actor.checkpoint_dir, ref["step"], self._layout()))
        restored = self.adapter_state()
        # both in the serving dtype: the published copy and the masters' cast of it agree exactly
        same = set(restored) == set(adapter) and all(
            torch.equal(t, adapter[k].to(t.dtype)) for k, t in restored.items()
        )
        if not same:
            raise RuntimeError(
                f"the adapter shards of step {ref['step']} do not reproduce the checkpoint's "
                "published adapter; the checkpoint directory mixes runs: start a fresh one"
            )
        self.step = step
        for _ in range(step):
            self.scheduler.step()


def _decoder(model: nn.Module) -> Any:
    """The GPTModel's TransformerBlock under the Float16Module wrapper, if any."""
    inner: Any = model
    while not hasattr(inner, "decoder") and hasattr(inner, "module"):
        inner = inner.module
    return inner.decoder
