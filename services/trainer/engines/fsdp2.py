"""The FSDP2 engine: torch `fully_shard` over a peft LoRA model, one train step per batch.

One process (no torchrun) runs unsharded and needs no process group: sharding one rank buys
nothing, and `init_process_group` would need a rendezvous port for no reason. Under torchrun
(WORLD_SIZE > 1) each decoder layer and then the root are sharded with `fully_shard` (gloo
on CPU, NCCL on GPU); ranks work on disjoint slices of the batch and FSDP averages their
gradients, which the loss compensates for so that the update equals the single-process one.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from proto.messages import Canary, LoraSpec, Trajectory
from services.common.models import resolve_device
from services.config.schema import LorabusConfig
from services.trainer import canary as trainer_canary
from services.trainer import precision, startup
from services.trainer.engines import fsdp2_step
from services.trainer.engines.base import StepStats, init_distributed, make_optimizer
from services.trainer.lora import (
    adapter_state,
    add_lora,
    lora_parameters,
    lora_spec,
    rows_by_adapter,
    set_active_adapter,
    unroutable,
    wrap_lora,
)
from services.trainer.schedule import make_scheduler

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a (peft-wrapped) HF causal LM: FSDP2's sharding units."""
    get_base_model = getattr(model, "get_base_model", None)  # peft's
    inner = get_base_model() if get_base_model is not None else model
    layers = getattr(getattr(inner, "model", None), "layers", None)
    if layers is None:
        raise ValueError(
            f"{type(inner).__name__}: no `model.layers` to shard; the fsdp2 engine supports "
            "HF decoder-only models (Llama/Qwen/Mistral layout)"
        )
    return list(layers)


_SHARED = ("device", "rank", "world_size", "pad_id", "dtype", "vocab_size", "model")
"""what sibling engines (one per run of a fleet) share: the one base model and its placement"""


def optimizer_state_by_name(optimizer: torch.optim.Optimizer, named: list[tuple[str, nn.Parameter]]) -> dict[str, Any]:
    """What `get_optimizer_state_dict(full_state_dict=True, cpu_offload=True)` returns in one
    process (state and param groups keyed by parameter name, tensors copied to the CPU), from
    the engine's own named parameters: torch's finds each name by walking every parameter of the
    model, 260 ms a call with 8 runs' adapters on a 28-layer model on this project's CPU, and
    every step of every run checkpoints by default (`actor.checkpoint_every` 1)."""
    names: dict[torch.Tensor, str] = {p: name for name, p in named}

    def off(value: Any) -> Any:
        return value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else copy.deepcopy(value)

    return {
        "state": {names[p]: {k: off(v) for k, v in s.items()} for p, s in optimizer.state.items()},
        "param_groups": [
            {**{k: off(v) for k, v in g.items() if k != "params"}, "params": [names[p] for p in g["params"]]}
            for g in optimizer.param_groups
        ],
    }


