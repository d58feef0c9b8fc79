"""Attention over every KV-cache layout: causal masks, grouped-query attention under a mask, and paged
attention.

The language model's blocks call these (models/language_model.py); the layouts are in models/kv_cache.py.
Paged attention has two implementations of one contract: `gathered_paged_attention` (each sequence's blocks
gathered, then SDPA: exact, any block size, the reference and the CPU path) and a Triton kernel that reads the
pool in place (models/paged_attention_triton.py: GPUs, and tests through Triton's interpreter).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from models.kv_cache import KVCache, Paged


def causal_mask(start_pos: int | Tensor, num_queries: int, num_keys: int, device: torch.device) -> Tensor:
    """[num_queries, num_keys] bool: the query at slot start_pos + i sees the keys in slots 0 .. start_pos + i
    ([B, num_queries, num_keys] for a start_pos of shape [B, 1]: one per row)."""
    query_slots = torch.arange(num_queries, device=device) + start_pos
    return torch.arange(num_keys, device=device) <= query_slots[..., None]


# Grouped-query attention (Ainslie et al. 2023) through PyTorch's scaled_dot_product_attention.
def grouped_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """q [B, H, T, D] against k, v [B, Hkv, S, D] under a boolean mask [B or 1, 1, T, S], each kv head serving
    its query heads without repeating K/V: the query heads of a group are folded into the sequence axis."""
    batch, heads, seq, dim = q.shape
    kv_heads = k.shape[1]
    groups = heads // kv_heads
    q = q.reshape(batch, kv_heads, groups * seq, dim)
    mask = mask.expand(batch, 1, seq, k.shape[2]).unsqueeze(2).expand(-1, -1, groups, -1, -1).flatten(2, 3)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).reshape(batch, heads, seq, dim)


# PagedAttention (Kwon et al., SOSP 2023): each sequence's K/V read through its block table.
def paged_attention(q: Tensor, cache: KVCache) -> Tensor:
    """q [N, H, D], the packed queries of a paged call, against the pool -> [N, H, D]."""
    layout: Paged = cache["layout"]
    if layout.attention == "triton":
        from models.paged_attention_triton import triton_paged_attention

        return triton_paged_attention(q, cache["key"], cache["value"], layout)
    return gathered_paged_attention(q, cache["key"], cache["value"], layout)


def gathered_paged_attention(q: Tensor, key_pool: Tensor, value_pool: Tensor, layout: Paged) -> Tensor:
    """The reference: each sequence's blocks gathered ([S, Hkv, blocks * block_size, D]), its queries padded
    to `max_query_len`, SDPA under a causal mask at the queries' positions, the padding dropped again. No host
    sync: every shape comes from the layout's tensors and its host-known `max_query_len`."""
    num_tokens, heads, dim = q.shape
    num_seqs, width = layout.block_table.shape
    # index_select copies whole blocks (4x faster than pool[table] on a CPU)
    blocks = layout.block_table.flatten()
    keys, values = (pool.index_select(0, blocks).view(num_seqs, width * pool.shape[1], *pool.shape[2:])
                    .transpose(1, 2).to(q.dtype) for pool in (key_pool, value_pool))
    starts = layout.query_start.long()
    query_lens, context_lens = starts[1:] - starts[:-1], layout.context_lens.long()
    width = layout.max_query_len
    offsets = torch.arange(width, device=q.device)
    query_positions = (context_lens - query_lens)[:, None] + offsets  # [S, width]
    mask = torch.arange(keys.shape[2], device=q.device) <= query_positions[..., None]  # [S, width, slots]
    if width == 1:  # a decode step: one query per sequence
        return grouped_attention(q[:, :, None], keys, values, mask[:, None])[:, :, 0]
    padded = q[(starts[:-1, None] + offsets).clamp(max=num_tokens - 1)].transpose(1, 2)  # [S, H, width, D]
    out = grouped_attention(padded, keys, values, mask[:, None]).transpose(1, 2)  # [S, width, H, D]
    tokens = torch.arange(num_tokens, device=q.device)
    sequence = torch.searchsorted(starts[1:], tokens, right=True)
    return out[sequence, tokens - starts[sequence]]
