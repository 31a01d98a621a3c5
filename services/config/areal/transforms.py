"""The translation entries that look at more than their own key: a value AReaL derives from
another (top_k's 1e8, max_tokens against max_length), a key whose meaning depends on a second
(recompute_logprob with use_decoupled_loss, the normalisation levels), or a value lorabus spells
differently (adam is AdamW). Each is one function of the `Translator`, called from the tables
in order; each still gives every key it reads exactly one outcome.
"""

from __future__ import annotations

from services.config.areal.translator import Row, Translator, set_at

OWN_RUN = "lorabus names the run from the top-level experiment_name/trial_name only"


def run_names(x: Translator) -> None:
    """A section's own experiment/trial name is accepted where it equals the top-level one."""
    for sec in ("actor", "rollout", "ref", "saver", "recover", "evaluator", "stats_logger", "perf_tracer"):
        for name in ("experiment_name", "trial_name"):
            key = f"{sec}.{name}"
            if x.has(key) and x.get(key) != x.get(name):
                x.refuse(key, f"differs from the top-level {name} {x.get(name)!r}; {OWN_RUN}")
            x.noop(key, OWN_RUN)


def tokenizer(x: Translator) -> None:
    tok = x.get("tokenizer_path")
    if x.has("tokenizer_path"):
        if tok in ("", x.get("actor.path")):
            x.noop("tokenizer_path", "the tokenizer is actor.path's (lorabus's default)")
        else:
            x.to("tokenizer_path", "actor.tokenizer_path")


def top_k(x: Translator) -> None:
    g = "gconfig"
    top_k = x.get(f"{g}.top_k", int(1e8))
    # AReaL's default 1e8 means "no limit", which lorabus writes as 0
    if not isinstance(top_k, int) or isinstance(top_k, bool):
        x.refuse(f"{g}.top_k", "must be an integer (AReaL's default 1e8: no limit)")
    else:
        x.to(
            f"{g}.top_k",
            "gconfig.top_k",
            0 if top_k >= 1_000_000 else top_k,
            default=int(1e8),
            note="1e8 and above: no limit (lorabus writes 0)" if top_k >= 1_000_000 else "",
        )


def max_tokens(x: Translator) -> None:
    """AReaL caps prompt + completion; lorabus caps only new tokens, so the cap is accepted where
    train_dataset.max_length makes it unable to bind, and refused where it could."""
    g = "gconfig"
    cap = x.get(f"{g}.max_tokens", 32768)
    longest = x.get("train_dataset.max_length")
    new = x.get(f"{g}.max_new_tokens", 16384)
    if longest is not None and longest + new <= cap:
        reason = f"never binds: train_dataset.max_length {longest} + max_new_tokens {new} <= {cap}"
        if x.has(f"{g}.max_tokens"):
            x.noop(f"{g}.max_tokens", reason)
        else:
            x.t.rows.append(Row(f"{g}.max_tokens", f"{cap} (AReaL default)", "-", reason))
    elif not x.has(f"{g}.max_tokens"):
        x.t.rows.append(
            Row(
                f"{g}.max_tokens",
                f"{cap} (AReaL default)",
                "-",
                f"binds only on a prompt over {cap - new} tokens; set train_dataset.max_length to drop those",
            )
        )
    else:
        x.refuse(
            f"{g}.max_tokens",
            "can bind, which lorabus cannot honour: it caps only the new tokens "
            "(gconfig.max_new_tokens); set train_dataset.max_length to at most max_tokens - "
            "max_new_tokens (prompts over it are dropped, so it never binds), or remove it",
        )


def actor_temperature(x: Translator) -> None:
    a = "actor"
    temp = x.get(f"{a}.temperature", 1.0)
    if temp != x.get("gconfig.temperature", 1.0):
        x.refuse(
            f"{a}.temperature",
            f"differs from gconfig.temperature {x.get('gconfig.temperature', 1.0)}; "
            "lorabus's trainer scores tokens at the temperature that sampled them",
        )
    x.noop(f"{a}.temperature", "equals gconfig.temperature, which the trainer uses")