class FSDP2Engine:
    """Owns the model, optimizer and the step counter; knows nothing about the bus."""

    def __init__(self, cfg: LorabusConfig, base: PreTrainedModel | None = None, *, pad_id: int = 0):
        self.cfg = cfg
        self.actor = cfg.actor
        self.device = resolve_device(self.actor.device)
        self.rank, self.world_size = init_distributed(self.device)
        self.pad_id = pad_id
        self.temperature = 1.0 if cfg.gconfig.greedy else cfg.gconfig.temperature
        if self.temperature <= 0:
            raise ValueError(
                f"gconfig.temperature: {self.temperature} must be > 0 (use gconfig.greedy for greedy decoding)"
            )
        # Every rank must build the identical base and LoRA init; the seed makes it so (a
        # base read by rank 0 alone reaches the others with its LoRA init, see startup.py).
        torch.manual_seed(self.actor.seed)
        self.dtype = precision.compute_dtype(self.actor.dtype)
        from_rank0 = base is None and self.world_size > 1
        if base is None:
            base = startup.load_base(self.actor, self.device, self.rank, self.world_size)
        if not from_rank0:
            # transformers wraps `to` with functools.wraps(nn.Module.to), which mypy reads as unbound
            base = base.to(device=self.device, dtype=self.dtype)  # type: ignore[call-arg]
        base.config.use_cache = False
        if self.actor.gradient_checkpointing:
            startup.enable_gradient_checkpointing(base)
        embeddings = base.get_input_embeddings()
        if not isinstance(embeddings, nn.Embedding):
            raise ValueError(
                f"{type(base).__name__}: input embeddings are a {type(embeddings).__name__}, not an "
                "nn.Embedding; the fsdp2 engine supports HF decoder-only models (Llama/Qwen/Mistral layout)"
            )
        self.vocab_size = embeddings.num_embeddings
        self.model = wrap_lora(base, self.actor)  # LoRA parameters: fp32 masters
        if self.actor.disable_dropout:
            startup.disable_dropout(self.model)
        self.adapter = "default"
        """the peft adapter this engine trains (a fleet's other runs are siblings: `sibling`)"""
        self.lora = lora_spec(self.model, self.actor)
        if self.world_size > 1:
            state = startup.full_state(self.model, self.rank) if from_rank0 else None
            self._shard()
            if state is not None:
                startup.receive_weights(self.model, state, self.device)
                del state  # rank 0's full copy: only its shard stays
        self.model.train()
        self._train_state()

    def _train_state(self) -> None:
        self.named_params = lora_parameters(self.model, self.adapter)
        self.params = [p for _, p in self.named_params]
        self.optimizer = make_optimizer(self.params, self.cfg)
        self.scheduler = make_scheduler(self.optimizer, self.actor.optimizer, self.cfg.total_train_steps)
        self.step = 0

    def sibling(self, cfg: LorabusConfig, adapter: str) -> FSDP2Engine:
        """An engine for another run on this engine's model: a new peft adapter `adapter` (the
        run's own rank, alpha and targets) with its own optimizer, schedule and step counter,
        and no second copy of the base. One process only: FSDP2 shards are not re-cut."""
        if self.world_size > 1:
            raise ValueError(
                f"actor.nproc_per_node: {self.world_size}; a fleet of several runs trains in one "
                "trainer process (nproc_per_node: 1)"
            )
        if adapter in self.model.peft_config:
            raise ValueError(f"adapter: {adapter!r} is already on the model; one adapter per run")
        other = object.__new__(FSDP2Engine)
        other.__dict__.update({k: self.__dict__[k] for k in _SHARED})
        other.cfg, other.actor, other.adapter = cfg, cfg.actor, adapter
        other.temperature = 1.0 if cfg.gconfig.greedy else cfg.gconfig.temperature
        torch.manual_seed(cfg.actor.seed)
        add_lora(self.model, cfg.actor, adapter)
        other.lora = lora_spec(self.model, cfg.actor, adapter=adapter)
        other._train_state()
        return other

    def drop(self) -> None:
        """Take this engine's adapter off the shared model (a sibling whose run ended)."""
        if self.adapter == "default":
            raise ValueError("adapter: the model's first adapter stays; drop siblings only")
        self.model.delete_adapter(self.adapter)
        self.named_params, self.params, self.optimizer = [], [], None  # type: ignore[assignment]

    def activate(self) -> None:
        # peft runs (and trains) only the active adapter; with one adapter it always is
        if len(self.model.peft_config) > 1:
            set_active_adapter(self.model, self.adapter)

    def _shard(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(self.device.type, (self.world_size,))
        for layer in decoder_layers(self.model):
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    # --- the step ------------------------------------------------------------------------

    def train_step(self, groups: list[Trajectory], head_version: int) -> StepStats:
        """One train step on `groups` (every rank passes the same batch): proximal logprobs
        with no grad, then `ppo_n_minibatches` optimiser updates. `head_version` is the
        version being trained (for staleness = head_version - token version). Groups beyond
        `actor.max_train_infer_kl` are left out before any update (`StepStats.refused`); when
        none is left, the step makes no update (`groups` 0)."""
        return fsdp2_step.train([fsdp2_step.RunBatch(self, groups, head_version)])[0]

    def train_together(self, batches: list[tuple[FSDP2Engine, list[Trajectory], int]]) -> list[StepStats]:
        """One train step for each (engine, groups, head version) of `batches`: this engine and
        its siblings, in the same forwards and backwards (`fsdp2_step`); stats in that order."""
        return fsdp2_step.train([fsdp2_step.RunBatch(e, g, v) for e, g, v in batches])

    def canary(self) -> Canary:
        """The adapter now in the model on the run's canary prompts, in the serving dtype
        (autocast, as the step's forwards), dropout off; collective under FSDP2."""
        self.activate()
        prompt_ids = trainer_canary.prompts(self.vocab_size, seed=self.actor.seed)
        with trainer_canary.evaluating(self.model), precision.forward_context(self.device, self.dtype):
            return trainer_canary.reference(self.model, prompt_ids, self.actor.dtype)

    def canary_together(self, engines: list[FSDP2Engine]) -> list[Canary]:
        """`canary` of each of `engines` (this engine and its siblings), decoded in the same
        forwards with each run's rows through its own adapter (`lora.rows_by_adapter`); one
        after another where the adapters cannot be routed so (`lora.unroutable`)."""
        if unroutable(self.model) is not None:
            return [e.canary() for e in engines]
        with (
            trainer_canary.evaluating(self.model),
            precision.forward_context(self.device, self.dtype),
            rows_by_adapter(self.model) as route,
        ):
            return trainer_canary.references(
                self.model,
                [trainer_canary.prompts(e.vocab_size, seed=e.actor.seed) for e in engines],
                [e.actor.dtype for e in engines],
                route=route,
                adapters=[e.adapter for e in engines],
            )

    # --- adapter and checkpoint state ----------------------------------------------------

    def adapter_state(self, into: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The full adapter on CPU in the serving dtype (`lora_spec().dtype`), cast once from
        the fp32 masters (a collective under FSDP2: call on every rank); written into `into`
        when it fits (`lora.adapter_state`)."""
        return adapter_state(self.named_params, self.dtype, into)

    def lora_spec(self) -> LoraSpec:
        return self.lora

    def optimizer_state(self) -> dict[str, Any]:
        """Full optimizer state keyed by parameter name (on rank 0; empty on the others), copied
        off the optimizer (`TrainEngine.optimizer_state`)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        state: dict[str, Any]
        if self.world_size == 1:
            state = optimizer_state_by_name(self.optimizer, self.named_params)
        else:
            full = StateDictOptions(full_state_dict=True, cpu_offload=True)
            state = dict(get_optimizer_state_dict(self.model, self.optimizer, options=full))
            if self.device.type == "cpu":  # offloading copied nothing: these are the live tensors
                state = copy.deepcopy(state)
        if self.dtype != precision.MASTER_DTYPE:  # the published adapter lost the low bits
            masters = adapter_state(self.named_params)  # a collective too
            if self.rank == 0:
                state[precision.MASTERS_KEY] = masters
        return state

    def load_state(self, adapter: dict[str, torch.Tensor], optimizer: dict[str, Any] | None, step: int) -> None:
        """Restore from a checkpoint (every rank passes the full tensors). The fp32 masters
        kept in `optimizer` win over the published (serving-dtype) `adapter`."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        from services.common.adapter_io import standardize_key

        optimizer = dict(optimizer or {})
        adapter = optimizer.pop(precision.MASTERS_KEY, None) or adapter
        names = {standardize_key(name): name for name, _ in lora_parameters(self.model, self.adapter)}
        missing = sorted(set(names) - set(adapter))
        unexpected = sorted(set(adapter) - set(names))
        if missing or unexpected:
            raise ValueError(
                f"checkpoint adapter does not fit this model (missing {missing[:3]}, unexpected "
                f"{unexpected[:3]}); was actor.lora_rank/target_modules changed? start a fresh "
                "actor.checkpoint_dir"
            )
        options = StateDictOptions(full_state_dict=True, strict=False)
        # peft trains (requires_grad) the active adapter only, and torch builds the optimizer
        # state it loads into from trainable parameters: a sibling resuming while another run's
        # adapter is active found none ("Expected device to be set")
        self.activate()
        # one scatter per tensor under FSDP2: every rank must go in the same (the model's)
        # order, and a dict read from safetensors is not ordered the same in every process
        set_model_state_dict(self.model, {name: adapter[key] for key, name in names.items()}, options=options)
        # plain SGD keeps no per-parameter state, and torch cannot distribute an empty one
        # (its param_groups' lr comes back through the scheduler below)
        if optimizer and optimizer.get("state"):
            set_optimizer_state_dict(
                self.model, self.optimizer, optimizer, options=StateDictOptions(full_state_dict=True)
            )
        self.step = step
        for _ in range(step):  # the LR schedule is a pure function of the step
            self.scheduler.step()
