"""The per-block KV cache: a dict {"key", "value", "layout"}. The layout is an object that writes a call's K/V
into the cache and attends over it; `Attention.forward` calls its `attend` once. It is the seam: serving/
plugs its paged layout in (serving/paged_layout.py) by subclassing `Layout`, without editing the model.

| layout                          | "key" / "value"         | a call writes          | attention spans      |
|---------------------------------|-------------------------|------------------------|----------------------|
| NoCache (no cache passed)       | -                       | none; returns Growing  | the call's tokens    |
| Growing (nanoVLM's)             | [B, Hkv, so far, D]     | appends (torch.cat)    | every token so far   |
| Preallocated()                  | [B, Hkv, capacity, D]   | slots start_pos .. + T | slots 0 .. start + T |
| Preallocated(shape_static=True) | [B, Hkv, capacity, D]   | the same, index_copy_  | all slots, masked    |

`start_pos` is an int, or a 0-dim device tensor for the shape-static mode (every step of a compiled decode has
one shape). A preallocated cache never grows: writing past its capacity raises `CacheCapacityError` (a tensor
position is the caller's to check once, before decoding: reading it would stall the step).

Memory (the formula from the KV-cache articles, with grouped-query attention's fewer kv heads):
    bytes = 2 (K and V) x layers x kv_heads x head_dim x tokens x batch x bytes_per_element
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from models.attention import attend, positions_and_mask
from models.config import LanguageConfig
from models.errors import TinyVLMError

KVCache = dict  # {"key": Tensor, "value": Tensor, "layout": Layout}


class CacheCapacityError(TinyVLMError, IndexError):
    """A write past the end of a preallocated KV cache."""


class Layout:
    """What a block needs of its cache. `positions_and_mask` gives a call's rotary positions and attention
    mask (once per forward, for every block); `attend` writes the call's K/V and attends over the cache."""

    def span(self, cache: KVCache | None, start_pos: int | Tensor, num_new: int) -> int:
        """The cache slots a call writing `num_new` tokens at `start_pos` attends over."""
        return start_pos + num_new

    def positions_and_mask(self, cache: KVCache | None, attention_mask: Tensor | None,
                           start_pos: int | Tensor, batch: int, seq: int, device: torch.device,
                           flex: bool = False
                           ) -> tuple[Tensor, Tensor | BlockMask | None]:
        return positions_and_mask(attention_mask, start_pos, batch, seq, self.span(cache, start_pos, seq),
                                  device, flex)

    def write(self, cache: KVCache | None, key: Tensor, value: Tensor,
              start_pos: int | Tensor) -> tuple[KVCache, Tensor, Tensor]:
        """Store `key`/`value` [B, Hkv, T, D]; return the cache and the keys/values to attend over."""
        raise NotImplementedError

    def attend(self, q: Tensor, key: Tensor, value: Tensor, mask: Tensor | BlockMask | None,
               cache: KVCache | None, start_pos: int | Tensor) -> tuple[Tensor, KVCache]:
        """q [B, H, T, D] -> ([B, H, T, D], the cache), with this call's `key`/`value` written."""
        cache, keys, values = self.write(cache, key, value, start_pos)
        return attend(q, keys, values, mask, start_pos), cache


@dataclasses.dataclass(frozen=True)
class NoCache(Layout):
    """A plain pass: attention over the call's own tokens; returns a Growing cache of them."""

    def span(self, cache: KVCache | None, start_pos: int | Tensor, num_new: int) -> int:
        return num_new

    def write(self, cache: KVCache | None, key: Tensor, value: Tensor,
              start_pos: int | Tensor) -> tuple[KVCache, Tensor, Tensor]:
        return {"key": key, "value": value, "layout": Growing()}, key, value


