"""Attention for the one-token decode step of a grouped-query model, without repeating K/V.

With a mask (the static path always passes one: left padding and the unwritten cache tail),
transformers before 5.2x expands each KV head to its query heads (`repeat_kv`) over the whole
cache length in every layer of every step: for Qwen2.5-1.5B at batch 64 that copy was 3.2 of
the step's 8.6 ms on an H200 (`benchmarks/results/decode_breakdown_h200.json`). A one-token
step needs no copy: the `g` query heads that share a KV head are `g` queries against the same
keys, so the query is viewed as [batch, kv_heads, g, dim] and attends to the cache as it lies,
with the padding mask broadcast over the group. Any other call (prefill, multi-query, no
grouping) goes to transformers' own SDPA attention unchanged, so numerics differ from `sdpa`
only by the kernel's reduction order.

Where Triton runs, `attention_kernel` computes the one-token step (a split-cache kernel made for
one query position; cuDNN's, which SDPA picks, is made for many); elsewhere SDPA does.

`use(model)` registers the function under `NAME` (attention and mask interfaces, the mask being
SDPA's) and switches the model to it; torch, transformers and Triton only (the GPU image has no
more).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from services.rollout import attention_kernel

NAME = "lorabus_decode"
"""the attention implementation's registered name"""


def grouped_decode_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Shapes as transformers passes them: query [b, heads, q, d], key/value [b, kv_heads, L, d],
    mask [b, 1, q, L] or None; returns [b, q, heads, d]."""
    groups = getattr(module, "num_key_value_groups", 1)
    batch, heads, q_len, dim = query.shape
    special = dropout or kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None
    if q_len != 1 or groups == 1 or special:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    packed = query.reshape(batch, heads // groups, groups, dim)
    if attention_mask is not None:
        attention_mask = attention_mask[:, :, :, : key.shape[2]]
    out = attention_kernel.attend(packed, key, value, attention_mask, dim**-0.5 if scaling is None else scaling)
    if out is None:
        out = F.scaled_dot_product_attention(packed, key, value, attn_mask=attention_mask, scale=scaling)
    # [b, kv_heads, g, d] lists query heads in order (head h uses KV head h // g), so it is
    # already [b, 1, heads, d] in memory
    return out.reshape(batch, 1, heads, dim), None


def use(model: PreTrainedModel) -> None:
    """Switch `model` (every attention layer reads its config) to `grouped_decode_attention`."""
    AttentionInterface.register(NAME, grouped_decode_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.config._attn_implementation = NAME
