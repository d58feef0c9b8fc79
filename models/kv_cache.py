"""The per-block KV cache: a dict {"key", "value"} of [batch, kv_heads, capacity, head_dim] tensors written in place.

Memory (the formula from the KV-cache articles, with grouped-query attention's fewer kv heads):
    bytes = 2 (K and V) x layers x kv_heads x head_dim x tokens x batch x bytes_per_element
"""

from __future__ import annotations

import torch
from torch import Tensor

from models.config import LanguageConfig

KVCache = dict[str, Tensor]


def allocate(batch: int, kv_heads: int, capacity: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> KVCache:
    shape = (batch, kv_heads, capacity, head_dim)
    return {"key": torch.zeros(shape, dtype=dtype, device=device), "value": torch.zeros(shape, dtype=dtype, device=device)}


def write(cache: KVCache, key: Tensor, value: Tensor, start_pos: int | Tensor) -> tuple[KVCache, Tensor, Tensor]:
    """Write `key`/`value` [B, H, T, D] at slots start_pos .. start_pos + T, in place.

    Returns the cache and the keys/values to attend over: slots 0 .. start_pos + T for an int `start_pos`; the whole
    capacity for a tensor `start_pos` (shape-static decoding, where the mask hides unwritten slots). A cache too
    small for an int `start_pos` (one returned by a cache-less call) grows by doubling, so appends stay amortised O(1).
    """
    end = start_pos + key.shape[2]
    if isinstance(start_pos, int):
        capacity = cache["key"].shape[2]
        if end > capacity:
            cache = {name: _grown(tensor, max(end, 2 * capacity)) for name, tensor in cache.items()}
        cache["key"][:, :, start_pos:end] = key
        cache["value"][:, :, start_pos:end] = value
        return cache, cache["key"][:, :, :end], cache["value"][:, :, :end]
    slots = torch.arange(key.shape[2], device=key.device) + start_pos
    # Cast as slice assignment does: under autocast the projections give bfloat16 K/V for a float32 cache.
    cache["key"].index_copy_(2, slots, key.to(cache["key"].dtype))
    cache["value"].index_copy_(2, slots, value.to(cache["value"].dtype))
    return cache, cache["key"], cache["value"]


def _grown(tensor: Tensor, capacity: int) -> Tensor:
    grown = tensor.new_zeros(*tensor.shape[:2], capacity, tensor.shape[3])
    grown[:, :, : tensor.shape[2]] = tensor
    return grown


def repeat_rows(caches: list[KVCache], repeats: int) -> list[KVCache]:
    """Each batch row's cache copied `repeats` times (row b becomes rows b*repeats .. b*repeats + repeats - 1)."""
    return [{name: t.repeat_interleave(repeats, dim=0) for name, t in cache.items()} for cache in caches]


def kv_cache_bytes(config: LanguageConfig, batch: int, tokens: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes a KV cache holds: 2 x layers x kv_heads x head_dim x tokens x batch x bytes per element."""
    element = torch.tensor([], dtype=dtype).element_size()
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * tokens * batch * element