def optimizer_type(x: Translator) -> None:
    o = "actor.optimizer"
    kind = x.get(f"{o}.type", "adam")
    if kind == "adam":
        x.to(
            f"{o}.type",
            "actor.optimizer.type",
            "adamw",
            default="adam",
            note="AReaL's adam is torch.optim.AdamW (decoupled weight decay)",
        )
    elif kind == "sgd":
        x.to(f"{o}.type", "actor.optimizer.type", "sgd")
    else:
        x.refuse(f"{o}.type", "is not supported: lorabus keeps adapter optimizer state in fp32 (use adam)")


def kl_estimator(x: Translator) -> None:
    a = "actor"
    if x.get(f"{a}.kl_ctl", 0.1) == 0:
        x.noop(f"{a}.kl_estimator", "unused: kl_ctl is 0")
    else:
        x.noop(f"{a}.kl_estimator", "lorabus has no KL term")


def recompute_logprob(x: Translator) -> None:
    a = "actor"
    decoupled = x.get(f"{a}.use_decoupled_loss", False)
    if decoupled or not x.get(f"{a}.recompute_logprob", False):
        x.noop(
            f"{a}.recompute_logprob",
            "the decoupled loss always recomputes pi_prox"
            if decoupled
            else "unset: PPO against the rollout's logprobs, as lorabus does",
        )
    else:
        x.refuse(
            f"{a}.recompute_logprob",
            "without use_decoupled_loss is not supported: lorabus's "
            "plain PPO takes the rollout's logprobs (set use_decoupled_loss: true)",
        )


def weight_update_mode(x: Translator) -> None:
    a = "actor"
    mode = x.get(f"{a}.weight_update_mode", "xccl")
    if mode in ("disk", "xccl"):
        x.to(f"{a}.weight_update_mode", "actor.weight_update_mode", default="xccl")
    else:
        x.refuse(f"{a}.weight_update_mode", "is not supported; use disk or xccl")


def rollout_lora_name(x: Translator) -> None:
    r = "rollout"
    if x.get(f"{r}.lora_name"):
        x.to(f"{r}.lora_name", "rollout.lora_name")
    x.noop(f"{r}.lora_name", "empty: filled from gconfig.lora_name")


_OLD_MODES = {"token_mask": "mask", "token_truncate": "clamp"}
"""AReaL's removed behave_imp_weight_mode values -> rejection_sampling.action (its own mapping)"""


def rejection(x: Translator) -> None:
    r, p = "actor.rejection_sampling", "actor.ppo"
    cap, mode = "actor.behave_imp_weight_cap", "actor.behave_imp_weight_mode"
    if x.has(cap) or x.has(mode):
        # AReaL 1.0 removed these keys and refuses files that still have them (its own GSM8K
        # Megatron LoRA example among them); lorabus reads them by AReaL's migration mapping
        why = "AReaL <= 0.5 key, removed in 1.0; read by AReaL's migration mapping"
        if x.has(r):
            x.refuse(cap if x.has(cap) else mode, f"and {r} are both set; keep only {r}")
            x.used.add(mode)
        elif x.get(mode, "token_mask") == "disabled":
            x.to(mode, f"{p}.behav_imp_weight_mode", "none", note=why + " (rejection_sampling: null)")
            x.noop(cap, "unused: behave_imp_weight_mode is disabled")
        elif x.get(mode, "token_mask") in _OLD_MODES:
            x.to(cap, f"{p}.behav_imp_weight_cap", default=5.0, note=why)
            x.to(
                mode,
                f"{p}.behav_imp_weight_mode",
                _OLD_MODES[x.get(mode, "token_mask")],
                default="token_mask",
                note=why,
            )
        else:
            x.refuse(mode, f"is not one of disabled, {', '.join(_OLD_MODES)}")
            x.used.add(cap)
        return
    if not any(k.startswith(r + ".") for k in x.flat) and x.get(r) is None:
        # AReaL's decoupled loss without rejection sampling applies no pi_prox/pi_behave weight
        why = "no behaviour importance weight and no filtering of stale tokens"
        if x.has(r):
            x.to(r, f"{p}.behav_imp_weight_mode", "none", note=why)
        else:
            set_at(x.t.tree, f"{p}.behav_imp_weight_mode", "none")
            x.t.rows.append(Row(r, "None (AReaL default)", f"{p}.behav_imp_weight_mode = 'none'", why))
        return
    x.only(f"{r}.level", "token", "is not supported: lorabus filters per token (level: token)")
    x.only(f"{r}.metric", "ratio", "is not supported: lorabus caps the ratio pi_prox/pi_behave (metric: ratio)")
    x.only(f"{r}.lower", None, "is not supported: lorabus caps from above only (remove lower)")
    x.noop(f"{r}.agg", "sequence-level only; lorabus filters per token")
    x.to(f"{r}.upper", f"{p}.behav_imp_weight_cap", default=5.0)
    x.to(f"{r}.action", f"{p}.behav_imp_weight_mode", default="mask")


