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
It runs on CUDA; on CPU (gloo) for tests only.
Pipeline parallelism (needs Megatron's forward-backward schedule) and expert parallelism
(expert adapter gradients reduce over the expert-data group) are refused at start.
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

from proto.messages import LoraSpec, Trajectory
from services.common import lora_targets
from services.common.adapter_io import DTYPES
from services.common.megatron_to_hf import ModelShape
from services.common.models import resolve_device
from services.config.rules import check_megatron
from services.config.schema import LorabusConfig
from services.trainer.engines.base import StepStats, lora_spec, make_optimizer
from services.trainer.engines.megatron import checkpoint as shards
from services.trainer.engines.megatron import step as mstep
from services.trainer.engines.megatron.bridge_import import have_transformer_engine, import_bridge
from services.trainer.engines.megatron.deps import require
from services.trainer.engines.megatron.optim import MasterAdapterOptimizer
from services.trainer.engines.megatron.state import (
    adapter_named_parameters,
    megatron_targets,
    merge_tp,
    to_hf,
)
from services.trainer.schedule import make_scheduler

require("megatron.core")
import_bridge()  # megatron-bridge, with or without Transformer Engine (bridge_import.py)
from megatron.bridge import AutoBridge  # noqa: E402
from megatron.bridge.models.gpt_provider import local_layer_spec  # noqa: E402
from megatron.bridge.peft.lora import LoRA  # noqa: E402
from megatron.core import parallel_state, tensor_parallel  # noqa: E402

log = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_megatron(cfg: LorabusConfig) -> torch.device:
    """Join (or, outside torchrun, create a one-rank) process group and Megatron's parallel state:
    NCCL on CUDA; gloo on CPU, which is for tests (megatron-core's RoPE calls
    `torch.cuda.current_device()` in every forward, which a CPU test must route to "cpu")."""
    device = resolve_device(cfg.actor.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if "RANK" not in os.environ:  # a plain `python -m services.trainer`: one rank
        os.environ.update(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port())
        )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif device.type != "cpu":
        raise ValueError(f"actor.device: {cfg.actor.device!r}, the Megatron engine runs on cuda (or cpu for tests)")
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    m = cfg.actor.megatron
    if m.pipeline_model_parallel_size != 1:
        raise ValueError(
            "actor.megatron.pipeline_model_parallel_size: only 1 is supported by the lorabus "
            "Megatron engine (its step does not run Megatron's pipeline schedule)"
        )
    if m.expert_model_parallel_size != 1:
        raise ValueError(
            "actor.megatron.expert_model_parallel_size: only 1 is supported by the lorabus "
            "Megatron engine (expert adapter gradients would need the expert-data group)"
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=m.tensor_model_parallel_size,
            pipeline_model_parallel_size=1,
            expert_model_parallel_size=1,
        )
    if device.type == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(cfg.actor.seed)
    else:
        # no CUDA RNG to fork; nothing random runs under the tracker (dropout is 0 with LoRA here)
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True)
    return device


def configure_provider(provider: Any, cfg: LorabusConfig, dtype: torch.dtype, device: torch.device) -> None:
    """Parallel sizes, dtypes and, without Transformer Engine, megatron-core's local layer spec
    with the fusions that need TE or CUDA extensions off (`LoRA` then wraps plain
    Column/RowParallelLinear layers: the TE op fuser is never asked for)."""
    provider.tensor_model_parallel_size = cfg.actor.megatron.tensor_model_parallel_size
    provider.pipeline_model_parallel_size = 1
    provider.expert_model_parallel_size = 1
    provider.gradient_accumulation_fusion = False
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
        # at EP 1 without one (CPU is for tests)
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
        problems = check_megatron(cfg)
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
        dtype = DTYPES[self.actor.dtype]  # the base's and the published adapter's

        torch.manual_seed(self.actor.seed)  # identical LoRA A init on every DP replica
        bridge = AutoBridge.from_hf_pretrained(self.actor.path, trust_remote_code=True, dtype=dtype)
        hf_config = bridge.hf_pretrained.config
        self.shape = ModelShape.from_hf_config(hf_config)
        self.vocab_size = int(hf_config.vocab_size)
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
            raise RuntimeError(f"expected one model chunk without pipeline parallelism, got {len(chunks)}")
        self.model = chunks[0]
        self.model.train()
        named = adapter_named_parameters(self.model.named_parameters())
        self.optimizer = MasterAdapterOptimizer(
            named,
            lambda params: make_optimizer(params, cfg),
            dp_group=self.dp_group,
            mp_group=parallel_state.get_model_parallel_group(),
        )
        self.scheduler = make_scheduler(self.optimizer.optimizer, self.actor.optimizer, cfg.total_train_steps)
        self.step = 0
        self._lora = lora_spec(self.actor, lora_targets.to_hf(self.targets))
        self._serving = dtype
        log.info(
            "megatron engine: tp %d dp %d, %d adapter tensors on %s",
            self.tp_size,
            self.dp_size,
            len(named),
            ", ".join(self.targets),
        )

    # --- the step ------------------------------------------------------------------------

    def train_step(self, groups: list[Trajectory], head_version: int) -> StepStats:
        stats = mstep.train_step(
            self.model,
            self.optimizer,
            groups,
            head_version,
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
        )
        self.scheduler.step()
        self.step += 1
        return stats

    # --- adapter and checkpoint state ----------------------------------------------------

    def bridge_adapter_state(self) -> dict[str, torch.Tensor]:
        """The whole adapter in bridge naming, fp32, on CPU (a collective over the TP group)."""
        local = self.optimizer.master_state()
        if self.tp_size == 1:
            return local
        gathered: list = [None] * self.tp_size
        dist.all_gather_object(gathered, local, group=self.tp_group)
        return merge_tp(gathered)

    def adapter_state(self, into: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The whole adapter as PEFT-standard tensors in the serving dtype (`lora_spec().dtype`),
        cast once from the fp32 masters, as the FSDP2 engine publishes; call on every rank.
        `into` is ignored: `to_hf` builds new tensors anyway (the XCCL sender packs them)."""
        return {k: v.to(self._serving) for k, v in to_hf(self.bridge_adapter_state(), self.shape).items()}

    def lora_spec(self) -> LoraSpec:
        return self._lora

    def _layout(self) -> dict[str, int]:
        return {"world_size": self.world_size, "rank": self.rank, "tp": self.tp_size, "pp": 1, "dp": self.dp_size}

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
