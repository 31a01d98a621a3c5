"""The rules a config must satisfy across its fields: each a pure function `cfg -> list[str]`.

    problems = validate(cfg)   # every rule's messages, in RULES order; empty means usable

A rule reads a back-filled `LorabusConfig` and returns messages of the form
`<dotted.field>: <bad value> <what is wrong>; <the fix>`, never raising: the loader
(`services.config.loader`) collects them with the shape and type problems, so a user fixes a
broken file in one pass. Rules hold no state and do no I/O; configs built in code (tests,
engines) are checked by the same functions.
"""

from __future__ import annotations

import re

from proto.subjects import SubjectError, token
from services.common import lora_targets
from services.common.lora_targets import ALL_LINEAR, VLLM_LORA_RANKS
from services.config.megatron_layout import layout_problems
from services.config.schema import ActorConfig, LorabusConfig

__all__ = ["RULES", "validate"]


def check_lora(cfg: LorabusConfig) -> list[str]:
    a, out = cfg.actor, []
    if a.peft_type != "lora":
        out.append(f"actor.peft_type: {a.peft_type!r} is not supported; lorabus trains LoRA only (peft_type: lora)")
    if not a.use_lora:
        out.append(
            "actor.use_lora: false is not supported; lorabus moves LoRA adapters between services "
            "and never full weights (use_lora: true)"
        )
    if a.use_lora != cfg.rollout.use_lora:
        out.append(
            f"rollout.use_lora: {cfg.rollout.use_lora} disagrees with actor.use_lora: {a.use_lora}; "
            "the rollouts must serve what the trainer trains (set both to true, or write "
            "rollout.use_lora: ${actor.use_lora})"
        )
    if a.lora_rank < 1:
        out.append(f"actor.lora_rank: {a.lora_rank} must be >= 1 (AReaL's default is 32)")
    if not a.lora_alpha > 0:
        out.append(f"actor.lora_alpha: {a.lora_alpha} must be > 0; the LoRA scale is alpha / rank")
    return out


def check_mismatch(cfg: LorabusConfig) -> list[str]:
    limit = cfg.actor.max_train_infer_kl
    if limit is not None and not limit > 0:
        return [
            f"actor.max_train_infer_kl: {limit}, a KL threshold must be > 0; set a positive bound (NeMo-RL "
            "measured a mean of 2e-3 with a native adapter) or null to refuse nothing"
        ]
    return []


def check_lora_name(cfg: LorabusConfig) -> list[str]:
    g, ro, out = cfg.gconfig.lora_name, cfg.rollout.lora_name, []
    if ro and ro != g:
        out.append(
            f"rollout.lora_name: {ro!r} differs from gconfig.lora_name: {g!r}; gconfig.lora_name is "
            "the single source of the adapter name (leave rollout.lora_name empty)"
        )
    try:
        token(g, "gconfig.lora_name")
    except SubjectError as e:
        out.append(f"{e}, since it becomes server adapter names and paths")
    return out


def check_engine_matrix(cfg: LorabusConfig) -> list[str]:
    """XCCL works with every trainer backend and rollout engine: a vLLM/SGLang sidecar joins the
    group, receives the version into memory and has its server load it from the adapter
    directory (docs/xccl.md). What cannot work is an nccl group whose server sidecar has no GPU
    to receive on."""
    a, ro = cfg.actor, cfg.rollout
    if a.weight_update_mode != "xccl" or ro.engine == "embedded":
        return []
    if a.xccl_backend == "nccl" and ro.device == "cpu":
        return [
            f"actor.xccl_backend: 'nccl' with rollout.engine {ro.engine} and rollout.device: cpu: "
            "the sidecar receives an nccl broadcast into GPU memory; set rollout.device: auto "
            "(or cuda), or actor.xccl_backend: gloo"
        ]
    return []


