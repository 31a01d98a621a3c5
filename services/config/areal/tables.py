"""AReaL's keys as tables: each row says what one AReaL key becomes in lorabus.

- `Keep(areal, native, default)`: the value as written, or AReaL's default where the file has
  none (AReaL's defaults, not lorabus's: the run is the one AReaL would have run);
- `NoEffect(areal, why)`: accepted, changes nothing here, and the table says what lorabus does
  instead;
- `Only(areal, allowed, why)`: accepted at AReaL's default only; any other value is refused with
  `why`, since lorabus cannot honour it;
- a function (`transforms`, `alloc`, `servers`, `datasets`): a key whose outcome depends on
  another key.

`TABLE` is applied in order (`translator.apply`); a key given an outcome stays with it, so a
`NoEffect` for a section covers only the keys no earlier row took.
"""

from __future__ import annotations

from typing import Any

from services.config.areal import transforms as tf
from services.config.areal.alloc import backends
from services.config.areal.datasets import datasets
from services.config.areal.servers import servers
from services.config.areal.translator import Entry, Keep, NoEffect, Only

_DEPLOY = "lorabus up starts local processes; deployments use compose/kubernetes (docs/deploy.md)"
_SAMPLING_ONLY = "lorabus's rollout sends no such option to the engine"
_PPO_ONLY = (
    "is not supported: lorabus implements AReaL's decoupled PPO "
    "with GRPO group advantages only (set it back to AReaL's default)"
)
_AREAL_ACTOR = "AReaL controller option; lorabus's trainer is a bus service"
_AREAL_ROLLOUT = "AReaL controller option; lorabus's rollouts are bus services"


def _same(section: str, defaults: tuple[tuple[str, Any], ...]) -> tuple[Keep, ...]:
    """Keys lorabus has under the same name, with AReaL's defaults."""
    return tuple(Keep(f"{section}.{name}", f"{section}.{name}", default) for name, default in defaults)


TOP: tuple[Entry, ...] = (
    Keep("experiment_name", "experiment_name"),
    Keep("trial_name", "trial_name"),
    Keep("seed", "seed", 1),
    tf.run_names,
    Only(
        "enable_offload",
        False,
        "is not supported: lorabus never colocates training and "
        "generation, so there is nothing to offload to make room for (set false)",
        note="lorabus never colocates training and generation; nothing to offload",
    ),
    tf.tokenizer,
    NoEffect("rollout.tokenizer_path", "rollouts use actor.tokenizer_path (or actor.path)"),
    Only(
        "total_train_n_seqs",
        None,
        "is not supported; give total_train_epochs or total_train_steps",
        note="unset",
    ),
    Only("critic", None, "is not supported: lorabus trains GRPO (group advantages), no critic"),
    Only("teacher", None, "is not supported: lorabus has no teacher model (distillation)"),
    NoEffect(
        "dynamic_bs",
        "AReaL's dynamic_bs counts rejected trajectories toward a batch; lorabus's rollouts reject "
        "none (AReaL's example scripts pass no dynamic_filter_fn either), so every step is "
        "rollout.consumer_batch_size groups, as AReaL's would be",
    ),
    Only("eval_gconfig", None, "is not supported: `lorabus evaluate` samples with gconfig"),
)

GCONFIG: tuple[Entry, ...] = (
    *_same(
        "gconfig",
        (
            ("n_samples", 1),
            ("max_new_tokens", 16384),
            ("min_new_tokens", 0),
            ("greedy", False),
            ("top_p", 1.0),
            ("temperature", 1.0),
            ("lora_name", "default_lora"),
        ),
    ),
    tf.top_k,
    Keep("gconfig.stop_token_ids", "gconfig.stop_token_ids"),
    tf.max_tokens,
    *(
        Only(f"gconfig.{name}", default, f"is not supported: {_SAMPLING_ONLY} (remove it)")
        for name, default in (
            ("ignore_eos", False),
            ("stop", None),
            ("frequency_penalty", 0.0),
            ("seed", None),
            ("use_beam_search", False),
            ("reward_normalization", False),
            ("drop_incomplete_group", False),
        )
    ),
    Only(
        "gconfig.skip_special_tokens",
        True,
        "is not supported: lorabus decodes completions without special tokens for the reward function (remove it)",
    ),
)

_MICRO = "micro-batching changes memory and speed, not the gradient"