_NORM_WHY = "lorabus normalises rewards within each group or over the batch (actor.ppo.group_adv_norm), or not at all"


def norms(x: Translator) -> None:
    p = "actor.ppo"
    rn, an = "actor.reward_norm", "actor.adv_norm"
    eps: set[float] = set()
    if x.get(rn) is None and not any(k.startswith(rn + ".") for k in x.flat):
        # null or absent (AReaL's default): the shaped rewards are the advantages
        x.to(rn, f"{p}.reward_norm", False, default=None, note="the shaped rewards are the advantages, uncentred")
    else:
        mean, std = x.get(f"{rn}.mean_level", "batch"), x.get(f"{rn}.std_level", "batch")
        if mean not in ("group", "batch") or std not in (mean, "batch", None):
            x.refuse(
                f"{rn}.mean_level",
                f"with std_level {std!r} is not supported: {_NORM_WHY}, "
                "dividing by the std at the same level, over the batch, or not at all",
            )
            x.used.add(f"{rn}.std_level")
        else:
            x.to(f"{rn}.mean_level", f"{p}.group_adv_norm", mean == "group", default="batch")
            x.to(f"{rn}.std_level", f"{p}.adv_norm_std", std is not None, default="batch")
            if mean == "group" and std == "batch":  # LitePPO: centred in the group, scaled by the batch
                set_at(x.t.tree, f"{p}.batch_std", True)
                x.t.origin[f"{p}.batch_std"] = f"{rn}.std_level"
        x.to(
            f"{rn}.mean_leave1out",
            f"{p}.leave_one_out",
            default=False,
            note="RLOO: each reward's baseline is the others' mean",
        )
        n = x.get("gconfig.n_samples", 1)
        size = x.get(f"{rn}.group_size", 1)
        if mean == "group" and size != n:
            x.refuse(
                f"{rn}.group_size", f"differs from gconfig.n_samples {n}; lorabus's groups are one prompt's completions"
            )
        x.noop(f"{rn}.group_size", "equals gconfig.n_samples: a group is one prompt's completions")
        _norm_common(x, rn, eps)
    if x.get(an) is None and not any(k.startswith(an + ".") for k in x.flat):
        x.to(an, f"{p}.batch_adv_norm", False, default=None)
    else:
        mean, std = x.get(f"{an}.mean_level", "batch"), x.get(f"{an}.std_level", "batch")
        if mean != "batch" or std not in ("batch", None):
            x.refuse(
                f"{an}.mean_level",
                f"with std_level {std!r} is not supported: lorabus "
                "normalises advantages over the batch (mean_level batch, std_level batch or null)",
            )
            x.used.add(f"{an}.std_level")
        else:
            x.to(f"{an}.mean_level", f"{p}.batch_adv_norm", True, default="batch")
            x.to(f"{an}.std_level", f"{p}.batch_adv_norm_std", std is not None, default="batch")
        x.noop(f"{an}.group_size", "unused at batch level")
        x.only(f"{an}.mean_leave1out", False, "is not supported: lorabus centres advantages on the plain mean")
        _norm_common(x, an, eps)
    if len(eps) > 1:
        x.t.problems.append(
            f"actor.reward_norm.eps / actor.adv_norm.eps: {sorted(eps)} differ; "
            "lorabus has one actor.ppo.norm_eps for both (make them equal)"
        )
    elif eps:
        set_at(x.t.tree, f"{p}.norm_eps", eps.pop())