def check_megatron(cfg: LorabusConfig, world: int | None = None) -> list[str]:
    """`world`: the trainer's real rank count where it is known (the engine), else
    actor.nproc_per_node."""
    a = cfg.actor
    if a.backend != "megatron" or not a.use_lora:
        return []
    m, out = a.megatron, []
    if m.bridge_type != "megatron-bridge":
        out.append(
            f"actor.megatron.bridge_type: {m.bridge_type!r} cannot train LoRA; Megatron LoRA is "
            "megatron-bridge's PEFT (set actor.megatron.bridge_type: megatron-bridge)"
        )
    if m.use_distributed_optimizer:
        out.append(
            "actor.megatron.use_distributed_optimizer: true is not supported with LoRA: the "
            "distributed optimizer shards contiguous buffers of all parameters, frozen base "
            "included, and the adapter's optimizer state is too small to gain from sharding "
            "(set it to false)"
        )
    if m.gradient_accumulation_fusion:
        out.append(
            "actor.megatron.gradient_accumulation_fusion: true is not supported with LoRA: the "
            "fused kernel accumulates weight gradients into each base weight's main_grad, which "
            "frozen base weights do not have (set it to false)"
        )
    if a.max_train_infer_kl is not None:
        # the Megatron step measures the mismatch (reported with every step) but leaves no group
        # out; a threshold it would never apply is refused, not ignored
        out.append(
            f"actor.max_train_infer_kl: {a.max_train_infer_kl} is not applied by the Megatron engine, "
            "which reports the train/inference mismatch but refuses no group (unset it, or use "
            "actor.backend: fsdp2 to refuse groups beyond it)"
        )
    # Checked here rather than at trainer start, so that `lorabus up` fails before it starts
    # anything (the engine repeats it with its real world size)
    if world is None:
        out += layout_problems(m, a.nproc_per_node)
    else:
        out += layout_problems(m, world, "the trainer's world size (torchrun --nproc_per_node)")
    return out


def check_unimplemented(cfg: LorabusConfig) -> list[str]:
    """Fields the schema carries for AReaL's sake whose non-default values lorabus does not
    implement: refused, never accepted and ignored."""
    out, ppo = [], cfg.actor.ppo
    if ppo.kl_ctl != 0:
        out.append(
            f"actor.ppo.kl_ctl: {ppo.kl_ctl} is not supported; lorabus has no KL term (AReaL adds "
            "-kl_ctl * KL(old || ref) to per-token rewards, and lorabus's advantages are per "
            "completion); set kl_ctl: 0, as AReaL's LoRA examples do"
        )
    if cfg.gconfig.min_new_tokens != 0:
        out.append(
            f"gconfig.min_new_tokens: {cfg.gconfig.min_new_tokens} is not supported; lorabus's "
            "rollout engines do not suppress stop tokens before a minimum length; set it to 0"
        )
    if ppo.reward_clip is not None and not ppo.reward_clip > 0:
        out.append(f"actor.ppo.reward_clip: {ppo.reward_clip} must be > 0 (or null: no clipping)")
    if not ppo.norm_eps >= 0:
        out.append(f"actor.ppo.norm_eps: {ppo.norm_eps} must be >= 0")
    if not 0.0 <= cfg.actor.optimizer.min_lr_ratio <= 1.0:
        out.append(f"actor.optimizer.min_lr_ratio: {cfg.actor.optimizer.min_lr_ratio} must be in [0, 1]")
    return out


def check_target_modules(cfg: LorabusConfig) -> list[str]:
    return lora_targets.problems(cfg.actor.target_modules, cfg.actor.backend)


def check_offpolicyness(cfg: LorabusConfig) -> list[str]:
    ro, g, out = cfg.rollout, cfg.gconfig, []
    k = ro.max_head_offpolicyness
    if k < 0:
        out.append(f"rollout.max_head_offpolicyness: {k} must be >= 0 (0 = strictly on-policy)")
    keep = cfg.rollout.keep_versions
    if keep < 1:
        out.append(f"rollout.lora_keep_versions: {keep} must be >= 1 (the head version stays loaded)")
    elif keep < k + 1:
        out.append(
            f"rollout.lora_keep_versions: {keep} is below max_head_offpolicyness + 1 = {k + 1}; "
            "every admissible version must stay loaded (raise it, or leave it unset)"
        )
    if ro.consumer_batch_size < 1:
        out.append(f"rollout.consumer_batch_size: {ro.consumer_batch_size} must be >= 1 (groups per trainer step)")
    mcr = ro.max_concurrent_rollouts
    if mcr is not None and mcr < 1:
        out.append(f"rollout.max_concurrent_rollouts: {mcr} must be >= 1 (or unset: defaults to consumer_batch_size)")
    if g.n_samples < 1:
        out.append(f"gconfig.n_samples: {g.n_samples} must be >= 1 (completions per prompt)")
    elif (
        g.n_samples == 1
        and cfg.actor.ppo.reward_norm
        and cfg.actor.ppo.group_adv_norm
        and not cfg.actor.ppo.leave_one_out
    ):
        # An error, not a warning: a group of one has reward - group mean = 0 for every sample,
        # so every advantage is zero and training silently does nothing.
        out.append(
            "gconfig.n_samples: 1 with actor.ppo.group_adv_norm: true makes every GRPO advantage "
            "zero (a group of one is its own mean); use n_samples >= 2 or group_adv_norm: false"
        )
    return out


