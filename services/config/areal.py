"""AReaL experiment YAML as input: detect it, translate it into lorabus's config, say what each
field became.

    tree = OmegaConf-loaded AReaL file (as a dict)
    if is_areal(tree):
        t = translate(tree)      # t.tree: native config tree; t.rows: the report; t.problems
        print(report(t.rows))

The invariant: every key of an AReaL file lands in exactly one row, as a lorabus value it
became, as a field with no effect here (and what lorabus does instead), or in `problems` (a
field whose meaning lorabus cannot honour). Nothing is dropped silently, and a value that AReaL
would have used by default (AReaL's defaults, not lorabus's) is translated as if written.

Allocation strings (`fsdp:d4`, `vllm:d4p1t1`, `megatron:(attn:d1p6t1c1|ffn:d1p6t1e1)`) give
the trainer's ranks and Megatron sizes, and the number of rollout replicas and each server's
tensor/pipeline size. `total_train_epochs` stays epochs (lorabus's own `total_train_epochs`): the
config loader turns it into steps as AReaL counts them, epochs * (rows // batch size), when a
service loads the config with its data; translating reads no data. Native lorabus keys that AReaL has no
word for (bus, store, server URLs) go under a top-level `lorabus:` section, merged last.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from typing import Any, cast

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

__all__ = ["is_areal", "translate", "flatten", "report", "rename_hint", "Translation", "Row", "RENAMES"]

NATIVE_SECTION = "lorabus"
_AREAL_ONLY_TOP = ("cluster", "allocation_mode")


@dataclass(frozen=True)
class Row:
    areal: str
    value: Any
    became: str
    """`native.key = value`, or '-' for a field with no effect here"""
    note: str = ""


@dataclass
class Translation:
    tree: dict[str, Any] = field(default_factory=dict)
    rows: list[Row] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    origin: dict[str, str] = field(default_factory=dict)
    """native dotted key -> the AReaL key it came from (to point native problems back)"""
    asked: set[str] = field(default_factory=set)
    """every AReaL key the translation looked for (the AReaL names a command line may use)"""


def is_areal(tree: Any) -> bool:
    """An AReaL file names its backends with allocation strings (`fsdp:d4`, `sglang:d4`), which
    no lorabus field accepts, or has sections only AReaL has (`cluster:`, `saver:`, ...)."""
    if not isinstance(tree, dict):
        return False
    for section in ("actor", "rollout"):
        backend = tree.get(section, {}).get("backend") if isinstance(tree.get(section), dict) else None
        if isinstance(backend, str) and ":" in backend:
            return True
    return any(key in tree for key in _AREAL_ONLY_TOP)


# --- allocation strings ----------------------------------------------------------------------

_DIMS = re.compile(r"([a-z])(\d+)")


@dataclass(frozen=True)
class Alloc:
    backend: str
    dims: dict[str, int]
    """d t p c e (attention side for the hybrid MoE syntax)"""
    ffn: dict[str, int] | None = None


def parse_alloc(text: str) -> Alloc:
    """`backend[:name]:dims` as AReaL's grammar has it, for one engine."""
    m = re.fullmatch(r"\s*([a-z]+)(?:\[\w+\])?\s*:\s*(.+?)\s*", text)
    if not m:
        raise ValueError("is not <backend>:<dims> (e.g. fsdp:d4, vllm:d2t2)")
    backend, rest = m.groups()
    hybrid = re.fullmatch(r"\(?\s*attn\s*:\s*([a-z0-9]+)\s*\|\s*ffn\s*:\s*([a-z0-9]+)\s*\)?", rest)
    if hybrid:
        return Alloc(backend, _dims(hybrid.group(1), "cdtp"), _dims(hybrid.group(2), "detp"))
    return Alloc(backend, _dims(rest.replace(" ", ""), "dtpce"))


def _dims(text: str, allowed: str) -> dict[str, int]:
    if not text or _DIMS.sub("", text):
        raise ValueError(f"has dimensions {text!r}; write letters {', '.join(allowed)} each with a size")
    out: dict[str, int] = {}
    for letter, size in _DIMS.findall(text):
        if letter not in allowed:
            raise ValueError(f"dimension {letter!r} is not one of {', '.join(allowed)}")
        out[letter] = int(size)
    return out


# --- the translator --------------------------------------------------------------------------


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict) and tree:
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: tree}