def _norm_common(x: Translator, key: str, eps: set[float]) -> None:
    x.only(f"{key}.std_unbiased", True, "is not supported: lorabus's std is unbiased (n - 1)")
    value = x.get(f"{key}.eps", 1e-5)
    eps.add(value)
    x.t.rows.append(
        Row(
            f"{key}.eps",
            value if x.has(f"{key}.eps") else f"{value} (AReaL default)",
            f"actor.ppo.norm_eps = {value!r}",
        )
    )
    x.used.add(f"{key}.eps")


def megatron(x: Translator) -> None:
    m = "actor.megatron"
    # the backend as translated: from actor.backend or the deprecated allocation_mode, and
    # absent where either was missing or refused (already reported)
    if x.t.tree.get("actor", {}).get("backend") == "megatron":
        x.to(f"{m}.bridge_type", "actor.megatron.bridge_type", default="mbridge")
        x.to(f"{m}.use_distributed_optimizer", "actor.megatron.use_distributed_optimizer")
        x.to(f"{m}.gradient_accumulation_fusion", "actor.megatron.gradient_accumulation_fusion")
        x.noop(m, "Megatron tuning (recompute, overlap, MoE kernels): memory and speed only")
    else:
        x.noop(m, "actor.backend is not megatron")
    x.noop("actor.archon", "lorabus has no Archon engine")


def overlong(x: Translator) -> None:
    """DAPO's overlong penalty: three keys that mean something only together, and AReaL's
    actor.max_new_tokens, which it reads for this and nothing else."""
    a, p = "actor", "actor.ppo"
    on = f"{a}.overlong_reward_penalty"
    if not x.get(on, False):
        x.only(on, False, "must be true or false")
        for name in ("overlong_tokens", "overlong_penalty_factor"):
            x.noop(f"{a}.{name}", "unused: overlong_reward_penalty is false")
        return
    missing = [n for n in ("overlong_tokens", "overlong_penalty_factor") if x.get(f"{a}.{n}") is None]
    if missing:
        named = " and ".join(f"actor.{n}" for n in missing)
        x.refuse(on, f"needs {named} set, as AReaL asserts; give {'it' if len(missing) == 1 else 'them'} a value")
        x.used.update(f"{a}.{n}" for n in ("overlong_tokens", "overlong_penalty_factor"))
        return
    x.used.add(on)
    x.t.rows.append(Row(on, True, f"{p}.overlong_tokens set", "DAPO's soft overlong penalty, before reward shaping"))
    x.to(f"{a}.overlong_tokens", f"{p}.overlong_tokens", note="the window before the end that the penalty spans")
    x.to(f"{a}.overlong_penalty_factor", f"{p}.overlong_penalty_factor")
    x.to(f"{a}.max_new_tokens", f"{p}.overlong_max_tokens", default=1024, note="where the penalty window ends")


def sapo(x: Translator) -> None:
    """SAPO's temperatures mean something only with use_sapo_loss."""
    a, p = "actor", "actor.ppo"
    if x.get(f"{a}.use_sapo_loss", False):
        x.to(f"{a}.use_sapo_loss", f"{p}.use_sapo_loss", True, note="a soft gate instead of the clip")
        x.to(f"{a}.sapo_tau_pos", f"{p}.sapo_tau_pos", default=1.0)
        x.to(f"{a}.sapo_tau_neg", f"{p}.sapo_tau_neg", default=1.05)
    else:
        x.only(f"{a}.use_sapo_loss", False, "must be true or false")
        for name in ("sapo_tau_pos", "sapo_tau_neg"):
            x.noop(f"{a}.{name}", "unused: use_sapo_loss is false")
