"""Wrapping the frozen base model with LoRA (peft) and reading the adapter back out.

The base stays in the compute dtype (AReaL upcasts it to fp32, doubling its memory for
weights that never change); the LoRA tensors are fp32 masters whatever the base dtype
(`services.trainer.precision` says why), and the adapter leaves in the serving dtype.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import cast

import torch
import torch.nn.functional as F
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.lora import LoraLayer
from torch import nn

from proto.messages import LoraSpec
from services.common.adapter_io import standardize_key
from services.common.lora_targets import for_backend
from services.config.schema import ActorConfig
from services.trainer.engines import base as engines_base
from services.trainer.precision import upcast

log = logging.getLogger(__name__)


def lora_config(actor: ActorConfig) -> LoraConfig:
    """The peft config of the fsdp2 backend (peft resolves all-linear against the model)."""
    if actor.peft_type != "lora":
        raise ValueError(f"actor.peft_type: {actor.peft_type!r} is not supported; use 'lora'")
    if actor.lora_rank < 1:
        raise ValueError(f"actor.lora_rank: {actor.lora_rank} must be >= 1")
    return LoraConfig(
        task_type="CAUSAL_LM",
        r=actor.lora_rank,
        # peft annotates lora_alpha as int but only divides it by r: a float alpha is kept exactly
        lora_alpha=actor.lora_alpha,  # type: ignore[arg-type]
        target_modules=for_backend(actor.target_modules, "fsdp2"),
        lora_dropout=0.0,
        bias="none",
    )


def add_lora(model: PeftModel, actor: ActorConfig, adapter: str) -> None:
    """Add one more adapter named `adapter` to a wrapped model (another run of a fleet: its
    own rank, alpha and targets); its B is zero and its tensors fp32 masters, as wrap_lora's.
    Seed torch's RNG first for a reproducible A."""
    try:
        model.add_adapter(adapter, lora_config(actor))
    except ValueError as exc:
        raise ValueError(f"actor.target_modules: {actor.target_modules} did not match the model ({exc})") from exc
    upcast([p for _, p in lora_parameters(model, adapter)])


def set_active_adapter(model: PeftModel, adapter: str) -> None:
    """peft's `model.set_adapter(adapter)`: each LoRA layer runs `adapter`, whose weights are
    trainable and every other adapter's frozen (equal state, `tests/unit/test_lora_activate.py`).

    For the plain LoRA on linear layers that `lora_config` makes, the flags are set here
    directly and only where they change: peft's walks each adapter weight's module tree (18-48
    ms with 8 adapters on a 28-layer model, on this project's CPU), and a fleet switches once per
    run per step under the shared model's lock. Anything else (an Embedding target, a variant,
    a LoRA bias, a merged layer) goes through peft."""
    if model.active_adapter == adapter:
        return
    if adapter not in model.peft_config:
        raise ValueError(f"adapter: {adapter!r} is not on the model; add it with add_lora first")
    layers = _lora_layers(model)
    if not all(_plain(m) for m in layers):
        model.set_adapter(adapter)
        return
    for m in layers:
        for key in m.lora_A:
            on = key == adapter
            for p in (m.lora_A[key].weight, m.lora_B[key].weight):
                if p.requires_grad != on:
                    p.requires_grad_(on)
        m._active_adapter = [adapter]
    model.base_model.active_adapter = adapter  # type: ignore[assignment]  # peft types base_model as a Module
    model.active_adapter = adapter


def _lora_layers(model: nn.Module) -> list[LoraLayer]:
    """The LoRA layers of `model`, found without walking into them (each holds a module per
    adapter: most of a fleet's modules)."""
    layers: list[LoraLayer] = []
    todo: list[nn.Module] = [model]
    while todo:
        m = todo.pop()
        if isinstance(m, LoraLayer):
            layers.append(m)
        else:
            todo.extend(m.children())
    return layers


def _plain(m: LoraLayer) -> bool:
    """Whether `m` is plain LoRA on a linear layer (what `lora_config` makes): no variant, no
    LoRA bias, unmerged."""
    return isinstance(m, LoraLinear) and not m.lora_variant and not m.merged and not any(m.lora_bias.values())