@dataclasses.dataclass(frozen=True)
class Growing(Layout):
    """K/V of every token so far, concatenated call by call (nanoVLM's cache; what a call without a cache
    returns)."""

    def write(self, cache: KVCache | None, key: Tensor, value: Tensor,
              start_pos: int | Tensor) -> tuple[KVCache, Tensor, Tensor]:
        if start_pos != cache["key"].shape[2]:
            raise ValueError(f"a growing cache of {cache['key'].shape[2]} tokens continues at that position, "
                             f"not at start_pos {start_pos}")
        grown = {"key": torch.cat([cache["key"], key], 2), "value": torch.cat([cache["value"], value], 2),
                 "layout": self}
        return grown, grown["key"], grown["value"]


@dataclasses.dataclass(frozen=True)
class Preallocated(Layout):
    """A fixed capacity written in place at `start_pos`. shape_static: the position is a 0-dim device tensor
    and attention spans the whole capacity under a mask, so every decode step has one shape (compiled
    decoding)."""

    shape_static: bool = False

    def span(self, cache: KVCache | None, start_pos: int | Tensor, num_new: int) -> int:
        return cache["key"].shape[2] if self.shape_static else start_pos + num_new

    def write(self, cache: KVCache | None, key: Tensor, value: Tensor,
              start_pos: int | Tensor) -> tuple[KVCache, Tensor, Tensor]:
        if self.shape_static:
            if not isinstance(start_pos, Tensor):
                raise TypeError("a shape-static cache takes its position as a 0-dim device tensor")
            slots = torch.arange(key.shape[2], device=key.device) + start_pos
            # cast as slice assignment does (under autocast, bfloat16 K/V into a float32 cache)
            cache["key"].index_copy_(2, slots, key.to(cache["key"].dtype))
            cache["value"].index_copy_(2, slots, value.to(cache["value"].dtype))
            return cache, cache["key"], cache["value"]
        if isinstance(start_pos, Tensor):
            raise TypeError("a preallocated cache takes an int start_pos (Preallocated(shape_static=True) "
                            "takes tensors)")
        end, capacity = start_pos + key.shape[2], cache["key"].shape[2]
        if end > capacity:
            raise CacheCapacityError(f"writing KV slots {start_pos}..{end - 1} into a cache of {capacity} "
                                     "slots; allocate one that holds every token (allocate_kv_cache(batch, "
                                     "capacity))")
        cache["key"][:, :, start_pos:end] = key
        cache["value"][:, :, start_pos:end] = value
        return cache, cache["key"][:, :, :end], cache["value"][:, :, :end]


NO_CACHE = NoCache()


def allocate(batch: int, kv_heads: int, capacity: int, head_dim: int, dtype: torch.dtype,
             device: torch.device, shape_static: bool = False) -> KVCache:
    shape = (batch, kv_heads, capacity, head_dim)
    return {"key": torch.zeros(shape, dtype=dtype, device=device),
            "value": torch.zeros(shape, dtype=dtype, device=device), "layout": Preallocated(shape_static)}


def layout_of(cache: KVCache | None) -> Layout:
    return NO_CACHE if cache is None else cache["layout"]


def with_layout(caches: list[KVCache], layout: Layout) -> list[KVCache]:
    """The same K/V tensors under another layout (e.g. a prefilled cache switched to shape-static
    decoding)."""
    return [{**cache, "layout": layout} for cache in caches]


def tensors(cache: KVCache) -> dict[str, Tensor]:
    return {name: value for name, value in cache.items() if name != "layout"}


def repeat_rows(caches: list[KVCache], repeats: int) -> list[KVCache]:
    """Each batch row's cache copied `repeats` times (row b becomes rows b*repeats ..
    b*repeats + repeats - 1)."""
    return [{**{name: t.repeat_interleave(repeats, dim=0) for name, t in tensors(cache).items()},
             "layout": cache["layout"]} for cache in caches]


def kv_cache_bytes(config: LanguageConfig, batch: int, tokens: int,
                   dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes a KV cache holds: 2 x layers x kv_heads x head_dim x tokens x batch x bytes per element."""
    element = torch.tensor([], dtype=dtype).element_size()
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * tokens * batch * element