def check_reward_norm(cfg: LorabusConfig) -> list[str]:
    """Settings of the reward normalisation that another setting makes meaningless: refused
    rather than ignored, so a config says what it does."""
    p, out = cfg.actor.ppo, []
    if not p.reward_norm:
        for name in ("batch_std", "leave_one_out"):
            if getattr(p, name):
                out.append(
                    f"actor.ppo.{name}: true with actor.ppo.reward_norm: false, which leaves rewards uncentred "
                    f"and unscaled; set reward_norm: true, or {name}: false"
                )
    elif p.batch_std and not (p.group_adv_norm and p.adv_norm_std):
        why = "group_adv_norm: false already takes the batch's std" if not p.group_adv_norm else "adv_norm_std is false"
        out.append(f"actor.ppo.batch_std: true has no effect ({why}); set it false")
    return out


def check_sapo(cfg: LorabusConfig) -> list[str]:
    """SAPO's gate replaces the clip and takes the ratio against the behaviour policy: settings
    of the clip or of the decoupled loss beside it are refused, as AReaL refuses the latter."""
    p = cfg.actor.ppo
    out: list[str] = []
    if not p.use_sapo_loss:
        return out
    if p.use_decoupled_loss:
        out.append(
            "actor.ppo.use_sapo_loss: true with actor.ppo.use_decoupled_loss: true, which AReaL refuses "
            "(SAPO gates the ratio against the behaviour policy); set use_decoupled_loss: false"
        )
    for name in ("sapo_tau_pos", "sapo_tau_neg"):
        if getattr(p, name) <= 0:
            out.append(f"actor.ppo.{name}: {getattr(p, name)} must be > 0 (the gate's temperature)")
    if p.eps_clip_higher is not None:
        out.append(
            f"actor.ppo.eps_clip_higher: {p.eps_clip_higher} has no effect with actor.ppo.use_sapo_loss: "
            "the soft gate replaces the clip; remove it"
        )
    return out


def check_overlong(cfg: LorabusConfig) -> list[str]:
    """DAPO's overlong penalty: refused where it could never apply, or would apply to every
    completion, rather than accepted and silently moot (run after `backfill`)."""
    p, out = cfg.actor.ppo, []
    window, end, cap = p.overlong_tokens, p.overlong_max_tokens, cfg.gconfig.max_new_tokens
    if window is None:
        if end is not None:
            out.append(
                f"actor.ppo.overlong_max_tokens: {end} has no effect without actor.ppo.overlong_tokens; "
                "set overlong_tokens, or remove it"
            )
        return out
    if end is None:
        return out  # backfill gives it gconfig.max_new_tokens
    if window < 1:
        out.append(f"actor.ppo.overlong_tokens: {window} must be >= 1 (or null: no penalty)")
    elif window > end:
        out.append(
            f"actor.ppo.overlong_tokens: {window} exceeds overlong_max_tokens {end}, so even an empty "
            "completion is penalised; make it at most overlong_max_tokens"
        )
    elif end - window >= cap:
        out.append(
            f"actor.ppo.overlong_max_tokens: {end} less overlong_tokens {window} is not below "
            f"gconfig.max_new_tokens {cap}, so no completion can reach the penalty; lower it to "
            f"gconfig.max_new_tokens (or widen overlong_tokens)"
        )
    if p.overlong_penalty_factor <= 0:
        out.append(
            f"actor.ppo.overlong_penalty_factor: {p.overlong_penalty_factor} must be > 0 (0 penalises "
            "nothing, below 0 rewards length); set overlong_tokens: null for no penalty"
        )
    return out


def check_canary_wait(cfg: LorabusConfig) -> list[str]:
    wait = cfg.rollout.canary_wait_s
    if not 0 < wait <= 3600:
        return [
            f"rollout.canary_wait_s: {wait} must be in (0, 3600] seconds; a replica waits this long for a "
            "version's canary before withdrawing it (the default 60 covers a trainer restart)"
        ]
    return []


def _check_entries(field: str, entries: list[str]) -> list[str]:
    out = []
    for e in entries:
        name, sep, path = e.partition("=")
        if not sep or not name or not path:
            out.append(f"{field}: {e!r} is not name=path; write e.g. default_lora-v0=/adapters/default_lora-v0")
    return out


