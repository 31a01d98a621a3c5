"""The rollout's decoder-layer forward: the two residual adds fused with what reads them.

transformers' pre-norm layer (Qwen2, Llama, Qwen3, Mistral) is

    h = residual + self_attn(input_layernorm(residual))
    out = h + mlp(post_attention_layernorm(h))

Its two adds are launches of their own (56 of a Qwen2.5-1.5B decode step, 0.09 ms of 2.7 at batch
64 on an H100), and in a batch with rows on older adapter versions o_proj and down_proj each add
one more, the expand of their low-rank correction (`lora_slots`: 56 more launches, ~0.16 ms).
Here the first add, o_proj's correction and post_attention_layernorm are one kernel
(`norm_kernel.add_normalize`), and the last add and down_proj's correction are one
(`lora_kernels.expand_stacked` with a residual): o_proj and down_proj are run inside
`lora_slots.deferred`, so their correction waits for the kernel that reads their output.

`use(model)` gives each layer that has the four modules above this forward, only where the
whole model's logits on a probe stay its own (to half-precision rounding); a layer called with
positional arguments beyond the hidden states computes its own way. The modules are looked up
at each call (the LoRA slots replace the projections after this), and a module that is not
what the fused path takes (a norm that is not `fused_norm.RMSNorm`, a projection that is not a
lone slot layer, a CPU tensor outside Triton's interpreter) is computed as transformers does.
LORABUS_FUSED_RESIDUAL=0 turns it off (read at each call, as the other kernels' switches).

Invariant: the layer's output is transformers' to the rounding `norm_kernel` documents; no
module, path or weight of the model is changed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from services.rollout import fused_norm, lora_slots, norm_kernel
from services.rollout.lora_kernels import Pending, triton_runs

PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


def available(device: torch.device) -> bool:
    """Triton on a CUDA device, or its interpreter (TRITON_INTERPRET=1: tests on CPU);
    LORABUS_FUSED_RESIDUAL=0 turns it off."""
    return triton_runs(device, "LORABUS_FUSED_RESIDUAL")


def add_norm(
    residual: torch.Tensor, x: torch.Tensor, norm: nn.Module, pending: Pending | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(s, norm(s))` for `s = residual + x` (x `pending.y`, corrected first, where given): one
    launch where `norm` is the fused RMSNorm and the kernel takes the call."""
    if isinstance(norm, fused_norm.RMSNorm):
        both = norm_kernel.add_normalize(x, residual, norm.weight, norm.variance_epsilon, pending)
        if both is not None:
            return both
    s = residual + (x if pending is None else pending.resolved())
    return s, norm(s)


def layer_forward(layer: nn.Module) -> Callable[..., torch.Tensor]:
    """`layer`'s forward with its residual adds fused (see the module docstring)."""
    own = layer.forward
    m: Any = layer

    def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args or not available(hidden_states.device):
            return own(hidden_states, *args, **kwargs)
        residual = hidden_states
        h = m.input_layernorm(hidden_states)
        with lora_slots.deferred(m.self_attn.o_proj) as late:
            h = m.self_attn(hidden_states=h, **kwargs)[0]
            pending = late.take(h)
        hidden, h = add_norm(residual, h, m.post_attention_layernorm, pending)
        with lora_slots.deferred(m.mlp.down_proj) as late:
            h = m.mlp(h)
            pending = late.take(h)
        return hidden + h if pending is None else pending.resolved(residual=hidden)

    forward.lorabus_layer = True  # type: ignore[attr-defined]
    return forward


def _candidate(module: nn.Module) -> bool:
    if not all(isinstance(getattr(module, name, None), nn.Module) for name in PARTS):
        return False
    projections = (getattr(module.self_attn, "o_proj", None), getattr(module.mlp, "down_proj", None))
    return all(isinstance(p, nn.Module) for p in projections)


@torch.no_grad()
def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, use_cache=False).logits.float()


def use(model: nn.Module) -> int:
    """Give each pre-norm decoder layer of `model` the fused forward where it runs on the model's
    device and the model's logits on a probe stay its own; returns how many layers. Idempotent."""
    param = next(model.parameters())
    if not available(param.device):
        return 0
    layers = [m for m in model.modules() if _candidate(m) and not hasattr(m.__dict__.get("forward"), "lorabus_layer")]
    if not layers:
        return 0
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 0) or 0)
    if vocab <= 0:
        return 0
    ids = torch.randint(0, vocab, (2, 5), generator=torch.Generator().manual_seed(0)).to(param.device)
    want = _logits(model, ids)
    before = [layer.__dict__.get("forward") for layer in layers]
    for layer in layers:
        layer.forward = layer_forward(layer)
    try:
        got = _logits(model, ids)
        tol = 1e-4 if param.dtype == torch.float32 else 2e-2
        same = got.shape == want.shape and bool((got - want).abs().max() <= tol * want.abs().max().clamp_min(1.0))
    except Exception:  # a layer this forward does not fit (another signature, a tuple output)
        same = False
    if not same:
        for layer, forward in zip(layers, before, strict=True):
            if forward is None:
                del layer.forward
            else:
                layer.forward = forward
        return 0
    return len(layers)