def wrap_lora(base: nn.Module, actor: ActorConfig) -> PeftModel:
    """Freeze `base` and add a LoRA adapter; B is zero, so the wrapped model equals the base.

    The LoRA A initialisation draws from torch's global RNG: seed it identically on every
    rank before calling (ranks must start from the same adapter)."""
    for p in base.parameters():
        p.requires_grad_(False)
    try:
        model = get_peft_model(base, lora_config(actor), autocast_adapter_dtype=False)
    except ValueError as exc:
        raise ValueError(f"actor.target_modules: {actor.target_modules} did not match the model ({exc})") from exc
    upcast([p for _, p in lora_parameters(model)])
    return model


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor shard (FSDP2) -> the whole tensor (a collective: every rank must call)."""
    full_tensor = getattr(t, "full_tensor", None)
    return full_tensor() if full_tensor is not None else t


def lora_parameters(model: nn.Module, adapter: str | None = None) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every LoRA A/B weight (of the named peft adapter only, when the
    model carries several: one per run of a fleet), in a fixed (module) order."""
    out = []
    marks = (".lora_A.", ".lora_B.") if adapter is None else (f".lora_A.{adapter}.", f".lora_B.{adapter}.")
    for name, p in model.named_parameters():
        if any(mark in name for mark in marks):
            out.append((name, p))
    if not out:
        raise ValueError("model has no LoRA parameters; wrap it with wrap_lora first")
    return out


