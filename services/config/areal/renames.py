"""AReaL's names for lorabus keys: the hint a native file gets for an AReaL key, and the problem
an AReaL file gets for a key the translation does not know (with a did-you-mean).
"""

from __future__ import annotations

import difflib
from typing import Any

from services.config.areal.translator import NATIVE_SECTION

RENAMES: dict[str, str] = {
    "actor.eps_clip": "actor.ppo.eps_clip",
    "actor.eps_clip_higher": "actor.ppo.eps_clip_higher",
    "actor.reward_scaling": "actor.ppo.reward_scaling",
    "actor.reward_bias": "actor.ppo.reward_bias",
    "actor.reward_clip": "actor.ppo.reward_clip",
    "actor.kl_ctl": "actor.ppo.kl_ctl",
    "actor.ppo_n_minibatches": "actor.ppo.ppo_n_minibatches",
    "actor.use_decoupled_loss": "actor.ppo.use_decoupled_loss",
    "actor.mb_spec": "actor.mb_spec_max_tokens",
    "actor.mb_spec.max_tokens_per_mb": "actor.mb_spec_max_tokens",
    "actor.rejection_sampling": "actor.ppo.behav_imp_weight_cap and actor.ppo.behav_imp_weight_mode",
    "actor.reward_norm": "actor.ppo.group_adv_norm and actor.ppo.adv_norm_std",
    "actor.adv_norm": "actor.ppo.batch_adv_norm and actor.ppo.batch_adv_norm_std",
    "rollout.backend": "rollout.engine and rollout.replicas",
    "rollout.request_timeout": "rollout.request_timeout_s",
    "sglang.random_seed": "sglang.extra_args",
    "vllm.seed": "vllm.extra_args",
    "vllm.gpu_memory_utilization": "vllm.extra_args",
    "sglang.mem_fraction_static": "sglang.extra_args",
    "sglang.context_length": "sglang.extra_args",
}
"""AReaL keys -> the lorabus keys with the same meaning (for 'did you mean' in native files)."""

NO_EQUIVALENT = {
    "actor.recompute_logprob": "the decoupled loss always recomputes",
    "actor.scheduling_spec": "services are placed by lorabus up or the deployment",
    "cluster": "services find each other through NATS (bus.url)",
    "saver": "checkpoints: actor.checkpoint_every; exports: exporter.uri",
    "recover": "recovery is always on",
    "stats_logger": "metrics are Prometheus (metrics.port)",
    "evaluator": "`lorabus evaluate`",
    "ref": "lorabus has no reference model",
    "scheduler": "lorabus up or the deployment",
    "launcher": "lorabus up or the deployment",
    "perf_tracer": "no tracer",
    "enable_offload": "nothing to offload",
    "gconfig.max_tokens": "lorabus caps new tokens only (gconfig.max_new_tokens); "
    "train_dataset.max_length drops long prompts",
}


def rename_hint(path: str) -> str | None:
    """For a key a native file does not know: what it is called here, if it is AReaL's."""
    if path in RENAMES:
        return f"AReaL's {path} is lorabus's {RENAMES[path]}"
    for key, why in NO_EQUIVALENT.items():
        if path == key or path.startswith(key + "."):
            return (
                f"AReaL's {key} has no lorabus equivalent ({why}); remove it, or load the whole "
                "file as AReaL's (actor.backend like fsdp:d4)"
            )
    if path.startswith(("actor.", "rollout.")) and path.endswith(".backend"):
        return RENAMES.get(path)
    return None


def unknown(key: str, value: Any, asked: set[str]) -> str:
    known = sorted(asked | set(RENAMES) | set(NO_EQUIVALENT))
    if key in asked:  # a field lorabus reads, at a value or beside others it cannot take
        return f"{key}: {value!r} is not translated: lorabus reads this field but not this value here; remove it"
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.8)
    fix = (
        f"did you mean {close[0]}?"
        if close
        else (
            f"lorabus knows no AReaL field of this name; remove it, or put native lorabus keys under {NATIVE_SECTION}:"
        )
    )
    return f"{key}: {value!r} is not translated; {fix}"