ACTOR: tuple[Entry, ...] = (
    Keep("actor.path", "actor.path"),
    Keep("actor.dtype", "actor.dtype", "bfloat16"),
    Only("actor.init_from_scratch", False, "is not supported: LoRA trains on a pretrained base"),
    Keep("actor.disable_dropout", "actor.disable_dropout", False),
    Keep("actor.gradient_checkpointing", "actor.gradient_checkpointing", False),
    Keep(
        "actor.mb_spec.max_tokens_per_mb",
        "actor.mb_spec_max_tokens",
        note="padded tokens per micro-batch; lorabus packs greedily in order",
    ),
    NoEffect("actor.mb_spec", _MICRO),
    NoEffect("actor.pad_to_maximum", _MICRO),
    NoEffect("actor.logprobs_chunk_size", "memory only"),
    NoEffect("actor.attn_impl", "lorabus uses transformers' default attention for the model"),
    NoEffect("actor.use_kernels", "lorabus does not kernelize the model"),
    NoEffect(
        "actor.scheduling_spec",
        "lorabus up starts one process per trainer rank; deployments "
        "place services with compose/kubernetes (docs/deploy.md)",
    ),
    NoEffect("actor.scheduling_strategy", "the trainer always runs apart from the rollout servers"),
    NoEffect("actor.offload", "lorabus never colocates training and generation"),
    NoEffect("actor.grad_reduce_dtype", "lorabus reduces the adapter's fp32 gradients"),
    NoEffect("actor.optimizer_dtype", "lorabus keeps the adapter and its optimizer state in fp32"),
    NoEffect("actor.fsdp", "lorabus's FSDP2 engine shards each decoder layer; no wrap options"),
    tf.overlong,
    tf.sapo,
    NoEffect(
        "actor.max_new_tokens", "the trainer takes lengths from the trajectories (gconfig.max_new_tokens caps them)"
    ),
    tf.actor_temperature,
    # the optimizer
    tf.optimizer_type,
    *_same(
        "actor.optimizer",
        (
            ("lr", 1e-3),
            ("weight_decay", 0.01),
            ("beta1", 0.9),
            ("beta2", 0.999),
            ("eps", 1e-8),
            ("gradient_clipping", 1.0),
            ("min_lr_ratio", 0.0),
            ("lr_scheduler_type", "constant"),
        ),
    ),
    *(
        NoEffect(f"actor.optimizer.{name}", "fp16 loss scaling; lorabus's adapter trains in fp32")
        for name in ("initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis")
    ),
    # both of AReaL's warm-up keys are lorabus's own, with AReaL's rule (the step count wins)
    Keep("actor.optimizer.warmup_steps", "actor.optimizer.warmup_steps"),
    Keep("actor.optimizer.warmup_steps_proportion", "actor.optimizer.warmup_steps_proportion", 0.001),
    # PPO: AReaL keeps these at actor level, lorabus under actor.ppo
    Keep("actor.ppo_n_minibatches", "actor.ppo.ppo_n_minibatches", 4),
    Keep("actor.eps_clip", "actor.ppo.eps_clip", 0.2),
    Keep("actor.eps_clip_higher", "actor.ppo.eps_clip_higher"),
    Keep("actor.reward_scaling", "actor.ppo.reward_scaling", 1.0),
    Keep("actor.reward_bias", "actor.ppo.reward_bias", 0.0),
    Keep("actor.reward_clip", "actor.ppo.reward_clip", 20.0),
    Keep("actor.kl_ctl", "actor.ppo.kl_ctl", 0.1, note="lorabus refuses any value but 0 (no KL term)"),
    tf.kl_estimator,
    Keep("actor.use_decoupled_loss", "actor.ppo.use_decoupled_loss", False),
    Keep(
        "actor.importance_sampling_level",
        "actor.ppo.importance_sampling_level",
        "token",
        note="sequence: GSPO's ratio, one per completion",
    ),
    tf.recompute_logprob,
    tf.rejection,
    tf.norms,
    *(
        Only(f"actor.{name}", default, _PPO_ONLY)
        for name, default in (
            ("c_clip", None),
            ("m2_threshold", None),
            ("mask_no_eos_with_zero", False),
            ("discount", 1.0),
            ("gae_lambda", 1.0),
            ("gae_timestep_unit", "token"),
            ("gae_lambda_kwargs", {}),
            ("use_cispo_loss", False),
            ("prox_logp_method", "recompute"),
            ("log_agent_stats", False),
            ("log_agent_stats_keys", []),
            ("enable_tree_training", False),
            ("is_critic", False),
        )
    ),
    # LoRA and weight updates
    *_same(
        "actor",
        (("use_lora", False), ("peft_type", "lora"), ("lora_rank", 32), ("lora_alpha", 16), ("target_modules", [])),
    ),
    tf.weight_update_mode,
    Only("actor.enable_delta_weight_update", False, "is not supported: lorabus publishes whole adapters"),
    NoEffect("actor.weight_update_delta_method", "unused without delta weight updates"),
    NoEffect("actor.weight_update_anchor_interval", "unused without delta weight updates"),
    tf.megatron,
    *(
        NoEffect(f"actor.{name}", _AREAL_ACTOR)
        for name in (
            "_version",
            "admin_api_key",
            "log_level",
            "request_timeout",
            "setup_timeout",
            "workers_ready_timeout",
        )
    ),
)