def adapter_state(
    named: Sequence[tuple[str, nn.Parameter]],
    dtype: torch.dtype | None = None,
    into: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """The LoRA tensors `named` (`lora_parameters` of a model, or of one of its adapters),
    full (gathered under FSDP2) and on CPU, under PEFT-standard keys
    (`base_model.model.<module>.lora_A.weight`, no adapter-name segment). Never the base.
    `dtype`: cast to it (once, before the copy to CPU); None keeps the fp32 masters. An engine
    lists its parameters once: finding them walks every parameter of the shared model (~9 ms
    with 8 adapters on a 28-layer model, on this project's CPU), and this runs every step.

    `into`: tensors to write the result into instead of new ones (the XCCL sender's free send
    set, `XcclSender.fill_views`: the cast lands in the send buckets, so the broadcast needs
    no pack copy); returned as they are. Used only if it has exactly these names, shapes and
    the target dtype (checked before any gather: a rank must not leave the collective loop
    half way), else ignored."""
    params = [(standardize_key(name), p) for name, p in named]
    if into is not None and not _fits(into, params, dtype):
        log.warning("adapter_state: `into` is not this adapter's layout; new tensors instead")
        into = None
    state: dict[str, torch.Tensor] = {}
    for key, p in params:
        full = _full(p.detach())
        if into is not None:
            state[key] = into[key]
            state[key].copy_(full)
            continue
        cast = full.to(dtype) if dtype is not None else full
        state[key] = cast.cpu() if cast is not full else full.cpu().clone()
    return state


def _fits(into: Mapping[str, torch.Tensor], params: list[tuple[str, nn.Parameter]], dtype: torch.dtype | None) -> bool:
    if len(into) != len(params):
        return False
    for key, p in params:
        t = into.get(key)
        if t is None or t.shape != p.shape or t.dtype != (dtype or p.dtype):
            return False
    return True


def wrapped_module_names(model: nn.Module, adapter: str | None = None) -> list[str]:
    """Leaf names of the modules that carry LoRA (that adapter's, if named), sorted."""
    return sorted(
        {
            name.rsplit(".", 1)[-1]
            for name, m in model.named_modules()
            if isinstance(m, LoraLayer) and (adapter is None or adapter in m.lora_A)
        }
    )


def lora_spec(
    model: nn.Module, actor: ActorConfig, base_model: str | None = None, adapter: str | None = None
) -> LoraSpec:
    """The published `LoraSpec` of `model`'s adapter (`engines.base.lora_spec`, the one builder),
    naming the modules peft actually wrapped (all-linear resolved to names)."""
    return engines_base.lora_spec(actor, wrapped_module_names(model, adapter), base_model)


Route = list[tuple[str, int, int]]
"""(adapter, first row, end row) spans covering a batch's rows in order"""


def unroutable(model: nn.Module) -> str | None:
    """Why `rows_by_adapter` cannot route `model`'s rows (a LoRA layer other than plain LoRA on
    a linear layer without dropout or bias, which `lora_config` makes), or None when it can."""
    for m in _lora_layers(model):
        if not _plain(m) or not all(isinstance(d, nn.Identity) for d in m.lora_dropout.values()):
            return (
                f"{type(m).__name__}: several runs step together only through plain LoRA on linear layers "
                "(no DoRA or other variant, no dropout or LoRA bias, unmerged); step these runs one at a time"
            )
    return None


@contextlib.contextmanager
def rows_by_adapter(model: nn.Module, *, enabled: bool = True) -> Iterator[list[Route]]:
    """While open, each span of rows of a forward through `model` goes through the LoRA of the
    adapter named for it, and through that adapter only: the caller sets `route[0]` (the yielded
    list) before each forward and keeps it until that forward's backward is done (a
    checkpointed layer runs its forward again then). A layer without the span's adapter leaves
    those rows on the base. Each LoRA linear computes what peft's own forward does for one
    active adapter (the input cast to the LoRA dtype, B(A(x)) x scaling added to the base
    output) for each row, with its row's adapter.

    The adapters present in a layer are joined (`_joined`): their A's stacked along the rank,
    their B's beside each other, one down-projection of every row, each row's columns of other
    adapters zeroed, one up-projection, each row's scaling. That is a fixed ~8 ops a layer
    where one per span cost ~6 (a fleet's joint step of 8 runs on a small model was bound by
    those launches), for (sum of the layer's ranks - the row's rank) x (in + out) more
    multiply-adds a row: at rank 16-32 next to a base linear of width 1-4 k, tens of percent
    of that linear at 8 runs, which only a step bound by its FLOPs would feel. The zeroed
    columns keep each adapter's gradients to its own rows. `enabled` False: nothing is routed
    (the active adapter serves every row)."""
    route: list[Route] = [[]]
    if not enabled:
        yield route
        return
    problem = unroutable(model)
    if problem is not None:
        raise ValueError(problem)
    layers = cast(list[LoraLinear], _lora_layers(model))
    masks: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(m: LoraLinear, x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        result = m.base_layer(x, *args, **kwargs)
        spans = route[0]
        order = list(dict.fromkeys(a for a, _, _ in spans if a in m.lora_A))
        if not order:
            return result
        a_weights = [cast(torch.Tensor, m.lora_A[a].weight) for a in order]
        mask, scale = _row_mask(masks, spans, [(a, m.r[a], m.scaling[a]) for a in order], x, a_weights[0])
        a_joined = a_weights[0] if len(order) == 1 else torch.cat(a_weights)
        b_weights = [cast(torch.Tensor, m.lora_B[a].weight) for a in order]
        b_joined = b_weights[0] if len(order) == 1 else torch.cat(b_weights, dim=1)
        rows = x if x.dtype == a_joined.dtype else x.to(a_joined.dtype)
        up = F.linear(F.linear(rows, a_joined) * mask, b_joined)
        # rounded as peft rounds B(A(x)) * scaling (to the up-projection's dtype: bf16 under
        # autocast), then added, so a joint step's rows match their solo step's
        delta = (up * scale).to(up.dtype)
        return (result + delta).to(result.dtype)  # peft's: the output keeps the base's dtype

    for m in layers:
        m.forward = functools.partial(forward, m)  # type: ignore[method-assign]  # the instance's, over the class's
    try:
        yield route
    finally:
        for m in layers:
            del m.forward


def _row_mask(
    masks: dict[tuple, tuple[torch.Tensor, torch.Tensor]],
    spans: Route,
    joined: list[tuple[str, int, float]],
    x: torch.Tensor,
    like: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """For a layer whose adapters are `joined` ((adapter, rank, scaling) in column order) and a
    batch `x` routed by `spans`: each row's 1/0 over the joined rank columns (its adapter's
    ones) and its scaling (0 for a row whose adapter the layer lacks), shaped to broadcast
    over `x`'s positions, in `like`'s dtype and device. Layers of one signature share them:
    made once per route (`masks` keeps one route's)."""
    key = (tuple(spans), tuple(joined), x.dim())
    found = masks.get(key)
    if found is not None:
        return found
    if masks and next(iter(masks))[0] != key[0]:
        masks.clear()
    columns, start = {}, 0
    for adapter, rank, scaling in joined:
        columns[adapter] = (start, start + rank, scaling)
        start += rank
    # filled on the device: a copy from pageable host memory would wait for the stream
    between = (1,) * (x.dim() - 2)  # a row's positions share its adapter
    mask = torch.zeros(x.shape[0], *between, start, device=like.device, dtype=like.dtype)
    scale = torch.zeros(x.shape[0], *between, 1, device=like.device, dtype=like.dtype)
    for adapter, lo, hi in spans:
        if adapter in columns:
            c0, c1, scaling = columns[adapter]
            mask[lo:hi, ..., c0:c1] = 1.0
            scale[lo:hi] = scaling
    made = (mask, scale)
    masks[key] = made
    return made
