"""A batched, right-aligned KV cache for continuous batching on transformers models.

Every row's tokens end at the same column ``length``: row i occupies columns
``[length - row_len[i], length)`` and the columns before that are zero padding
that the attention mask hides. A decode step then appends one column for every
row at once. Rows join (after their own unpadded prefill) and leave between
steps by rebuilding the slab, so the steady state never copies the cache: keys
and values live in preallocated buffers, not in a tensor re-concatenated every
step as transformers' DynamicLayer does.

Padding is zeros, never garbage: a masked score has weight exactly 0, and
0 * finite = 0, so padded rows compute what unpadded ones do.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

# Extra columns allocated when the slab grows, so growth is amortized.
GROW = 64


class SlabLayer(DynamicLayer):
    """One layer's keys/values: buffers [B, H, capacity, D] with ``length`` used columns."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        super().__init__()
        self.buf_k = keys
        self.buf_v = values
        self.length = length
        self.is_initialized = True
        self.device = keys.device
        self.keys = keys[:, :, :length]
        self.values = values[:, :, :length]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + key_states.shape[-2]
        self.buf_k[:, :, self.length : end] = key_states
        self.buf_v[:, :, self.length : end] = value_states
        self.length = end
        self.keys = self.buf_k[:, :, :end]
        self.values = self.buf_v[:, :, :end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length


class SlabCache(Cache):
    """The batch's cache, passed to the model as ``cache=``."""

    def __init__(self, layers: list[SlabLayer]) -> None:
        super().__init__(layers=list(layers))
        self.slabs = list(layers)

    @property
    def length(self) -> int:
        return self.slabs[0].length if self.slabs else 0

    @property
    def capacity(self) -> int:
        return self.slabs[0].buf_k.shape[2] if self.slabs else 0


# One row's cache for every layer: [(keys [H, L, D], values [H, L, D])]; L = row length.
RowKV = list[tuple[torch.Tensor, torch.Tensor]]


def row_from_cache(cache: Cache, row: int, row_len: int) -> RowKV:
    """Views of one row of any transformers cache (a prefill's DynamicCache, or a slab)."""
    out: RowKV = []
    layer: Any
    for layer in cache.layers:
        keys, values = layer.keys, layer.values
        assert keys is not None and values is not None
        end = keys.shape[-2]
        out.append((keys[row, :, end - row_len : end], values[row, :, end - row_len : end]))
    return out


def build_slab(rows: list[RowKV], row_lens: list[int], headroom: int) -> SlabCache:
    """Copy rows right-aligned into fresh zeroed buffers with ``headroom`` free columns."""
    length = max(row_lens)
    capacity = length + max(headroom, 1)
    layers: list[SlabLayer] = []
    for li in range(len(rows[0])):
        k0, v0 = rows[0][li]
        keys = torch.zeros(
            (len(rows), k0.shape[0], capacity, k0.shape[2]), dtype=k0.dtype, device=k0.device
        )
        values = torch.zeros(
            (len(rows), v0.shape[0], capacity, v0.shape[2]), dtype=v0.dtype, device=v0.device
        )
        for ri, (row, n) in enumerate(zip(rows, row_lens, strict=True)):
            keys[ri, :, length - n : length] = row[li][0]
            values[ri, :, length - n : length] = row[li][1]
        layers.append(SlabLayer(keys, values, length))
    return SlabCache(layers)


def select_rows(cache: SlabCache, keep: list[int], row_lens: list[int], headroom: int) -> SlabCache:
    """Keep rows ``keep`` (their lengths in ``row_lens``) and drop all-padding columns."""
    length = cache.length
    new_length = max(row_lens)
    start = length - new_length
    index = torch.tensor(keep, dtype=torch.long, device=cache.slabs[0].buf_k.device)
    layers: list[SlabLayer] = []
    for layer in cache.slabs:
        capacity = max(layer.buf_k.shape[2] - start, new_length + max(headroom, 1))
        shape = (len(keep), layer.buf_k.shape[1], capacity, layer.buf_k.shape[3])
        keys = torch.zeros(shape, dtype=layer.buf_k.dtype, device=layer.buf_k.device)
        values = torch.zeros(shape, dtype=layer.buf_v.dtype, device=layer.buf_v.device)
        keys[:, :, :new_length] = layer.buf_k.index_select(0, index)[:, :, start:length]
        values[:, :, :new_length] = layer.buf_v.index_select(0, index)[:, :, start:length]
        layers.append(SlabLayer(keys, values, new_length))
    return SlabCache(layers)


def ensure_capacity(cache: SlabCache, extra: int) -> SlabCache:
    """Grow the buffers (copying once) when fewer than ``extra`` columns are free."""
    if cache.length + extra <= cache.capacity:
        return cache
    layers: list[SlabLayer] = []
    for layer in cache.slabs:
        capacity = layer.length + extra + GROW
        shape = (layer.buf_k.shape[0], layer.buf_k.shape[1], capacity, layer.buf_k.shape[3])
        keys = torch.zeros(shape, dtype=layer.buf_k.dtype, device=layer.buf_k.device)
        values = torch.zeros(shape, dtype=layer.buf_v.dtype, device=layer.buf_v.device)
        keys[:, :, : layer.length] = layer.buf_k[:, :, : layer.length]
        values[:, :, : layer.length] = layer.buf_v[:, :, : layer.length]
        layers.append(SlabLayer(keys, values, layer.length))
    return SlabCache(layers)