def _set(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[leaf] = value


class _Translator:
    def __init__(self, src: dict[str, Any]):
        self.src = src
        self.flat = flatten(src)
        self.used: set[str] = set()
        self.asked: set[str] = set()
        """every AReaL key the translation looked for: the candidates for 'did you mean'"""
        self.t = Translation()

    # what happened to one AReaL key
    def get(self, key: str, default: Any = None) -> Any:
        self.asked.add(key)
        return self.flat.get(key, default)

    def has(self, key: str) -> bool:
        self.asked.add(key)
        return key in self.flat

    def to(self, key: str, native: str, value: Any = ..., note: str = "", default: Any = ...) -> None:
        """AReaL `key` becomes lorabus `native` (its value, converted, or AReaL's default)."""
        self.asked.add(key)
        if key not in self.flat and default is ...:
            return
        raw = self.flat.get(key, default)
        value = raw if value is ... else value
        self.used.add(key)
        _set(self.t.tree, native, value)
        self.t.origin[native] = key
        shown = raw if key in self.flat else f"{raw!r} (AReaL default)"
        self.t.rows.append(Row(key, shown, f"{native} = {value!r}", note))

    def noop(self, key: str, note: str) -> None:
        """AReaL keys under `key` (a leaf or a section) have no effect here; `note` says why."""
        self.asked.add(key)
        for k in [k for k in self.flat if k == key or k.startswith(key + ".")]:
            if k not in self.used:
                self.used.add(k)
                self.t.rows.append(Row(k, self.flat[k], "-", note))

    def refuse(self, key: str, problem: str) -> None:
        self.used.add(key)
        shown = self.flat.get(key)
        self.t.problems.append(f"{key}: {shown!r} {problem}")

    def only(self, key: str, allowed: Any, why: str, note: str = "AReaL's default; lorabus does the same") -> None:
        """Accepted at `allowed` (AReaL's default) only; any other value is refused with `why`."""
        self.asked.add(key)
        if key not in self.flat:
            return
        ok = self.flat[key] in allowed if isinstance(allowed, tuple) else self.flat[key] == allowed
        if ok:
            self.noop(key, note)
        else:
            self.refuse(key, why)


def translate(areal: dict[str, Any]) -> Translation:
    """Translate an AReaL tree (its `${...}` are resolved here, in AReaL's vocabulary). Reads no
    file and no data: epochs stay epochs until a service loads the config with its data."""
    areal = dict(areal)
    native_extra = areal.pop(NATIVE_SECTION, None)
    try:
        src = OmegaConf.to_container(OmegaConf.create(areal), resolve=True)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        t = Translation()
        t.problems.append(f"{key}: cannot resolve: {first}; references in an AReaL file name AReaL keys")
        return t
    # a mapping in, a mapping out; OmegaConf types to_container for any container
    x = _Translator(cast("dict[str, Any]", src))
    _top(x)
    _backends(x)
    _gconfig(x)
    _actor(x)
    _rollout(x)
    _servers(x)
    _datasets(x)
    _utilities(x)
    for key in x.flat:
        if key not in x.used:
            x.t.problems.append(_unknown(key, x.flat[key], x.asked))
    x.t.asked = set(x.asked)
    if native_extra is not None:
        if not isinstance(native_extra, dict):
            x.t.problems.append(f"{NATIVE_SECTION}: {native_extra!r} must be a section of native lorabus keys")
        else:
            for key, value in flatten(native_extra).items():
                _set(x.t.tree, key, value)
                x.t.rows.append(Row(f"{NATIVE_SECTION}.{key}", value, f"{key} = {value!r}", "native key, as written"))
    return x.t


# --- sections --------------------------------------------------------------------------------

_OWN_RUN = "lorabus names the run from the top-level experiment_name/trial_name only"


def _top(x: _Translator) -> None:
    x.to("experiment_name", "experiment_name")
    x.to("trial_name", "trial_name")
    x.to("seed", "seed", default=1)
    for sec in ("actor", "rollout", "ref", "saver", "recover", "evaluator", "stats_logger", "perf_tracer"):
        for name in ("experiment_name", "trial_name"):
            key = f"{sec}.{name}"
            if x.has(key) and x.get(key) != x.get(name):
                x.refuse(key, f"differs from the top-level {name} {x.get(name)!r}; {_OWN_RUN}")
            x.noop(key, _OWN_RUN)
    x.only(
        "enable_offload",
        False,
        "is not supported: lorabus never colocates training and "
        "generation, so there is nothing to offload to make room for (set false)",
        note="lorabus never colocates training and generation; nothing to offload",
    )
    tok = x.get("tokenizer_path")
    if x.has("tokenizer_path"):
        if tok in ("", x.get("actor.path")):
            x.noop("tokenizer_path", "the tokenizer is actor.path's (lorabus's default)")
        else:
            x.to("tokenizer_path", "actor.tokenizer_path")
    x.noop("rollout.tokenizer_path", "rollouts use actor.tokenizer_path (or actor.path)")
    if x.get("total_train_n_seqs") is not None:
        x.refuse("total_train_n_seqs", "is not supported; give total_train_epochs or total_train_steps")
    x.noop("total_train_n_seqs", "unset")
    x.only("critic", None, "is not supported: lorabus trains GRPO (group advantages), no critic")
    x.only("teacher", None, "is not supported: lorabus has no teacher model (distillation)")
    x.only("dynamic_bs", False, "is not supported: a lorabus step is rollout.consumer_batch_size groups")
    x.only("eval_gconfig", None, "is not supported: `lorabus evaluate` samples with gconfig")


def _backends(x: _Translator) -> None:
    actor, rollout = x.get("actor.backend"), x.get("rollout.backend")
    if x.has("allocation_mode"):
        # AReaL's deprecated single string, e.g. "sglang:d4+fsdp:d4"; per-engine fields win
        parts = str(x.get("allocation_mode")).split("+")
        infer = [p for p in parts if p.strip().startswith(("sglang", "vllm"))]
        train = [p for p in parts if p not in infer]
        rollout = rollout if rollout is not None else (infer[0] if infer else None)
        actor = actor if actor is not None else (train[0] if train else None)
        x.noop("allocation_mode", "read as actor.backend / rollout.backend where those are unset")
    _train_alloc(x, actor)
    _infer_alloc(x, rollout)


def _alloc(x: _Translator, key: str, text: Any, examples: str) -> Alloc | None:
    """The allocation string `text` given for `key`, parsed and marked used; None: reported."""
    if text is None:
        x.t.problems.append(f"{key}: missing; AReaL requires it (e.g. {examples})")
        return None
    try:
        a = parse_alloc(str(text))
    except ValueError as e:
        x.refuse(key, str(e))
        return None
    x.used.add(key)
    return a


def _train_alloc(x: _Translator, text: Any) -> None:
    key = "actor.backend"
    if (a := _alloc(x, key, text, "fsdp:d4 or megatron:d2t2")) is None:
        return
    d = a.dims
    dp, tp, pp, cp, ep = (d.get(k, 1) for k in "dtpce")
    if a.ffn is not None:
        ep = a.ffn.get("e", 1)
        etp, fpp = a.ffn.get("t", 1), a.ffn.get("p", 1)
        if etp != 1:
            x.t.problems.append(
                f"{key}: {text!r} has expert tensor parallelism t{etp}; lorabus's Megatron engine has none (use ffn t1)"
            )
        if fpp != pp:
            x.t.problems.append(f"{key}: {text!r} has attn p{pp} but ffn p{fpp}; they must be equal")
    if cp != 1:
        x.t.problems.append(f"{key}: {text!r} has context parallelism c{cp}; lorabus's engines have none (use c1)")
    if a.backend == "fsdp":
        if tp != 1 or pp != 1 or ep != 1:
            x.t.problems.append(
                f"{key}: {text!r}: lorabus's FSDP2 engine shards data-parallel only "
                "(use fsdp:dN, or megatron: for tensor parallelism)"
            )
        _set(x.t.tree, "actor.backend", "fsdp2")
        world = dp
        became = f"actor.backend = 'fsdp2', actor.nproc_per_node = {world}"
    elif a.backend == "megatron":
        _set(x.t.tree, "actor.backend", "megatron")
        for name, size in (("tensor", tp), ("pipeline", pp), ("expert", ep)):
            _set(x.t.tree, f"actor.megatron.{name}_model_parallel_size", size)
            x.t.origin[f"actor.megatron.{name}_model_parallel_size"] = key
        world = dp * tp * pp
        became = (
            f"actor.backend = 'megatron', actor.nproc_per_node = {world}, "
            f"actor.megatron tensor/pipeline/expert sizes {tp}/{pp}/{ep}"
        )
    else:
        x.t.problems.append(
            f"{key}: {text!r}: backend {a.backend!r} is not supported; lorabus trains with fsdp or megatron"
        )
        return
    _set(x.t.tree, "actor.nproc_per_node", world)
    x.t.origin.update({"actor.backend": key, "actor.nproc_per_node": key})
    x.t.rows.append(Row(key, text, became, "one trainer process per GPU, under torchrun when > 1"))


def _infer_alloc(x: _Translator, text: Any) -> None:
    key = "rollout.backend"
    if (a := _alloc(x, key, text, "sglang:d4 or vllm:d2t2")) is None:
        return
    if a.backend not in ("sglang", "vllm"):
        x.t.problems.append(f"{key}: {text!r}: backend {a.backend!r} is not an inference server; use sglang or vllm")
        return
    bad = set(a.dims) - set("dtp")
    if bad or a.ffn is not None:
        x.t.problems.append(f"{key}: {text!r}: inference takes d, t and p only")
        return
    dp, tp, pp = (a.dims.get(k, 1) for k in "dtp")
    _set(x.t.tree, "rollout.engine", a.backend)
    _set(x.t.tree, "rollout.replicas", dp)
    x.t.origin.update({"rollout.engine": key, "rollout.replicas": key})
    flags: list[str] = []
    if a.backend == "vllm":
        flags = ([f"--tensor-parallel-size={tp}"] if tp > 1 else []) + (
            [f"--pipeline-parallel-size={pp}"] if pp > 1 else []
        )
    else:
        flags = ([f"--tp-size={tp}"] if tp > 1 else []) + ([f"--pp-size={pp}"] if pp > 1 else [])
    x.server_flags = flags  # type: ignore[attr-defined]
    x.t.rows.append(
        Row(
            key,
            text,
            f"rollout.engine = {a.backend!r}, rollout.replicas = {dp}"
            + (f", {a.backend}.extra_args += {flags}" if flags else ""),
            "one rollout sidecar per server; each server spans t*p GPUs",
        )
    )


_SAMPLING_ONLY = "lorabus's rollout sends no such option to the engine"


def _gconfig(x: _Translator) -> None:
    g = "gconfig"
    default: Any  # the loops below go over AReaL's defaults, of mixed types
    for name, default in (
        ("n_samples", 1),
        ("max_new_tokens", 16384),
        ("min_new_tokens", 0),
        ("greedy", False),
        ("top_p", 1.0),
        ("temperature", 1.0),
        ("lora_name", "default_lora"),
    ):
        x.to(f"{g}.{name}", f"gconfig.{name}", default=default)
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
    x.to(f"{g}.stop_token_ids", "gconfig.stop_token_ids")
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
    for name, default in (
        ("ignore_eos", False),
        ("stop", None),
        ("frequency_penalty", 0.0),
        ("seed", None),
        ("use_beam_search", False),
        ("reward_normalization", False),
        ("drop_incomplete_group", False),
    ):
        x.only(f"{g}.{name}", default, f"is not supported: {_SAMPLING_ONLY} (remove it)")
    x.only(
        f"{g}.skip_special_tokens",
        True,
        "is not supported: lorabus decodes completions without special tokens for the reward function (remove it)",
    )


_NORM_WHY = "lorabus normalises rewards within each group or over the batch (actor.ppo.group_adv_norm), always centring"


def _actor(x: _Translator) -> None:
    a = "actor"
    default: Any  # the loops below go over AReaL's defaults, of mixed types
    x.to(f"{a}.path", "actor.path")
    x.to(f"{a}.dtype", "actor.dtype", default="bfloat16")
    x.only(f"{a}.init_from_scratch", False, "is not supported: LoRA trains on a pretrained base")
    x.noop(
        f"{a}.disable_dropout",
        "lorabus trains with the model's own dropout config (Qwen2/Qwen3: 0, so nothing to disable)",
    )
    x.to(f"{a}.gradient_checkpointing", "actor.gradient_checkpointing", default=False)
    x.to(
        f"{a}.mb_spec.max_tokens_per_mb",
        "actor.mb_spec_max_tokens",
        note="padded tokens per micro-batch; lorabus packs greedily in order",
    )
    x.noop(f"{a}.mb_spec", "micro-batching changes memory and speed, not the gradient")
    x.noop(f"{a}.pad_to_maximum", "micro-batching changes memory and speed, not the gradient")
    x.noop(f"{a}.logprobs_chunk_size", "memory only")
    x.noop(f"{a}.attn_impl", "lorabus uses transformers' default attention for the model")
    x.noop(f"{a}.use_kernels", "lorabus does not kernelize the model")
    x.noop(
        f"{a}.scheduling_spec",
        "lorabus up starts one process per trainer rank; deployments "
        "place services with compose/kubernetes (docs/deploy.md)",
    )
    x.noop(f"{a}.scheduling_strategy", "the trainer always runs apart from the rollout servers")
    x.noop(f"{a}.offload", "lorabus never colocates training and generation")
    x.noop(f"{a}.grad_reduce_dtype", "lorabus reduces the adapter's fp32 gradients")
    x.noop(f"{a}.optimizer_dtype", "lorabus keeps the adapter and its optimizer state in fp32")
    x.noop(f"{a}.fsdp", "lorabus's FSDP2 engine shards each decoder layer; no wrap options")
    x.noop(f"{a}.max_new_tokens", "the trainer takes lengths from the trajectories (gconfig.max_new_tokens caps them)")
    temp = x.get(f"{a}.temperature", 1.0)
    if temp != x.get("gconfig.temperature", 1.0):
        x.refuse(
            f"{a}.temperature",
            f"differs from gconfig.temperature {x.get('gconfig.temperature', 1.0)}; "
            "lorabus's trainer scores tokens at the temperature that sampled them",
        )
    x.noop(f"{a}.temperature", "equals gconfig.temperature, which the trainer uses")
    # optimizer
    o = f"{a}.optimizer"
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
    for name, default in (
        ("lr", 1e-3),
        ("weight_decay", 0.01),
        ("beta1", 0.9),
        ("beta2", 0.999),
        ("eps", 1e-8),
        ("gradient_clipping", 1.0),
        ("min_lr_ratio", 0.0),
        ("lr_scheduler_type", "constant"),
    ):
        x.to(f"{o}.{name}", f"actor.optimizer.{name}", default=default)
    for name in ("initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis"):
        x.noop(f"{o}.{name}", "fp16 loss scaling; lorabus's adapter trains in fp32")
    _warmup(x, o)
    # PPO
    p = "actor.ppo"
    x.to(f"{a}.ppo_n_minibatches", f"{p}.ppo_n_minibatches", default=4)
    x.to(f"{a}.eps_clip", f"{p}.eps_clip", default=0.2)
    x.to(f"{a}.eps_clip_higher", f"{p}.eps_clip_higher")
    x.to(f"{a}.reward_scaling", f"{p}.reward_scaling", default=1.0)
    x.to(f"{a}.reward_bias", f"{p}.reward_bias", default=0.0)
    x.to(f"{a}.reward_clip", f"{p}.reward_clip", default=20.0)
    x.to(f"{a}.kl_ctl", f"{p}.kl_ctl", default=0.1, note="lorabus refuses any value but 0 (no KL term)")
    if x.get(f"{a}.kl_ctl", 0.1) == 0:
        x.noop(f"{a}.kl_estimator", "unused: kl_ctl is 0")
    else:
        x.noop(f"{a}.kl_estimator", "lorabus has no KL term")
    x.to(f"{a}.use_decoupled_loss", f"{p}.use_decoupled_loss", default=False)
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
    _rejection(x)
    _norms(x)
    for name, default in (
        ("c_clip", None),
        ("m2_threshold", None),
        ("overlong_reward_penalty", False),
        ("overlong_tokens", None),
        ("overlong_penalty_factor", None),
        ("mask_no_eos_with_zero", False),
        ("discount", 1.0),
        ("gae_lambda", 1.0),
        ("gae_timestep_unit", "token"),
        ("gae_lambda_kwargs", {}),
        ("use_sapo_loss", False),
        ("use_cispo_loss", False),
        ("importance_sampling_level", "token"),
        ("prox_logp_method", "recompute"),
        ("log_agent_stats", False),
        ("log_agent_stats_keys", []),
        ("enable_tree_training", False),
        ("is_critic", False),
    ):
        x.only(
            f"{a}.{name}",
            default,
            "is not supported: lorabus implements AReaL's decoupled PPO "
            "with GRPO group advantages only (set it back to AReaL's default)",
        )
    # LoRA and weight updates
    x.to(f"{a}.use_lora", "actor.use_lora", default=False)
    x.to(f"{a}.peft_type", "actor.peft_type", default="lora")
    x.to(f"{a}.lora_rank", "actor.lora_rank", default=32)
    x.to(f"{a}.lora_alpha", "actor.lora_alpha", default=16)
    x.to(f"{a}.target_modules", "actor.target_modules", default=[])
    mode = x.get(f"{a}.weight_update_mode", "xccl")
    if mode in ("disk", "xccl"):
        x.to(f"{a}.weight_update_mode", "actor.weight_update_mode", default="xccl")
    else:
        x.refuse(f"{a}.weight_update_mode", "is not supported; use disk or xccl")
    for name, default in (("enable_delta_weight_update", False),):
        x.only(f"{a}.{name}", default, "is not supported: lorabus publishes whole adapters")
    x.noop(f"{a}.weight_update_delta_method", "unused without delta weight updates")
    x.noop(f"{a}.weight_update_anchor_interval", "unused without delta weight updates")
    _megatron(x)
    for name in ("_version", "admin_api_key", "log_level", "request_timeout", "setup_timeout", "workers_ready_timeout"):
        x.noop(f"{a}.{name}", "AReaL controller option; lorabus's trainer is a bus service")


def _warmup(x: _Translator, o: str) -> None:
    """Both of AReaL's warm-up keys are lorabus's own, with AReaL's rule (the step count wins)."""
    x.to(f"{o}.warmup_steps", "actor.optimizer.warmup_steps")
    x.to(f"{o}.warmup_steps_proportion", "actor.optimizer.warmup_steps_proportion", default=0.001)


_OLD_MODES = {"token_mask": "mask", "token_truncate": "clamp"}
"""AReaL's removed behave_imp_weight_mode values -> rejection_sampling.action (its own mapping)"""


def _rejection(x: _Translator) -> None:
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
            x.to(mode, f"{p}.behav_imp_weight_cap", None, note=why + " (no cap)")
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
        if x.has(r):
            x.to(r, f"{p}.behav_imp_weight_cap", None, note="no filtering of stale tokens")
        else:
            _set(x.t.tree, f"{p}.behav_imp_weight_cap", None)
            x.t.rows.append(
                Row(r, "None (AReaL default)", f"{p}.behav_imp_weight_cap = None", "no filtering of stale tokens")
            )
        return
    x.only(f"{r}.level", "token", "is not supported: lorabus filters per token (level: token)")
    x.only(f"{r}.metric", "ratio", "is not supported: lorabus caps the ratio pi_prox/pi_behave (metric: ratio)")
    x.only(f"{r}.lower", None, "is not supported: lorabus caps from above only (remove lower)")
    x.noop(f"{r}.agg", "sequence-level only; lorabus filters per token")
    x.to(f"{r}.upper", f"{p}.behav_imp_weight_cap", default=5.0)
    x.to(f"{r}.action", f"{p}.behav_imp_weight_mode", default="mask")


def _norms(x: _Translator) -> None:
    p = "actor.ppo"
    rn, an = "actor.reward_norm", "actor.adv_norm"
    eps: set[float] = set()
    if x.get(rn) is None and not any(k.startswith(rn + ".") for k in x.flat):
        x.refuse(
            rn,
            f"(no reward normalisation) is not supported: {_NORM_WHY}; write reward_norm "
            "with mean_level group (or batch)",
        )
    else:
        mean, std = x.get(f"{rn}.mean_level", "batch"), x.get(f"{rn}.std_level", "batch")
        if mean not in ("group", "batch") or std not in (mean, None):
            x.refuse(
                f"{rn}.mean_level",
                f"with std_level {std!r} is not supported: {_NORM_WHY}, "
                "dividing by the std at the same level or not at all",
            )
            x.used.add(f"{rn}.std_level")
        else:
            x.to(f"{rn}.mean_level", f"{p}.group_adv_norm", mean == "group", default="batch")
            x.to(f"{rn}.std_level", f"{p}.adv_norm_std", std is not None, default="batch")
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
        _norm_common(x, an, eps)
    if len(eps) > 1:
        x.t.problems.append(
            f"actor.reward_norm.eps / actor.adv_norm.eps: {sorted(eps)} differ; "
            "lorabus has one actor.ppo.norm_eps for both (make them equal)"
        )
    elif eps:
        _set(x.t.tree, f"{p}.norm_eps", eps.pop())


def _norm_common(x: _Translator, key: str, eps: set[float]) -> None:
    x.only(f"{key}.mean_leave1out", False, "is not supported: lorabus centres on the plain mean")
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


def _megatron(x: _Translator) -> None:
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


def _rollout(x: _Translator) -> None:
    r = "rollout"
    x.to(f"{r}.max_concurrent_rollouts", "rollout.max_concurrent_rollouts")
    x.to(f"{r}.consumer_batch_size", "rollout.consumer_batch_size", default=1)
    x.to(f"{r}.max_head_offpolicyness", "rollout.max_head_offpolicyness", default=0)
    x.to(f"{r}.use_lora", "rollout.use_lora", default=False)
    if x.get(f"{r}.lora_name"):
        x.to(f"{r}.lora_name", "rollout.lora_name")
    x.noop(f"{r}.lora_name", "empty: filled from gconfig.lora_name")
    x.to(f"{r}.request_timeout", "rollout.request_timeout_s")
    x.noop(f"{r}.queue_size", "the queue is the bus's trajectory stream")
    x.noop(f"{r}.enable_rollout_tracing", "every trajectory is an event on the bus (`lorabus watch`)")
    x.noop(f"{r}.dump_to_file", "every trajectory is an event on the bus (`lorabus watch`)")
    x.noop(f"{r}.fileroot", "lorabus writes under run_dir and store.uri")
    x.noop(f"{r}.scheduling_spec", "lorabus up starts the rollout sidecars; deployments place them")
    x.noop(f"{r}.scheduling_strategy", "the rollout servers always run apart from the trainer")
    x.noop(
        f"{r}.agent",
        "lorabus's rollout is one generation per sample scored by "
        "train_dataset.reward_fn (AReaL's inline single-turn workflow)",
    )
    x.noop(f"{r}.request_retries", "the sidecar retries a failed generation until its lease ends")
    x.noop(f"{r}.setup_timeout", "servers are waited for by their health endpoint")
    x.noop(f"{r}.workers_ready_timeout", "servers are waited for by their health endpoint")
    x.noop(f"{r}.pause_grace_period", "lorabus never pauses generation for weight updates")
    for name, default in (
        ("deterministic_sampling", False),
        ("serialize_group_samples", False),
        ("check_trajectory_format", False),
        ("return_routed_experts", False),
    ):
        x.only(f"{r}.{name}", default, "is not supported by lorabus's rollout (remove it)")
    for name in (
        "_version",
        "model",
        "routing_strategy",
        "poll_interval",
        "admin_api_key",
        "api_url",
        "provider_api_key",
    ):
        x.noop(f"{r}.{name}", "AReaL controller option; lorabus's rollouts are bus services")


@dataclass(frozen=True)
class _Server:
    """How one inference server's AReaL section translates."""

    label: str
    """the server's name in a reason (vLLM, SGLang)"""
    fields: tuple[tuple[str, Any], ...]
    """(name, AReaL's default or ... for none) copied under the same name"""
    auto: str
    """the LoRA list lorabus fills in itself"""
    flags: tuple[tuple[str, str], ...]
    """(name, command-line flag) passed through as `flag=value` where set"""
    switches: tuple[tuple[str, str], ...] = ()
    """(name, command-line flag) passed as the bare flag where true"""


_SERVERS = {
    "vllm": _Server(
        "vLLM",
        (
            ("model", ...),
            ("dtype", ...),
            ("max_model_len", ...),
            ("enable_lora", ...),
            ("max_lora_rank", 16),
            ("max_loras", 8),
        ),
        "lora_modules",
        (
            ("seed", "--seed"),
            ("gpu_memory_utilization", "--gpu-memory-utilization"),
            ("max_num_seqs", "--max-num-seqs"),
            ("block_size", "--block-size"),
        ),
        (("enforce_eager", "--enforce-eager"),),
    ),
    "sglang": _Server(
        "SGLang",
        (
            ("model_path", ...),
            ("enable_lora", ...),
            ("max_lora_rank", ...),
            ("max_loaded_loras", 8),
            ("lora_backend", "triton"),
        ),
        "lora_paths",
        (
            ("random_seed", "--random-seed"),
            ("dtype", "--dtype"),
            ("context_length", "--context-length"),
            ("mem_fraction_static", "--mem-fraction-static"),
            ("max_running_requests", "--max-running-requests"),
        ),
    ),
}


def _servers(x: _Translator) -> None:
    engine = x.t.tree.get("rollout", {}).get("engine")
    if engine not in _SERVERS:
        return
    s, server = engine, _SERVERS[engine]
    flags: list[str] = list(getattr(x, "server_flags", []))
    for name, default in server.fields:
        x.to(f"{s}.{name}", f"{s}.{name}", default=default)
    x.noop(f"{s}.{server.auto}", "auto-filled with {lora_name}-v0, as in AReaL")
    for name, flag in server.flags:
        if x.get(f"{s}.{name}") is not None:
            flags.append(f"{flag}={x.get(f'{s}.{name}')}")
            x.t.rows.append(Row(f"{s}.{name}", x.get(f"{s}.{name}"), f"{s}.extra_args += {flags[-1]}"))
            x.used.add(f"{s}.{name}")
        x.noop(f"{s}.{name}", f"unset: {server.label}'s default")
    for name, flag in server.switches:
        if x.get(f"{s}.{name}"):
            flags.append(flag)
            x.t.rows.append(Row(f"{s}.{name}", True, f"{s}.extra_args += {flag}"))
        x.used.add(f"{s}.{name}")
    x.noop(s, f"server tuning lorabus passes through only for the fields above; the rest are {server.label}'s defaults")
    for other in _SERVERS:
        if other != s:
            x.noop(other, f"rollout.backend is {s}")
    _set(x.t.tree, f"{s}.extra_args", flags)


GSM8K_INSTRUCTION = "\nPlease put your final answer within \\boxed{}."
"""what AReaL's GSM8K RL loader appends to each question (areal/dataset/gsm8k.py)"""

_GSM8K = {
    "prompt_field": "question",
    "answer_field": "answer",
    "config_name": "main",
    "instruction": GSM8K_INSTRUCTION,
    "chat_template": True,
    "reward_fn": "services.common.rewards:math_answer",
}
"""AReaL's GSM8K RL dataset and reward (`"gsm8k" in path` with type rl): the question plus its
instruction as one user message through the chat template, scored by math-verify"""

_OWN_DATA_KEYS = ("prompt_field", "answer_field", "config_name", "reward_fn", "instruction", "chat_template")
"""lorabus's dataset keys, accepted in an AReaL file's dataset sections too (AReaL has no word for
a schema it does not recognise; these are the keys a loading error names)"""


def _datasets(x: _Translator) -> None:
    for name, split in (("train_dataset", "train"), ("valid_dataset", "test")):
        d = name
        if not any(k.startswith(d + ".") for k in x.flat):
            if x.has(d):
                x.noop(d, "no validation set")
            continue
        x.to(f"{d}.path", f"{name}.path")
        kind = x.get(f"{d}.type")
        if kind is None:
            x.t.problems.append(f"{d}.type: missing; AReaL requires it (type: rl)")
        elif kind != "rl":
            x.refuse(f"{d}.type", "is not supported: lorabus trains RL on prompts (type: rl)")
        else:
            x.to(f"{d}.type", f"{name}.type")
        x.to(f"{d}.split", f"{name}.split", default=split)
        x.to(f"{d}.shuffle", f"{name}.shuffle", default=name == "train_dataset")
        path = str(x.get(f"{d}.path", ""))
        if "gsm8k" in path and kind == "rl":
            for key, value in _GSM8K.items():
                _set(x.t.tree, f"{name}.{key}", value)
            x.t.rows.append(
                Row(
                    f"{d}.path",
                    path,
                    f"{name}: " + ", ".join(f"{k} = {v!r}" for k, v in _GSM8K.items()),
                    "AReaL's GSM8K loader and reward: the question and its instruction through the "
                    "chat template, the answer after '####', scored by math-verify",
                )
            )
        for key in _OWN_DATA_KEYS:
            x.to(f"{d}.{key}", f"{name}.{key}", note="lorabus's own dataset key")
        x.to(
            f"{d}.max_length",
            f"{name}.max_length",
            note="prompts longer than this many tokens are dropped, as AReaL does",
        )
        x.noop(f"{d}.pin_memory", "data loading is per service; nothing to pin")
        x.noop(f"{d}.num_workers", "data loading is per service")
        x.noop(f"{d}.num_dataset_workers", "data loading is per service")
        x.noop(f"{d}.scheduling_spec", "data loading is per service")
        x.noop(f"{d}.setup_timeout", "data loading is per service")
        x.only(
            f"{d}.dataset_kwargs",
            ({}, None),
            "is not supported: lorabus's loader takes path, split and the prompt/answer fields "
            f"({', '.join(_OWN_DATA_KEYS)})",
        )
        x.noop(
            f"{d}.batch_size",
            "the trainer's step is rollout.consumer_batch_size groups (made equal to it)"
            if name == "train_dataset"
            else "`lorabus evaluate` batches by itself (evaluator.batch_size)",
        )
        if name == "valid_dataset":
            x.noop(f"{d}.drop_last", "`lorabus evaluate` scores every held-out prompt")
        else:
            x.only(
                f"{d}.drop_last",
                True,
                "is not supported: a lorabus epoch is prompts // consumer_batch_size steps, the "
                "last partial batch dropped (set true)",
                note="AReaL's default: an epoch is prompts // batch_size steps",
            )
    if (
        x.has("train_dataset.batch_size")
        and x.has("rollout.consumer_batch_size")
        and x.get("train_dataset.batch_size") != x.get("rollout.consumer_batch_size")
    ):
        x.t.problems.append(
            f"train_dataset.batch_size: {x.get('train_dataset.batch_size')} differs from "
            f"rollout.consumer_batch_size {x.get('rollout.consumer_batch_size')}; a lorabus step "
            "trains on consumer_batch_size groups, one per prompt (make them equal)"
        )
    _steps(x)


def _steps(x: _Translator) -> None:
    """Epochs stay epochs: they become steps when a service loads the config and its data
    (`services.config.loader`), so translating a file reads no data and needs no network."""
    epochs, steps = x.get("total_train_epochs"), x.get("total_train_steps")
    if epochs is None and steps is None:
        x.t.problems.append("total_train_epochs: missing; AReaL requires it (or total_train_steps)")
        return
    if epochs is not None:
        batch = x.get("train_dataset.batch_size", x.get("rollout.consumer_batch_size", 1))
        x.to(
            "total_train_epochs",
            "total_train_epochs",
            note=f"steps = {epochs} x (train prompts // batch {batch}), counted when the run starts and "
            "loads the data" + (", or total_train_steps where smaller" if steps is not None else ""),
        )
    if steps is not None:
        x.to("total_train_steps", "total_train_steps", note="AReaL stops at whichever ends first")


def _utilities(x: _Translator) -> None:
    x.noop("cluster.fileroot", "lorabus writes under run_dir (./runs/<run>) and the object store (store.uri)")
    x.noop("cluster.name_resolve", "services find each other through NATS (bus.url)")
    x.noop("cluster", "lorabus up runs on this host; deployments size each service (docs/deploy.md)")
    x.noop("scheduler", "lorabus up starts local processes; deployments use compose/kubernetes (docs/deploy.md)")
    x.noop("launcher", "lorabus up starts local processes; deployments use compose/kubernetes (docs/deploy.md)")
    x.noop(
        "saver",
        "the trainer checkpoints every actor.checkpoint_every steps, and the exporter "
        "writes every version as a PEFT directory (exporter.uri)",
    )
    x.noop(
        "recover",
        "recovery is always on: the trainer resumes from its last checkpoint and the registry replays its journal",
    )
    x.noop("evaluator", "`lorabus evaluate` scores every new version on valid_dataset")
    x.noop(
        "stats_logger",
        "metrics are Prometheus (metrics.port) and events on the bus (`lorabus watch`); no wandb/swanlab/tensorboard",
    )
    x.noop("perf_tracer", "no tracer; per-service Prometheus metrics instead")
    x.noop("memory_profiler", "no memory profiler")
    x.noop("post_exit_hook", "no exit hook")
    x.noop(
        "ref",
        "no reference model: lorabus has no KL term (kl_ctl must be 0); with LoRA the "
        "frozen base would be the reference",
    )


# --- unknown keys and renames ----------------------------------------------------------------

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

_NO_EQUIVALENT = {
    "actor.disable_dropout": "lorabus trains with the model's own dropout config",
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
    for key, why in _NO_EQUIVALENT.items():
        if path == key or path.startswith(key + "."):
            return (
                f"AReaL's {key} has no lorabus equivalent ({why}); remove it, or load the whole "
                "file as AReaL's (actor.backend like fsdp:d4)"
            )
    if path.startswith(("actor.", "rollout.")) and path.endswith(".backend"):
        return RENAMES.get(path)
    return None


def _unknown(key: str, value: Any, asked: set[str]) -> str:
    known = sorted(asked | set(RENAMES) | set(_NO_EQUIVALENT))
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.8)
    fix = (
        f"did you mean {close[0]}?"
        if close
        else (
            f"lorabus knows no AReaL field of this name; remove it, or put native lorabus keys under {NATIVE_SECTION}:"
        )
    )
    return f"{key}: {value!r} is not translated; {fix}"


# --- the report ------------------------------------------------------------------------------


def _collapse(rows: list[Row]) -> list[Row]:
    """Neighbouring no-effect rows of one section with one reason become one row (`saver.*`)."""
    out: list[Row] = []
    for r in rows:
        top = r.areal.split(".")[0]
        last = out[-1] if out else None
        if (
            last is not None
            and r.became == "-"
            and last.became == "-"
            and last.note == r.note
            and last.areal.split(".")[0] == top
            and "." in r.areal
        ):
            out[-1] = Row(f"{top}.*", "…", "-", r.note)
        else:
            out.append(r)
    return out


def report(rows: list[Row]) -> str:
    """One table: AReaL field, its value, what it became here (or '-' and why not)."""

    def cut(text: Any, n: int) -> str:
        s = str(text)
        return s if len(s) <= n else s[: n - 1] + "…"

    rows = _collapse(rows)
    head = ("AReaL field", "value", "lorabus")
    k = max([len(head[0])] + [len(r.areal) for r in rows])
    v = min(24, max([len(head[1])] + [len(str(r.value)) for r in rows]))
    lines = [f"{head[0]:<{k}}  {head[1]:<{v}}  {head[2]}", f"{'-' * k}  {'-' * v}  {'-' * 7}"]
    for r in rows:
        became = r.became if r.became != "-" else "no effect"
        if r.note:
            became += f" ({r.note})" if r.became != "-" else f": {r.note}"
        lines.append(f"{r.areal:<{k}}  {cut(r.value, v):<{v}}  {became}")
    return "\n".join(lines)


def point_back(problem: str, origin: dict[str, str]) -> str:
    """A native problem about a translated field, with the AReaL field it came from."""
    key = problem.split(":", 1)[0]
    source = origin.get(key)
    return f"{problem} (from AReaL's {source})" if source and source != key else problem


REPORTED_ENV = "LORABUS_AREAL_REPORTED"
"""set once the table is printed, so the services `lorabus up` starts do not print it again"""


def announce(t: Translation, source: str | None) -> None:
    import os
    import sys

    if os.environ.get(REPORTED_ENV) == "1":
        return
    os.environ[REPORTED_ENV] = "1"
    print(
        f"lorabus: {source or 'config'} is an AReaL experiment file; translated as follows "
        "(`lorabus config translate` prints the native YAML):",
        file=sys.stderr,
    )
    print(report(t.rows), file=sys.stderr)