def check_slab(cfg: LorabusConfig) -> list[str]:
    """The embedded engine's continuous batching: a group's n rows and its tokens must fit."""
    ro, g, out = cfg.rollout, cfg.gconfig, []
    if ro.slab_rows < 0:
        out.append(f"rollout.slab_rows: {ro.slab_rows} must be >= 0 (0: no continuous batching)")
    if ro.prefill_chunk < 0:
        out.append(f"rollout.prefill_chunk: {ro.prefill_chunk} must be >= 0 (0: a prompt in one forward)")
    if ro.slab_rows <= 0 or ro.engine != "embedded":
        return out
    if ro.slab_rows < g.n_samples:
        out.append(
            f"rollout.slab_rows: {ro.slab_rows} is below gconfig.n_samples {g.n_samples}; a group's samples "
            f"decode in one slab (set slab_rows to a multiple of {g.n_samples})"
        )
    if ro.slab_length <= g.max_new_tokens:
        out.append(
            f"rollout.slab_length: {ro.slab_length} leaves no room for a prompt beside gconfig.max_new_tokens "
            f"{g.max_new_tokens}; raise it to the longest prompt + max_new_tokens"
        )
    return out


def check_vllm_slots(cfg: LorabusConfig) -> list[str]:
    if cfg.rollout.engine != "vllm":
        return []
    v, rank, keep, out = cfg.vllm, cfg.actor.lora_rank, cfg.rollout.keep_versions, []
    if not v.enable_lora:
        out.append("vllm.enable_lora: false, but rollout.engine vllm serves LoRA adapters; set it to true")
    if v.max_lora_rank not in VLLM_LORA_RANKS:
        up = next((r for r in VLLM_LORA_RANKS if r >= v.max_lora_rank), VLLM_LORA_RANKS[-1])
        out.append(
            f"vllm.max_lora_rank: {v.max_lora_rank} is not a rank vLLM accepts "
            f"({', '.join(map(str, VLLM_LORA_RANKS))}); use {up}"
        )
    if v.max_lora_rank < rank:
        up = next((r for r in VLLM_LORA_RANKS if r >= rank), rank)
        out.append(
            f"vllm.max_lora_rank: {v.max_lora_rank} is below actor.lora_rank {rank}; vLLM rejects "
            f"the adapter (set max_lora_rank: {up}, or ${{actor.lora_rank}})"
        )
    if v.max_loras < keep:
        out.append(
            f"vllm.max_loras: {v.max_loras} is below rollout.lora_keep_versions {keep}; one batch may "
            f"mix every kept version, each needing a GPU slot (set max_loras >= {keep})"
        )
    cpu = v.max_cpu_loras if v.max_cpu_loras is not None else max(v.max_loras, keep + 1)
    if cpu < keep + 1:
        out.append(
            f"vllm.max_cpu_loras: {cpu} is below lora_keep_versions + 1 = {keep + 1}; the next "
            "version is loaded before the oldest is unloaded (raise it, or leave it unset)"
        )
    if cpu < v.max_loras:
        out.append(
            f"vllm.max_cpu_loras: {cpu} is below vllm.max_loras {v.max_loras}; vLLM requires max_cpu_loras >= max_loras"
        )
    out.extend(_check_entries("vllm.lora_modules", v.lora_modules))
    return out


def check_sglang_slots(cfg: LorabusConfig) -> list[str]:
    if cfg.rollout.engine != "sglang":
        return []
    s, rank, keep, out = cfg.sglang, cfg.actor.lora_rank, cfg.rollout.keep_versions, []
    if not s.enable_lora:
        out.append("sglang.enable_lora: false, but rollout.engine sglang serves LoRA adapters; set it to true")
    if s.max_lora_rank < rank:
        out.append(
            f"sglang.max_lora_rank: {s.max_lora_rank} is below actor.lora_rank {rank}; SGLang's LoRA "
            f"memory pool rejects the adapter (set max_lora_rank: {rank}, or ${{actor.lora_rank}})"
        )
    if s.max_loaded_loras < keep + 1:
        out.append(
            f"sglang.max_loaded_loras: {s.max_loaded_loras} is below lora_keep_versions + 1 = {keep + 1}; "
            "the next version is loaded before the oldest is unloaded"
        )
    if s.max_loras_per_batch < keep:
        out.append(
            f"sglang.max_loras_per_batch: {s.max_loras_per_batch} is below rollout.lora_keep_versions "
            f"{keep}; one batch may mix every kept version (set it >= {keep})"
        )
    if s.max_loaded_loras < s.max_loras_per_batch:
        out.append(
            f"sglang.max_loaded_loras: {s.max_loaded_loras} is below sglang.max_loras_per_batch "
            f"{s.max_loras_per_batch}; SGLang requires max_loaded_loras >= max_loras_per_batch"
        )
    served = [m for m in s.lora_target_modules if m not in ("all", ALL_LINEAR)]
    trained = trained_hf_modules(cfg.actor)
    if served and len(served) == len(s.lora_target_modules) and trained is not None:
        missing = [m for m in trained if m not in served]
        if missing:
            out.append(
                f"sglang.lora_target_modules: {s.lora_target_modules} lacks {missing}, which the "
                "adapter trains; add them, use [all], or leave it empty (inferred from the adapter)"
            )
    out.extend(_check_entries("sglang.lora_paths", s.lora_paths))
    return out


