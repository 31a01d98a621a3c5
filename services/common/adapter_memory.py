"""Trainer memory one run's adapter holds, from its LoRA shape on the base model's config, and
whether a fleet's budget can take one more run: pure, no I/O.

A fleet's trainer holds one base model and, per run, an adapter with its training state
(docs/multi-run.md): for every targeted linear layer of every decoder layer, LoRA's A (rank x in)
and B (out x rank), so rank x (in + out) parameters; each kept as an fp32 master whatever
`actor.dtype` (services/trainer/precision.py), with an fp32 gradient of the same size, and the
optimizer's state: Adam and AdamW two fp32 moments per parameter, plain SGD none. The base is
shared and counted nowhere here; what is left out is small or short-lived (Adam's one-element
step counters, the serving-dtype copy made while a version is published).

`fleet.max_adapter_memory_gib` bounds the sum over the live runs (the fleet's own among them);
unset, nothing is checked and no base config is read.

Invariant: a run is admitted under a budget only while the bytes of every live run, its own
included, fit it; the arithmetic reads only the config (HF `config.json` and the run's actor).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import msgspec

from services.common import lora_targets
from services.config.schema import LorabusConfig

GIB = 1 << 30
MASTER_BYTES = 4
"""bytes of an adapter parameter and of its gradient: fp32 masters (services/trainer/precision.py)"""
MOMENTS = {"adam": 2, "adamw": 2, "sgd": 0}
"""fp32 tensors of optimizer state per parameter (torch's Adam/AdamW: exp_avg, exp_avg_sq;
SGD without momentum, as services/trainer/engines/base.py makes it: none)"""
BASE_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers")


class AdapterMemoryError(ValueError):
    """A base config or a target list this arithmetic cannot size; the message names the field."""


class BaseShape(msgspec.Struct, frozen=True):
    """The linear layers of one decoder layer of a base model, by HF leaf name, as
    (in_features, out_features), and how many decoder layers there are."""

    layers: int
    linear: dict[str, tuple[int, int]]
    lm_head: tuple[int, int]
    """(hidden, vocab): targeted only when named (all-linear leaves the output layer out, as peft)"""


class AdapterMemory(msgspec.Struct, frozen=True):
    """One run's adapter in the trainer: parameters and the bytes of each part."""

    params: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int

    @property
    def total(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes


def base_shape(config: Mapping[str, Any], source: str = "actor.path") -> BaseShape:
    """The decoder's linear layers from an HF `config.json` of the Llama family (Llama, Qwen2,
    Qwen3, Mistral: q/k/v/o attention projections and a gated MLP). A multimodal config's
    `text_config` is read when the top level has no decoder keys."""
    if "hidden_size" not in config and isinstance(config.get("text_config"), Mapping):
        config = config["text_config"]
    missing = [k for k in BASE_KEYS if not isinstance(config.get(k), int)]
    if missing:
        raise AdapterMemoryError(
            f"{source}: config.json has no integer {', '.join(missing)} (model_type "
            f"{config.get('model_type')!r}); fleet.max_adapter_memory_gib sizes Llama-family decoders "
            "only: unset it for this base model"
        )
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    q, k = heads * head_dim, kv * head_dim
    linear = {
        "q_proj": (hidden, q),
        "k_proj": (hidden, k),
        "v_proj": (hidden, k),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    vocab = config.get("vocab_size")
    return BaseShape(
        layers=config["num_hidden_layers"], linear=linear, lm_head=(hidden, vocab if isinstance(vocab, int) else 0)
    )


def adapter_memory(shape: BaseShape, rank: int, targets: Sequence[str], optimizer: str) -> AdapterMemory:
    """A LoRA adapter of `rank` over `targets` (HF leaf names, or all-linear / [] for every
    decoder linear layer) trained by `optimizer` (adam, adamw, sgd)."""
    if optimizer not in MOMENTS:
        raise AdapterMemoryError(f"actor.optimizer.type: {optimizer!r} is not one of {', '.join(MOMENTS)}")
    try:
        resolved = lora_targets.for_backend(targets, "fsdp2")
    except ValueError as exc:  # already the config's messages
        raise AdapterMemoryError(str(exc)) from None
    names = list(shape.linear) if resolved == lora_targets.ALL_LINEAR else list(resolved)
    unknown = [n for n in names if n not in shape.linear and n != "lm_head"]
    if unknown:
        raise AdapterMemoryError(
            f"actor.target_modules: {unknown} are not linear layers of the base model's decoder "
            f"({', '.join(shape.linear)}, lm_head); target among them"
        )
    per_layer = sum(rank * sum(shape.linear[n]) for n in names if n != "lm_head")
    params = per_layer * shape.layers + (rank * sum(shape.lm_head) if "lm_head" in names else 0)
    return AdapterMemory(
        params=params,
        param_bytes=params * MASTER_BYTES,
        grad_bytes=params * MASTER_BYTES,
        optimizer_bytes=params * MASTER_BYTES * MOMENTS[optimizer],
    )


def run_memory(cfg: LorabusConfig, shape: BaseShape) -> AdapterMemory:
    """What `cfg`'s run holds in the fleet's trainer (its actor's rank, targets, optimizer)."""
    a = cfg.actor
    return adapter_memory(shape, a.lora_rank, a.target_modules, a.optimizer.type)


def human(n: int) -> str:
    """Bytes as a person reads them, exact below a KiB."""
    for unit, size in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def problems(fleet: LorabusConfig, run: LorabusConfig, live: Iterable[LorabusConfig], shape: BaseShape) -> list[str]:
    """Why the fleet's trainer budget cannot take `run` beside the `live` runs (the fleet's own
    among them); empty: it fits, or the fleet sets no budget."""
    budget_gib = fleet.fleet.max_adapter_memory_gib
    if budget_gib is None:
        return []
    try:
        mine = run_memory(run, shape).total
    except AdapterMemoryError as exc:
        return [str(exc)]
    # a live run was sized when it was admitted; one that cannot be sized now counts nothing
    used, names = 0, []
    for other in live:
        names.append(other.run)
        try:
            used += run_memory(other, shape).total
        except AdapterMemoryError:
            continue
    budget = int(budget_gib * GIB)
    if used + mine <= budget:
        return []
    a = run.actor
    # rounded up, so that the setting offered is never one byte short
    enough = math.ceil((used + mine) / GIB * 1e4) / 1e4
    return [
        f"fleet.max_adapter_memory_gib: {budget_gib:g} ({human(budget)}), too little for run {run.run!r}: its "
        f"adapter (rank {a.lora_rank}, {a.optimizer.type}) needs {human(mine)} ({mine} bytes: fp32 parameters, "
        f"gradients and optimizer state) and the live runs ({', '.join(names) or 'none'}) hold {human(used)}, "
        f"{human(used + mine)} together; stop a run, lower its actor.lora_rank or target fewer modules, or start "
        f"the fleet with fleet.max_adapter_memory_gib >= {enough:g}"
    ]
