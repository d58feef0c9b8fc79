"""The per-block KV cache: a dict {"key", "value", "layout"}; the layout entry says how K/V are stored and
read.

| layout                          | "key" / "value"         | a call writes          | attention spans      |
|---------------------------------|-------------------------|------------------------|----------------------|
| no cache (None)                 | -                       | none; returns Growing  | the call's tokens    |
| Growing (nanoVLM's)             | [B, Hkv, so far, D]     | appends (torch.cat)    | every token so far   |
| Preallocated()                  | [B, Hkv, capacity, D]   | slots start_pos .. + T | slots 0 .. start + T |
| Preallocated(shape_static=True) | [B, Hkv, capacity, D]   | the same, index_copy_  | all slots, masked    |
| Paged                           | [blocks, block, Hkv, D] | slot_mapping's slots   | its blocks           |

`start_pos` is an int for Growing and Preallocated, a 0-dim device tensor for the shape-static mode (so every
step of a compiled decode has one shape), and unused by Paged, whose layout carries every token's position. A
preallocated cache never grows: writing past its capacity raises `CacheCapacityError` (int positions; a tensor
position is the caller's to check once, before decoding, since reading a device tensor would stall the step).

Paged (PagedAttention, Kwon et al. 2023; built and managed by serving/): the tokens of many sequences run as
one row, [1, N], packed without padding; the pool is shared by every sequence, and the layout says where each
sequence's tokens live (its block table), where each new token goes (`slot_mapping`), and which queries belong
to which sequence (`query_start`, as flash attention's cu_seqlens) at which positions. Attention reads the
pool through the block tables (models/attention.py): gathered + SDPA (exact, the reference, and a CPU's
prompt chunks; an optional GatherPlan runs a decode call's rows in groups of their own widths, into one reused
buffer), in place with a Triton kernel (GPUs), or, for a CPU's decode calls, in place with sparse-matrix
kernels ("sparse": a SparseIndex of each query's pool rows).

Memory (the formula from the KV-cache articles, with grouped-query attention's fewer kv heads):
    bytes = 2 (K and V) x layers x kv_heads x head_dim x tokens x batch x bytes_per_element
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from models.config import LanguageConfig
from models.errors import TinyVLMError

KVCache = dict  # {"key": Tensor, "value": Tensor, "layout": Growing | Preallocated | Paged}
PAGED_ATTENTION = ("gather", "triton", "sparse")


class CacheCapacityError(TinyVLMError, IndexError):
    """A write past the end of a preallocated KV cache."""


@dataclasses.dataclass(frozen=True)
class Growing:
    """K/V of every token so far, concatenated call by call (what a call without a cache returns)."""


@dataclasses.dataclass(frozen=True)
class Preallocated:
    """A fixed capacity written in place at `start_pos`. shape_static: the position is a 0-dim device tensor
    and attention spans the whole capacity under a mask, so every decode step has one shape (compiled
    decoding)."""

    shape_static: bool = False


@dataclasses.dataclass(frozen=True, eq=False)
class GatherPlan:
    """How the gathered path runs a call, known on the host (eager calls only; inference only, since every
    layer overwrites `space`). The rows of a decode call (one query each) run in groups [previous end, end),
    each gathering the first `width` blocks of its rows' tables: every row's context must fit in its group's
    width (the caller sorts rows by table length so that little is padding). A prefill call gathers all its
    tables at once. Every layer gathers into `space` (on a CPU a fresh buffer a layer page-faults on every
    element)."""

    group_ends: tuple[int, ...]  # the last group ends at S
    group_widths: tuple[int, ...]  # blocks gathered for each group's rows
    space: Tensor  # flat, the pools' dtype: room for the keys and values of the largest group
    # what every layer of the call reads to attend (each group's block indices and mask): the first layer's
    groups: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True, eq=False)
class SparseIndex:
    """A decode call's attention pattern as a CSR matrix over the pool's rows (one per slot and kv head): row
    s * H + h holds, in order, the pool rows slot * kv_heads + h // (H / kv_heads) of sequence s's context.
    Made once a call (models/attention.py `sparse_index`), read by every layer."""

    pattern: Tensor  # sparse CSR [S * H, pool slots * kv_heads], its values zeros
    dense: Tensor  # [entries] int64: each entry's place in the rows laid out dense, [S * H, slots]
    slots: int  # that layout's width: the block table's slots


@dataclasses.dataclass(frozen=True, eq=False)
class Paged:
    """Where the tokens of a packed call live in a shared block pool (see the module docstring). Sequences
    s = 0 .. S-1 own queries query_start[s] .. query_start[s + 1] - 1 of the call, the last ones of their
    first context_lens[s] tokens. `max_query_len` (host-known) sizes the reference path; `attention` picks the
    kernel."""

    block_table: Tensor  # [S, max blocks] int: each sequence's blocks in order, padded with the null block 0
    # [N] int64: the pool slot (block * block_size + offset) each new token is written to
    slot_mapping: Tensor
    positions: Tensor  # [N] int64: each token's position in its own sequence
    query_start: Tensor  # [S + 1] int: cumulative query counts
    context_lens: Tensor  # [S] int: each sequence's tokens in the cache once this call has written
    max_query_len: int
    attention: str = "gather"
    gather: GatherPlan | None = None  # the gathered path's groups and buffer (None: one fresh gather)
    sparse: SparseIndex | None = None  # the sparse path's index of a decode call (None: made by each layer)

    def __post_init__(self) -> None:
        if self.attention not in PAGED_ATTENTION:
            raise ValueError(f"paged attention must be one of {PAGED_ATTENTION}, got {self.attention!r}")


Layout = Growing | Preallocated | Paged


def allocate(batch: int, kv_heads: int, capacity: int, head_dim: int, dtype: torch.dtype,
             device: torch.device, shape_static: bool = False) -> KVCache:
    shape = (batch, kv_heads, capacity, head_dim)
    return {"key": torch.zeros(shape, dtype=dtype, device=device),
            "value": torch.zeros(shape, dtype=dtype, device=device), "layout": Preallocated(shape_static)}


def layout_of(cache: KVCache | None) -> Layout | None:
    return None if cache is None else cache["layout"]


def with_layout(caches: list[KVCache], layout: Layout) -> list[KVCache]:
    """The same K/V tensors under another layout (e.g. a prefilled cache switched to shape-static
    decoding)."""
    return [{**cache, "layout": layout} for cache in caches]


def tensors(cache: KVCache) -> dict[str, Tensor]:
    return {name: value for name, value in cache.items() if name != "layout"}


def capacity(cache: KVCache) -> int:
    return cache["key"].shape[2]


def attended_slots(cache: KVCache | None, start_pos: int | Tensor, num_new: int) -> int:
    """How many cache slots the attention of a call writing `num_new` tokens at `start_pos` spans (Growing and
    Preallocated; Paged attention reads its own extent from the layout)."""
    layout = layout_of(cache)
    if layout is None:
        return num_new
    if isinstance(layout, Preallocated) and layout.shape_static:
        return capacity(cache)
    return start_pos + num_new


def write(cache: KVCache | None, key: Tensor, value: Tensor,
          start_pos: int | Tensor) -> tuple[KVCache, Tensor, Tensor]:
    """Store `key`/`value` [B, H, T, D] as the table above says; return the cache and the keys/values to
    attend over (the pools themselves for a paged cache)."""
    layout = layout_of(cache)
    if layout is None:
        return {"key": key, "value": value, "layout": Growing()}, key, value
    if isinstance(layout, Paged):
        _write_paged(cache, layout, key, value)
        return cache, cache["key"], cache["value"]
    if isinstance(layout, Growing):
        if start_pos != cache["key"].shape[2]:
            raise ValueError(f"a growing cache of {cache['key'].shape[2]} tokens continues at that position, "
                             f"not at start_pos {start_pos}")
        grown = {"key": torch.cat([cache["key"], key], 2), "value": torch.cat([cache["value"], value], 2),
                 "layout": layout}
        return grown, grown["key"], grown["value"]
    if layout.shape_static:
        if not isinstance(start_pos, Tensor):
            raise TypeError("a shape-static cache takes its position as a 0-dim device tensor")
        slots = torch.arange(key.shape[2], device=key.device) + start_pos
        # Cast as slice assignment does: under autocast the projections give bfloat16 K/V for a float32 cache.
        cache["key"].index_copy_(2, slots, key.to(cache["key"].dtype))
        cache["value"].index_copy_(2, slots, value.to(cache["value"].dtype))
        return cache, cache["key"], cache["value"]
    if isinstance(start_pos, Tensor):
        raise TypeError("a preallocated cache takes an int start_pos (Preallocated(shape_static=True) takes "
                        "tensors)")
    end = start_pos + key.shape[2]
    if end > capacity(cache):
        raise CacheCapacityError(f"writing KV slots {start_pos}..{end - 1} into a cache of {capacity(cache)} "
                                 "slots; allocate one that holds every token (allocate_kv_cache(batch, "
                                 "capacity))")
    cache["key"][:, :, start_pos:end] = key
    cache["value"][:, :, start_pos:end] = value
    return cache, cache["key"][:, :, :end], cache["value"][:, :, :end]


def _write_paged(cache: KVCache, layout: Paged, key: Tensor, value: Tensor) -> None:
    """Scatter the call's K/V [1, Hkv, N, D] into the pool at `slot_mapping` (padded tokens write the null
    block)."""
    for pool, new in ((cache["key"], key), (cache["value"], value)):
        num_blocks, size, heads, dim = pool.shape
        flat = pool.view(num_blocks * size, heads, dim)
        flat.index_copy_(0, layout.slot_mapping, new[0].transpose(0, 1).to(pool.dtype))


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