def trained_hf_modules(actor: ActorConfig) -> list[str] | None:
    """The HF names the adapter will touch, or None where the config cannot tell: all-linear on
    fsdp2 is resolved by peft against the model, and invalid names are check_target_modules's."""
    if lora_targets.problems(actor.target_modules, actor.backend):
        return None
    resolved = lora_targets.for_backend(actor.target_modules, actor.backend)
    if isinstance(resolved, str):  # ALL_LINEAR
        return None
    return lora_targets.to_hf(resolved) if actor.backend == "megatron" else resolved


def _check_uri(field: str, uri: str, endpoint: str | None, needs_endpoint: bool) -> list[str]:
    scheme, sep, rest = uri.partition("://")
    if not sep or scheme not in ("file", "s3") or not rest.strip("/"):
        return [f"{field}: {uri!r} is not a file:// or s3:// URI; write file:///abs/dir or s3://bucket/prefix"]
    if scheme == "s3" and needs_endpoint and not endpoint:
        return [f"store.endpoint: not set, but {field} is {uri!r}; set store.endpoint: host:port of the S3 server"]
    return []


def check_run(cfg: LorabusConfig) -> list[str]:
    out = []
    if cfg.total_train_steps < 1:
        out.append(f"total_train_steps: {cfg.total_train_steps} must be >= 1")
    if cfg.total_train_epochs is not None and cfg.total_train_epochs < 1:
        out.append(f"total_train_epochs: {cfg.total_train_epochs} must be >= 1 (or unset: total_train_steps decides)")
    for name, ds in (("train_dataset", cfg.train_dataset), ("valid_dataset", cfg.valid_dataset)):
        if ds.max_length is not None and ds.max_length < 1:
            out.append(f"{name}.max_length: {ds.max_length} must be >= 1 tokens (or null: keep every prompt)")
    try:
        token(cfg.run, "run")
    except SubjectError as e:
        out.append(f"{e} (it is built from experiment_name and trial_name by default)")
    out.extend(_check_uri("store.uri", cfg.store.uri, cfg.store.endpoint, True))
    out.extend(_check_uri("exporter.uri", cfg.exporter.uri, cfg.store.endpoint, True))
    if not cfg.actor.path:
        out.append("actor.path: empty; set the base model (HF id or local directory)")
    if cfg.actor.nproc_per_node < 1:
        out.append(
            f"actor.nproc_per_node: {cfg.actor.nproc_per_node} must be >= 1 (trainer processes; "
            "1 runs the trainer as one process, N > 1 under torchrun)"
        )
    if not cfg.train_dataset.path:
        out.append("train_dataset.path: empty; set a JSONL file or builtin:<task> (e.g. builtin:arith)")
    return out


