"""A KV cache of fixed rows, each at its own length: what continuous batching decodes on.

transformers' caches keep one length for the whole batch, so a row can neither start after the
others nor leave before them. Here every row of the slab ([rows, kv_heads, length, head_dim] per
layer, allocated once) has its own write position (`lengths`, a device tensor): a decode step
writes each row's new key and value at its own position and attends to the slab through a mask
built from `lengths`, so rows admitted at different times share one fixed-shape step (one CUDA
graph per slab). A prompt is prefilled into one row (`row_mode`), whole or in chunks at rising
offsets, and a group's other rows take a copy of that prefix (`copy_prefix`): n samples of one
prompt cost one prefill.

Invariant: positions `0 .. lengths[r] - 1` of row r hold its sequence's keys and values; nothing
past them is read (the mask hides it), so a freed row is reused without clearing.

It offers what transformers' attention layers call (`update`), which is all a forward needs when
it is given position ids and a 4D mask (both versions in use: 5.17 on the GPU image, 5.2x here).
A decode step's write is one `kv_write` kernel per layer where Triton runs (`fused_kv_write`),
the two index assignments of torch elsewhere.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from services.rollout import kv_write


class SlabCache:
    def __init__(
        self,
        config: PretrainedConfig,
        rows: int,
        length: int,
        device: torch.device,
        dtype: torch.dtype,
        fused_kv_write: bool = True,
    ):
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        shape = (rows, kv_heads, length, head_dim)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_hidden_layers)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_hidden_layers)]
        self.rows, self.length = rows, length
        self.lengths = torch.zeros(rows, dtype=torch.long, device=device)
        """tokens held per row; the next decode step writes at this position"""
        self._all_rows = torch.arange(rows, device=device)
        self._row: int | None = None
        self._start = 0
        self.fused_kv_write = fused_kv_write

    # --- what the model's layers call ---
    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if self._row is not None:  # a prefill chunk of one row: [1, kv_heads, c, d] at its offset
            end = self._start + key.shape[2]
            keys[self._row, :, self._start : end] = key[0]
            values[self._row, :, self._start : end] = value[0]
            return keys[self._row : self._row + 1, :, :end], values[self._row : self._row + 1, :, :end]
        # a decode step of every row: [rows, kv_heads, 1, d] at each row's own position
        if not (self.fused_kv_write and kv_write.fused(keys, values, key, value, self.lengths)):
            keys[self._all_rows, :, self.lengths] = key[:, :, 0]
            values[self._all_rows, :, self.lengths] = value[:, :, 0]
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # never asked for when position ids are given; present for the interface

    # --- what the decoder calls ---
    def row_mode(self, row: int | None, start: int = 0) -> None:
        """Route the next forwards' writes to one row's prefill, its chunk written from position
        `start` on (None: decode every row)."""
        self._row, self._start = row, start

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        for keys, values in zip(self.keys, self.values):
            keys[dst, :, :length] = keys[src, :, :length]
            values[dst, :, :length] = values[src, :, :length]

    def decode_mask(self, out: torch.Tensor) -> torch.Tensor:
        """Write into `out` ([rows, 1, 1, length], the model's dtype) the additive mask of the
        next decode step: row r sees positions 0 .. lengths[r] (the token being written too)."""
        visible = torch.arange(self.length, device=out.device)[None, :] <= self.lengths[:, None]
        out.copy_(torch.where(visible, 0.0, torch.finfo(out.dtype).min)[:, None, None, :])
        return out
