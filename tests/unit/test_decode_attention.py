"""The grouped one-token decode attention: same values as repeating K/V per query head, reached
by every decode step of the static path, and the model's own attention for everything else."""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface

from services.rollout import decode_attention
from services.rollout.decode_attention import grouped_decode_attention
from services.rollout.sampling import DecodeGraphs, Row, decode
from tests.fixtures.tiny import tiny_qwen2

pytestmark = pytest.mark.unit


class _Attn(torch.nn.Module):
    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def reference(query, key, value, mask, scale):
    """Plain softmax attention with each KV head repeated for its query heads."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = (query.float() @ key.float().transpose(-1, -2)) * scale + mask.float()
    return (scores.softmax(-1) @ value.float()).transpose(1, 2)


@pytest.mark.parametrize("q_len", [1, 5])
def test_equals_repeated_kv_attention_with_a_padding_mask(q_len):
    g = torch.Generator().manual_seed(0)
    b, kv_heads, groups, length, dim = 3, 2, 3, 16, 8
    query = torch.randn(b, kv_heads * groups, q_len, dim, generator=g)
    key = torch.randn(b, kv_heads, length, dim, generator=g)
    value = torch.randn(b, kv_heads, length, dim, generator=g)
    mask = torch.zeros(b, 1, q_len, length)
    mask[0, ..., :4] = torch.finfo(mask.dtype).min  # a left-padded row
    mask[1, ..., 12:] = torch.finfo(mask.dtype).min  # an unwritten cache tail
    out, weights = grouped_decode_attention(_Attn(groups), query, key, value, mask, scaling=dim**-0.5)
    assert weights is None and out.shape == (b, q_len, kv_heads * groups, dim)
    torch.testing.assert_close(out, reference(query, key, value, mask, dim**-0.5), atol=1e-5, rtol=1e-5)


def rows(n: int) -> list[Row]:
    return [Row(prompt=list(range(3, 3 + 2 + i)), max_new_tokens=9, temperature=1.0, seed=7 + i) for i in range(n)]


def test_every_static_decode_step_runs_it_and_tokens_match_the_models_own_attention(monkeypatch):
    own = tiny_qwen2(seed=3)
    want = decode(own, rows(4), graphs=DecodeGraphs(own, capture=False, grouped_attention=False))
    assert own.config._attn_implementation != decode_attention.NAME

    model = tiny_qwen2(seed=3)
    graphs = DecodeGraphs(model, capture=False)
    assert model.config._attn_implementation == decode_attention.NAME
    one_token_calls = []

    def counting(module, query, *args, **kwargs):
        one_token_calls.append(query.shape[2] == 1)
        return grouped_decode_attention(module, query, *args, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, decode_attention.NAME, counting)
    got = decode(model, rows(4), graphs=graphs)
    layers = model.config.num_hidden_layers
    assert one_token_calls.count(False) == layers  # the prefill
    assert one_token_calls.count(True) == layers * 8  # every later step of every layer
    for g_row, w_row in zip(got, want):
        assert g_row.token_ids == w_row.token_ids
        torch.testing.assert_close(torch.tensor(g_row.logprobs), torch.tensor(w_row.logprobs), atol=1e-5, rtol=0)