def check_schedule(cfg: LorabusConfig) -> list[str]:
    o, total, out = cfg.actor.optimizer, cfg.total_train_steps, []
    if not o.lr > 0:
        out.append(f"actor.optimizer.lr: {o.lr} must be > 0")
    if o.warmup_steps is not None and o.warmup_steps < 0:
        out.append(
            f"actor.optimizer.warmup_steps: {o.warmup_steps} must be >= 0 (or unset: warmup_steps_proportion decides)"
        )
    elif o.warmup_steps is not None and 0 < total <= o.warmup_steps:
        out.append(
            f"actor.optimizer.warmup_steps: {o.warmup_steps} is not below total_train_steps "
            f"{total}, so the LR never reaches actor.optimizer.lr; shorten the warm-up"
        )
    if not 0.0 <= o.warmup_steps_proportion < 1.0:
        out.append(
            f"actor.optimizer.warmup_steps_proportion: {o.warmup_steps_proportion} must be in "
            "[0, 1) (a share of total_train_steps; AReaL's default is 0.001)"
        )
    if not 0.0 <= o.min_lr_ratio <= 1.0:
        out.append(
            f"actor.optimizer.min_lr_ratio: {o.min_lr_ratio} must be in [0, 1] (the final LR "
            "of a cosine schedule as a share of lr)"
        )
    elif o.min_lr_ratio > 0 and o.lr_scheduler_type != "cosine":
        out.append(
            f"actor.optimizer.min_lr_ratio: {o.min_lr_ratio} has no effect with "
            f"lr_scheduler_type {o.lr_scheduler_type!r} (only cosine uses it, as in AReaL); "
            "set lr_scheduler_type: cosine or min_lr_ratio: 0"
        )
    return out


_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def check_evaluator(cfg: LorabusConfig) -> list[str]:
    e, out = cfg.evaluator, []
    if not _DEVICE.match(e.device):
        out.append(f"evaluator.device: {e.device!r} is not a device; use auto, cpu, cuda or cuda:N")
    if e.batch_size < 1:
        out.append(f"evaluator.batch_size: {e.batch_size} must be >= 1 (prompts per generate call)")
    if e.max_prompts is not None and e.max_prompts < 1:
        out.append(f"evaluator.max_prompts: {e.max_prompts} must be >= 1 (or null: every held-out prompt)")
    if e.nth < 1:
        out.append(f"evaluator.nth: {e.nth} must be >= 1 (versions: every_nth scores multiples of it)")
    if not e.max_wait_s >= 0:
        out.append(
            f"evaluator.max_wait_s: {e.max_wait_s} must be >= 0 (seconds `lorabus up` waits for "
            "missing scores once training has ended)"
        )
    module, sep, attr = e.score.partition(":")
    if not sep or not module or not attr:
        out.append(f"evaluator.score: {e.score!r} is not package.module:function; e.g. {_DEFAULT_SCORE}")
    return out


_DEFAULT_SCORE = "services.clients.evaluate:heldout_reward"


def check_fleet(cfg: LorabusConfig) -> list[str]:
    f, out = cfg.fleet, []
    if not f.share > 0:
        out.append(f"fleet.share: {f.share} must be > 0 (a run's weight in the fleet's fair share; 1 is even)")
    if f.max_runs < 1:
        out.append(f"fleet.max_runs: {f.max_runs} must be >= 1 (runs served at once)")
    mcr = f.max_concurrent_rollouts
    if mcr is not None and mcr < 1:
        out.append(f"fleet.max_concurrent_rollouts: {mcr} must be >= 1 (or unset: each run's own bound only)")
    if f.lora_slots is not None and f.lora_slots < cfg.rollout.keep_versions + 1:
        out.append(
            f"fleet.lora_slots: {f.lora_slots} is below rollout.keep_versions + 1 = "
            f"{cfg.rollout.keep_versions + 1}, what this run alone needs (or unset it)"
        )
    if f.max_adapter_memory_gib is not None and not f.max_adapter_memory_gib > 0:
        out.append(
            f"fleet.max_adapter_memory_gib: {f.max_adapter_memory_gib} must be > 0 (GiB of trainer memory "
            "for the live runs' adapters and optimizer state; unset: unbounded)"
        )
    if f.max_lora_rank is not None and f.max_lora_rank < cfg.actor.lora_rank:
        out.append(
            f"fleet.max_lora_rank: {f.max_lora_rank} is below actor.lora_rank {cfg.actor.lora_rank}; "
            f"the rollout slots could not hold the adapter (set it >= {cfg.actor.lora_rank}, or unset it)"
        )
    return out


RULES = (
    check_lora,
    check_mismatch,
    check_lora_name,
    check_engine_matrix,
    check_megatron,
    check_unimplemented,
    check_target_modules,
    check_offpolicyness,
    check_canary_wait,
    check_reward_norm,
    check_overlong,
    check_sapo,
    check_slab,
    check_vllm_slots,
    check_sglang_slots,
    check_run,
    check_schedule,
    check_evaluator,
    check_fleet,
)


def validate(cfg: LorabusConfig) -> list[str]:
    """Every problem with a (back-filled) config, from every rule; empty means usable."""
    return [problem for rule in RULES for problem in rule(cfg)]