_ON_THE_BUS = "every trajectory is an event on the bus (`lorabus watch`)"
_HEALTH = "servers are waited for by their health endpoint"

ROLLOUT: tuple[Entry, ...] = (
    Keep("rollout.max_concurrent_rollouts", "rollout.max_concurrent_rollouts"),
    Keep("rollout.consumer_batch_size", "rollout.consumer_batch_size", 1),
    Keep("rollout.max_head_offpolicyness", "rollout.max_head_offpolicyness", 0),
    Keep("rollout.use_lora", "rollout.use_lora", False),
    tf.rollout_lora_name,
    Keep("rollout.request_timeout", "rollout.request_timeout_s"),
    NoEffect("rollout.queue_size", "the queue is the bus's trajectory stream"),
    NoEffect("rollout.enable_rollout_tracing", _ON_THE_BUS),
    NoEffect("rollout.dump_to_file", _ON_THE_BUS),
    NoEffect("rollout.fileroot", "lorabus writes under run_dir and store.uri"),
    NoEffect("rollout.scheduling_spec", "lorabus up starts the rollout sidecars; deployments place them"),
    NoEffect("rollout.scheduling_strategy", "the rollout servers always run apart from the trainer"),
    NoEffect(
        "rollout.agent",
        "lorabus's rollout is one generation per sample scored by "
        "train_dataset.reward_fn (AReaL's inline single-turn workflow)",
    ),
    NoEffect("rollout.request_retries", "the sidecar retries a failed generation until its lease ends"),
    NoEffect("rollout.setup_timeout", _HEALTH),
    NoEffect("rollout.workers_ready_timeout", _HEALTH),
    NoEffect("rollout.pause_grace_period", "lorabus never pauses generation for weight updates"),
    *(
        Only(f"rollout.{name}", False, "is not supported by lorabus's rollout (remove it)")
        for name in (
            "deterministic_sampling",
            "serialize_group_samples",
            "check_trajectory_format",
            "return_routed_experts",
        )
    ),
    *(
        NoEffect(f"rollout.{name}", _AREAL_ROLLOUT)
        for name in (
            "_version",
            "model",
            "routing_strategy",
            "poll_interval",
            "admin_api_key",
            "api_url",
            "provider_api_key",
        )
    ),
)

UTILITIES: tuple[Entry, ...] = (
    NoEffect("cluster.fileroot", "lorabus writes under run_dir (./runs/<run>) and the object store (store.uri)"),
    NoEffect("cluster.name_resolve", "services find each other through NATS (bus.url)"),
    NoEffect("cluster", "lorabus up runs on this host; deployments size each service (docs/deploy.md)"),
    NoEffect("scheduler", _DEPLOY),
    NoEffect("launcher", _DEPLOY),
    NoEffect(
        "saver",
        "the trainer checkpoints every actor.checkpoint_every steps, and the exporter "
        "writes every version as a PEFT directory (exporter.uri)",
    ),
    NoEffect(
        "recover",
        "recovery is always on: the trainer resumes from its last checkpoint and the registry replays its journal",
    ),
    NoEffect("evaluator", "`lorabus evaluate` scores every new version on valid_dataset"),
    NoEffect(
        "stats_logger",
        "metrics are Prometheus (metrics.port) and events on the bus (`lorabus watch`); no wandb/swanlab/tensorboard",
    ),
    NoEffect("perf_tracer", "no tracer; per-service Prometheus metrics instead"),
    NoEffect("memory_profiler", "no memory profiler"),
    NoEffect("post_exit_hook", "no exit hook"),
    NoEffect(
        "ref",
        "no reference model: lorabus has no KL term (kl_ctl must be 0); with LoRA the "
        "frozen base would be the reference",
    ),
)

TABLE: tuple[Entry, ...] = (*TOP, backends, *GCONFIG, *ACTOR, *ROLLOUT, servers, datasets, *UTILITIES)
"""the whole translation, in the order its rows are reported"""
