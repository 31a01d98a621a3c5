"""What every trainer engine (fsdp2, megatron) offers the trainer service, and the pieces both share.

The service sees only `TrainEngine`: it never reaches into a backend's model, LoRA wrapper or
optimizer, so a third backend needs one new file under `engines/` and nothing in the service.
Every rank holds one engine and calls the collective methods (`train_step`, `adapter_state`,
`optimizer_state`, `load_state`) in the same order; only rank 0 talks to the bus.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, NoReturn, Protocol, TypeGuard, runtime_checkable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from proto.messages import Canary, LoraSpec, Mismatch, Trajectory
from services.config.schema import ActorConfig, LorabusConfig, PPOConfig
from services.trainer import batching
from services.trainer.loss import LossStats, decoupled_ppo_loss

TIMEOUT_ENV = "LORABUS_DIST_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0


def lora_spec(actor: ActorConfig, target_modules: list[str], base_model: str | None = None) -> LoraSpec:
    """The one builder of the `LoraSpec` every engine publishes: rank, alpha, the HF names of
    the modules that carry LoRA (resolved: no all-linear), the serving dtype `actor.dtype` the
    adapter is published in (never the fp32 masters', docs/design.md "Precision and memory"),
    and the base model id (`actor.path` unless a run names its own)."""
    return LoraSpec(
        rank=actor.lora_rank,
        alpha=float(actor.lora_alpha),
        target_modules=target_modules,
        dtype=actor.dtype,
        base_model=base_model if base_model is not None else actor.path,
    )


@dataclass
class StepStats:
    step: int
    """optimiser-step counter after this train step (0-based index of the step just done)"""
    loss: float
    reward_mean: float
    groups: int
    tokens: int
    grad_norm: float
    lr: float
    step_seconds: float
    loss_stats: dict[str, float] = field(default_factory=dict)
    mismatch: Mismatch | None = None
    """behaviour against trainer logprobs over the batch (`trainer.mismatch`); None: an engine
    that does not measure it"""
    group_kl: list[float] = field(default_factory=list)
    """each group's mean per-token KL, in batch order (what actor.max_train_infer_kl judges)"""
    refused: dict[str, str] = field(default_factory=dict)
    """trajectory id -> why the step refused it (not trained: beyond actor.max_train_infer_kl)"""
    trained_at: float = 0.0
    """time.time() when the update ended (`ranks.run_step`)"""
    canary: Canary | None = None
    """the new version's canary (`ranks.run_step`), for its AdapterReady"""
    canary_seconds: float | None = None
    canary_wait_seconds: float | None = None
    """how long the announcement waited for the canary (`runs.step`)"""

    @property
    def mean_staleness(self) -> float:
        return self.loss_stats.get("mean_staleness", 0.0)


def summed_over_ranks(
    stats: LossStats, loss_total: float, *, group: dist.ProcessGroup | None = None, device: torch.device | str = "cpu"
) -> tuple[LossStats, float]:
    """One rank's loss sums and summed loss, added up over the ranks of `group` (the largest
    importance weight taken, not the sum); a collective, the tensors staged on `device`."""
    packed = torch.cat([stats.as_tensor(), torch.tensor([loss_total], dtype=torch.float64)]).to(device)
    dist.all_reduce(packed, group=group)
    peak = torch.tensor([stats.imp_weight_max], dtype=torch.float64, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    summed = LossStats.from_tensor(packed[:-1].cpu())
    summed.imp_weight_max = float(peak)
    return summed, float(packed[-1])


def step_stats(
    groups: list[Trajectory],
    *,
    step: int,
    updates: int,
    loss_total: float,
    stats: LossStats,
    grad_norm: float,
    lr: float,
    started: float,
) -> StepStats:
    """The report of a train step over `groups` that made `updates` optimiser updates since
    `started` (time.perf_counter): loss per update, reward over every completion."""
    rewards = [c.reward for g in groups for c in g.completions]
    return StepStats(
        step=step,
        loss=loss_total / updates,
        reward_mean=sum(rewards) / len(rewards),
        groups=len(groups),
        tokens=int(stats.tokens),
        grad_norm=grad_norm,
        lr=lr,
        step_seconds=time.perf_counter() - started,
        loss_stats=stats.summary(),
    )


def micro_batch_loss(
    lp: Tensor, prox: Tensor, mb: batching.MicroBatch, head_version: int, ppo: PPOConfig, device: torch.device | str
) -> tuple[Tensor, LossStats]:
    """The decoupled PPO loss of one micro-batch (every engine's): its share of the whole batch's loss,
    with `ppo`'s settings and staleness against `head_version`."""
    return decoupled_ppo_loss(
        lp,
        prox,
        mb.behave_logprobs.to(device),
        mb.advantages.to(device),
        mb.loss_weights.to(device),
        eps_clip=ppo.eps_clip,
        eps_clip_higher=ppo.eps_clip_higher,
        imp_weight_cap=ppo.behav_imp_weight_cap,
        imp_weight_mode=ppo.behav_imp_weight_mode,
        use_decoupled_loss=ppo.use_decoupled_loss,
        importance_sampling_level=ppo.importance_sampling_level,
        sapo_taus=(ppo.sapo_tau_pos, ppo.sapo_tau_neg) if ppo.use_sapo_loss else None,
        staleness=(head_version - mb.versions).clamp(min=0).to(device).float(),
    )


class TrainEngine(Protocol):
    """What the trainer service needs from a backend; every rank holds one."""

    rank: int
    world_size: int
    device: torch.device
    step: int
    """train steps completed"""
    vocab_size: int
    """token ids at or above it are rejected before they reach the model"""

    def lora_spec(self) -> LoraSpec:
        """The published adapter's shape, in HF PEFT terms (what every `AdapterReady` carries)."""
        ...

    def train_step(self, groups: list[Trajectory], head_version: int) -> StepStats:
        """One step on `groups` (every rank passes the same batch); collective."""
        ...

    def adapter_state(self, into: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The whole adapter as PEFT-standard tensors on CPU in the published dtype; collective.
        `into`: tensors of exactly that layout to write it into (the XCCL sender's free send
        set: then the broadcast needs no pack copy); an engine may ignore it and return new
        ones, which the sender then packs."""
        ...

    def optimizer_state(self) -> dict[str, Any]:
        """What a checkpoint stores to resume the optimizer, as it is now: later steps do not
        change what was returned (it is saved while the next step trains); collective."""
        ...

    def load_state(self, adapter: dict[str, torch.Tensor], optimizer: dict[str, Any] | None, step: int) -> None:
        """Restore a checkpoint (every rank passes the full adapter); collective."""
        ...


@runtime_checkable
class CanaryEngine(Protocol):
    """An engine that can answer the load canary with the adapter it holds now (fsdp2)."""

    def canary(self) -> Canary:
        """Greedy continuations of the run's canary prompts under the current adapter, in the
        serving dtype (`services.trainer.canary`); collective: every rank calls it."""
        ...


class JointStepFailed(RuntimeError):
    """A joint step (`SharedBaseEngine.train_together`) raised. `updated`: whether any run's
    optimizer had stepped by then (if not, each run can be stepped alone to find whose batch it
    was; if so, their states moved)."""

    def __init__(self, message: str, *, updated: bool):
        super().__init__(message)
        self.updated = updated


@runtime_checkable
class SharedBaseEngine(TrainEngine, Protocol):
    """An engine other runs can join: one base model, one adapter per run (docs/multi-run.md).
    The fsdp2 engine is one; in one process only (`shares_base`), since shards are not re-cut."""

    def sibling(self, cfg: LorabusConfig, adapter: str) -> SharedBaseEngine:
        """An engine for the run `cfg` on this engine's model: its own adapter `adapter` (its
        rank, alpha and targets), optimizer, schedule and step counter; no second base."""
        ...

    def drop(self) -> None:
        """Take this engine's adapter off the shared model (a sibling whose run ended)."""
        ...

    def train_together(self, batches: list[tuple[Any, list[Trajectory], int]]) -> list[StepStats]:
        """One train step for each (engine, groups, head version) of `batches`: engines of
        distinct runs on this engine's model, stepped in the same forwards and backwards, each
        run's update its solo step's; the stats in that order. Raises `JointStepFailed`."""
        ...

    def canary_together(self, engines: list[Any]) -> list[Canary]:
        """`CanaryEngine.canary` of each of `engines` (distinct runs on this engine's model),
        computed in the same forwards; in that order."""
        ...


def shares_base(engine: TrainEngine) -> TypeGuard[SharedBaseEngine]:
    """Whether other runs can join `engine`'s model: a `SharedBaseEngine` in one process."""
    return isinstance(engine, SharedBaseEngine) and engine.world_size == 1


def collective_timeout_s() -> float:
    """How long a rank waits in one collective before failing (not hanging) when a peer is
    stuck; `LORABUS_DIST_TIMEOUT_S` overrides it. Idle ranks are kept under it by rank 0's
    heartbeats, so it only has to cover the longest gap between two collectives."""
    raw = os.environ.get(TIMEOUT_ENV, "")
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if value <= 0:
        raise ValueError(f"{TIMEOUT_ENV}: {raw!r} must be a number of seconds > 0")
    return value


def init_distributed(device: torch.device) -> tuple[int, int]:
    """(rank, world size); joins the torchrun group when launched with WORLD_SIZE > 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    if not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=collective_timeout_s())
        )
        if device.type == "cuda":
            torch.cuda.set_device(device)
    return dist.get_rank(), dist.get_world_size()


def leave_distributed() -> NoReturn:
    """Leave the torchrun group once every rank has reached here, then end this process with
    status 0, skipping the interpreter's teardown (so it is the last call of a rank's work).

    The barrier keeps a rank from leaving while a peer still needs it in a collective. The
    exit is `os._exit` because a gloo worker thread releases a finished collective only after
    the caller's wait has returned, and a barrier also keeps alive the collectives still in
    flight when it was issued (`AsyncBarrierWork.priorWork`). Their tensors were made in Python,
    so that release takes the GIL; once `Py_FinalizeEx` has begun, Python 3.11 ends such a
    thread with `pthread_exit`, whose unwind through the C++ destructor calls std::terminate:
    "terminate called without an active exception", SIGABRT, and torchrun fails the job (a
    core dump shows ~AsyncBarrierWork -> ~AsyncAllgatherWork -> decref_pyobject -> take_gil
    during Py_FinalizeEx; 4 runs in 100 under CPU load). Only the C++ group's destructor joins
    those threads, and the group outlives `destroy_process_group` (FSDP's modules and device
    mesh still hold it after the engine is dropped and collected), so the process ends before
    finalization can start instead."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def make_optimizer(params: list[nn.Parameter], cfg: LorabusConfig) -> torch.optim.Optimizer:
    opt = cfg.actor.optimizer
    if opt.lr <= 0:
        raise ValueError(f"actor.optimizer.lr: {opt.lr} must be > 0")
    if opt.type == "adamw":
        return torch.optim.AdamW(
            params, lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps, weight_decay=opt.weight_decay
        )
    if opt.type == "adam":
        return torch.optim.Adam(
            params, lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps, weight_decay=opt.weight_decay
        )
    if opt.type == "sgd":
        return torch.optim.SGD(params, lr=opt.lr, weight_decay=opt.weight_decay)
    raise ValueError(f"actor.optimizer.type: {opt.type!r} must be adamw, adam or sgd")
