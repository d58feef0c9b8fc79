"""The per-block KV cache: a dict {"key", "value"} of [batch, kv_heads, capacity, head_dim] tensors written in place.

A block runs in one of three modes, chosen by what it is given; this module is the one place that says what each
mode writes and what the attention then spans (`write` and `attended_slots`):

| kv_cache          | start_pos       | writes                                       | attention spans             |
|-------------------|-----------------|----------------------------------------------|-----------------------------|
| None              | 0               | nothing; returns {"key", "value"} of the call | the call's own tokens       |
| preallocated      | int             | slots start_pos .. start_pos + T, in place    | slots 0 .. start_pos + T    |
| preallocated      | 0-dim tensor    | the same slots, with index_copy_ (no sync)    | the whole capacity, masked  |
| paged             | [B] tensor      | the pool slots `slot_mapping` names           | the row's blocks, masked    |

The tensor mode keeps every shape static (the compiled decode step). A preallocated cache never grows: writing past
its capacity raises `CacheCapacityError` (int positions; tensor positions are the caller's to check, once, before
decoding, since checking a device tensor would stall the step).

The paged layout (PagedAttention, Kwon et al. 2023; built and managed by serving/) is the same dict with pool tensors:
"key"/"value" [num_blocks, block_size, kv_heads, head_dim] shared by every sequence, "block_table" [B, blocks] (each
row's blocks in order, padded with the null block 0) and "slot_mapping" [B, T] (the pool slot, block * block_size +
offset, of each new token; padded tokens write to the null block). Each row has its own position (`start_pos` [B]),
so rows of a batch may be at any point of their sequences: continuous batching, chunked prefill. Attention then
gathers each row's blocks and runs SDPA under a mask (exact, any block size), or, when the dict also holds a
FlexAttention "block_mask" and the "query_index" of the real tokens, runs FlexAttention over the pool in place, with
no gather (`paged_flex_attention`).

Memory (the formula from the KV-cache articles, with grouped-query attention's fewer kv heads):
    bytes = 2 (K and V) x layers x kv_heads x head_dim x tokens x batch x bytes_per_element
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from models.config import LanguageConfig
from models.errors import TinyVLMError

KVCache = dict[str, Tensor]


class CacheCapacityError(TinyVLMError, IndexError):
    """A write past the end of a preallocated KV cache."""


def allocate(batch: int, kv_heads: int, capacity: int, head_dim: int, dtype: torch.dtype,
             device: torch.device) -> KVCache:
    shape = (batch, kv_heads, capacity, head_dim)
    return {"key": torch.zeros(shape, dtype=dtype, device=device),
            "value": torch.zeros(shape, dtype=dtype, device=device)}


def capacity(cache: KVCache) -> int:
    return cache["key"].shape[2]


def attended_slots(cache: KVCache | None, start_pos: int | Tensor, num_new: int) -> int:
    """How many cache slots the attention of a call writing `num_new` tokens at `start_pos` spans (see the table)."""
    if cache is None:
        return num_new
    if "block_table" in cache:
        return cache["block_table"].shape[1] * cache["key"].shape[1]
    if isinstance(start_pos, int):
        return start_pos + num_new
    return capacity(cache)


def write(cache: KVCache | None, key: Tensor, value: Tensor, start_pos: int | Tensor) -> tuple[KVCache, Tensor, Tensor]:
    """Store `key`/`value` [B, H, T, D] as the table above says; return the cache and the keys/values to attend over."""
    if cache is None:
        return {"key": key, "value": value}, key, value
    if "block_table" in cache:
        return cache, *_write_paged(cache, key, value)
    end = start_pos + key.shape[2]
    if isinstance(start_pos, int):
        if end > capacity(cache):
            raise CacheCapacityError(f"writing KV slots {start_pos}..{end - 1} into a cache of {capacity(cache)} "
                                     f"slots; allocate one that holds every token (allocate_kv_cache(batch, capacity))")
        cache["key"][:, :, start_pos:end] = key
        cache["value"][:, :, start_pos:end] = value
        return cache, cache["key"][:, :, :end], cache["value"][:, :, :end]
    slots = torch.arange(key.shape[2], device=key.device) + start_pos
    # Cast as slice assignment does: under autocast the projections give bfloat16 K/V for a float32 cache.
    cache["key"].index_copy_(2, slots, key.to(cache["key"].dtype))
    cache["value"].index_copy_(2, slots, value.to(cache["value"].dtype))
    return cache, cache["key"], cache["value"]


def _write_paged(cache: KVCache, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
    """Scatter the new K/V into the pool at `slot_mapping`; return each row's blocks gathered, [B, H, blocks * size,
    D], or, for FlexAttention, the whole pool as one sequence, [1, H, num_blocks * size, D] (a view)."""
    slots, table = cache["slot_mapping"].flatten(), cache["block_table"]
    attended = []
    for pool, new in ((cache["key"], key), (cache["value"], value)):
        num_blocks, size, heads, dim = pool.shape
        flat = pool.view(num_blocks * size, heads, dim)
        flat.index_copy_(0, slots, new.transpose(1, 2).reshape(-1, heads, dim).to(pool.dtype))
        in_place = "block_mask" in cache
        attended.append(flat.transpose(0, 1)[None] if in_place else pool[table].flatten(1, 2).transpose(1, 2))
    return attended[0], attended[1]


@functools.cache
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)  # dynamic CPU flex kernels failed to build on torch 2.14


def paged_flex_attention(q: Tensor, keys: Tensor, values: Tensor, cache: KVCache) -> Tensor:
    """Attention of `q` [B, H, T, D] over the pool ([1, Hkv, slots, D]) with FlexAttention, in place: the real tokens
    of every row (`query_index` into the flattened B x T) form one sequence of queries, padded to the block mask's
    length; the mask (built from the block tables and positions) says which pool slots each may see."""
    batch, heads, seq, dim = q.shape
    index, mask = cache["query_index"], cache["block_mask"]
    flat = q.transpose(0, 1).reshape(heads, batch * seq, dim)
    queries = flat.new_zeros(heads, mask.seq_lengths[0], dim)
    queries[:, : len(index)] = flat[:, index]
    out = _compiled_flex_attention()(queries[None], keys.to(q.dtype), values.to(q.dtype), block_mask=mask,
                                     enable_gqa=True)
    result = torch.zeros_like(flat)
    result[:, index] = out[0, :, : len(index)]
    return result.reshape(heads, batch, seq, dim).transpose(0, 1)


def repeat_rows(caches: list[KVCache], repeats: int) -> list[KVCache]:
    """Each batch row's cache copied `repeats` times (row b becomes rows b*repeats .. b*repeats + repeats - 1)."""
    return [{name: t.repeat_interleave(repeats, dim=0) for name, t in cache.items()} for cache in caches]


def kv_cache_bytes(config: LanguageConfig, batch: int, tokens: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes a KV cache holds: 2 x layers x kv_heads x head_dim x tokens x batch x bytes per element."""
    element = torch.tensor([], dtype=dtype).element_size()
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * tokens * batch * element
