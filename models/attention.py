"""Attention over every KV-cache layout: causal masks, grouped-query attention under a mask, and paged
attention.

The language model's blocks call these (models/language_model.py); the layouts are in models/kv_cache.py.
Paged attention has three implementations of one contract: `gathered_paged_attention` (each sequence's blocks
gathered, then SDPA: exact, any block size, the reference, and a CPU's prompt chunks), a Triton kernel that
reads the pool in place (models/paged_attention_triton.py: GPUs, and tests through Triton's interpreter), and
`sparse_paged_attention` (a CPU's decode calls: the pool read in place by sparse-matrix kernels).
"""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from models.kv_cache import KVCache, Paged, SparseIndex


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


# FlexAttention (Dong et al. 2024): packed or padded rows' attention as tiles, the fully masked ones skipped.
def sequence_block_mask(sequence: Tensor) -> BlockMask:
    """The mask of rows [B, T] of sequence numbers (1, 2, ... for a packed row's samples, 0 for padding) as
    a BlockMask: a token sees the earlier tokens of its own sequence, and a pad only itself (the rule of
    LanguageModel's dense mask)."""

    def mask_mod(b: Tensor, h: Tensor, query: Tensor, key: Tensor) -> Tensor:
        same = (sequence[b, query] == sequence[b, key]) & (sequence[b, key] > 0)
        return (key <= query) & (same | (key == query))

    batch, length = sequence.shape
    return create_block_mask(mask_mod, batch, None, length, length, device=sequence.device)


# PagedAttention (Kwon et al., SOSP 2023): each sequence's K/V read through its block table.
def paged_attention(q: Tensor, cache: KVCache) -> Tensor:
    """q [N, H, D], the packed queries of a paged call, against the pool -> [N, H, D]."""
    layout: Paged = cache["layout"]
    if layout.attention == "triton":
        from models.paged_attention_triton import triton_paged_attention

        return triton_paged_attention(q, cache["key"], cache["value"], layout)
    if layout.attention == "sparse" and layout.max_query_len == 1:
        return sparse_paged_attention(q, cache["key"], cache["value"], layout)
    return gathered_paged_attention(q, cache["key"], cache["value"], layout)


def sparse_index(block_table: Tensor, context_lens: Tensor, total: int, heads: int, pool_shape: torch.Size,
                 dtype: torch.dtype) -> SparseIndex:
    """The pool rows each query of a decode call reads (see SparseIndex), for `heads` query heads and a pool
    of `pool_shape` [blocks, block_size, kv_heads, D] and `dtype`; `total` is the host-known sum of
    `context_lens` (so no size is read back). Made once a call."""
    num_blocks, block_size, kv_heads, _ = pool_shape
    device = block_table.device
    counts = context_lens.long()[:, None].expand(-1, heads).reshape(-1)  # [S * H], row s * H + h
    crow = torch.zeros(len(counts) + 1, dtype=torch.long, device=device)  # each row's first entry
    torch.cumsum(counts, 0, out=crow[1:])
    entry = torch.arange(heads * total, device=device)
    row = torch.searchsorted(crow[1:], entry, right=True)  # each entry's row
    place = entry - crow[row]  # its slot in its sequence
    slots = block_table.shape[1] * block_size
    blocks = block_table.long()[row // heads, place // block_size]
    columns = (blocks * block_size + place % block_size) * kv_heads + row % heads // (heads // kv_heads)
    with warnings.catch_warnings():  # "Sparse CSR tensor support is in beta state": we use two of its kernels
        warnings.filterwarnings("ignore", "Sparse CSR tensor support", UserWarning)
        # sampled_addmm multiplies these values by beta = 0, and NaN * 0 is NaN: zeros, never torch.empty
        values = torch.zeros(len(columns), dtype=dtype, device=device)
        shape = (len(counts), num_blocks * block_size * kv_heads)
        pattern = torch.sparse_csr_tensor(crow, columns, values, shape, check_invariants=False)
    return SparseIndex(pattern, row * slots + place, slots)


# Sampled dense-dense products and bags of weighted rows (the sparse kernels of recommender models) as paged
# decode attention: the scores and the weighted sum of values read the pool where it is, without a gather.
def sparse_paged_attention(q: Tensor, key_pool: Tensor, value_pool: Tensor, layout: Paged) -> Tensor:
    """q [S, H, D], one query a sequence (a decode call), against the pool -> [S, H, D]: sampled_addmm scores
    each query against its pool rows (its sequence's keys of its kv head), a softmax runs over each query's
    entries (laid out dense for it, -inf where a row has none), and embedding_bag sums the same rows' values
    weighted by the probabilities. A CPU's (the two sparse kernels take float32 or float64; a layout without
    an index reads its size back)."""
    num_seqs, heads, dim = q.shape
    index = layout.sparse
    if index is None:
        index = sparse_index(layout.block_table, layout.context_lens, int(layout.context_lens.sum()), heads,
                             key_pool.shape, q.dtype)
    pool_rows = index.pattern.shape[1]
    scores = torch.sparse.sampled_addmm(index.pattern, q.reshape(num_seqs * heads, dim),
                                        key_pool.view(pool_rows, dim).t(), beta=0.0, alpha=dim**-0.5).values()
    # one softmax over dense rows: ~2x faster than segment_reduce's max and sum over the ragged ones
    dense = scores.new_full((num_seqs * heads, index.slots), float("-inf"))
    dense.view(-1).index_copy_(0, index.dense, scores)
    weights = dense.softmax(-1).view(-1).index_select(0, index.dense)
    out = F.embedding_bag(index.pattern.col_indices(), value_pool.view(pool_rows, dim),
                          index.pattern.crow_indices()[:-1], mode="sum", per_sample_weights=weights)
    return out.view(num_seqs, heads, dim)


def gathered_paged_attention(q: Tensor, key_pool: Tensor, value_pool: Tensor, layout: Paged) -> Tensor:
    """The reference: each sequence's blocks gathered ([S, Hkv, blocks * block_size, D]), its queries padded
    to `max_query_len`, SDPA under a causal mask at the queries' positions, the padding dropped again. No host
    sync: every shape comes from the layout's tensors and its host-known `max_query_len` and gather plan (a
    decode call's row groups each gather only their own longest table; a plan's call prepares its groups'
    indices and masks at its first layer, for every layer)."""
    plan = layout.gather
    if plan is None:
        groups, space = _groups(layout, key_pool.shape[1], q.shape[0]), None
    else:
        if not plan.groups:  # the call's first layer
            plan.groups.extend(_groups(layout, key_pool.shape[1], q.shape[0]))
        groups, space = plan.groups, plan.space
    parts = [_attend(q, key_pool, value_pool, group, space) for group in groups]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


class _Group(NamedTuple):
    """What each layer needs to attend for a group of a call's sequences (all of them, or a decode call's
    rows start .. end - 1 of its plan)."""

    rows: slice  # its sequences (in a decode call, its queries too): a plan's rows, or all
    blocks: Tensor  # [sequences * width] the blocks to gather, sequence by sequence
    mask: Tensor  # [sequences, 1, queries, slots] bool: what each (padded) query sees
    padded: Tensor | None  # several queries a sequence: [sequences, max_query_len] each padded query's token
    unpadded: tuple[Tensor, Tensor] | None  # and each token's (sequence, place) among the padded ones


def _groups(layout: Paged, block_size: int, num_tokens: int) -> list[_Group]:
    """The groups of a call of `num_tokens` queries (no host sync: sizes come from the host-known plan,
    tables' widths and `max_query_len`)."""
    plan, table, lens = layout.gather, layout.block_table, layout.context_lens.long()
    device = table.device
    if layout.max_query_len == 1:  # decode: one query per sequence, the last of its context
        if plan is None:
            spans = [(slice(None), table.shape[1])]
        else:
            spans = [(slice(start, end), width) for start, end, width
                     in zip((0, *plan.group_ends[:-1]), plan.group_ends, plan.group_widths)]
        groups = []
        for rows, width in spans:
            mask = torch.arange(width * block_size, device=device) <= (lens[rows] - 1)[:, None]
            groups.append(_Group(rows, table[rows, :width].flatten(), mask[:, None, None], None, None))
        return groups
    starts = layout.query_start.long()
    offsets = torch.arange(layout.max_query_len, device=device)
    query_positions = (lens - (starts[1:] - starts[:-1]))[:, None] + offsets  # [S, width]
    slots = torch.arange(table.shape[1] * block_size, device=device)
    mask = (slots <= query_positions[..., None])[:, None]  # [S, 1, width, slots]
    padded = (starts[:-1, None] + offsets).clamp(max=num_tokens - 1)
    tokens = torch.arange(num_tokens, device=device)
    sequence = torch.searchsorted(starts[1:], tokens, right=True)
    return [_Group(slice(None), table.flatten(), mask, padded, (sequence, tokens - starts[sequence]))]


def _attend(q: Tensor, key_pool: Tensor, value_pool: Tensor, group: _Group, space: Tensor | None) -> Tensor:
    """The attention of a group's queries: [its queries, H, D]."""
    keys, values = (gathered.to(q.dtype) for gathered in _gather(key_pool, value_pool, group.blocks,
                                                                   len(group.mask), space))
    if group.padded is None:
        return grouped_attention(q[group.rows, :, None], keys, values, group.mask)[:, :, 0]
    out = grouped_attention(q[group.padded].transpose(1, 2), keys, values, group.mask)  # [S, H, width, D]
    return out.transpose(1, 2)[group.unpadded]


def _gather(key_pool: Tensor, value_pool: Tensor, blocks: Tensor, num_seqs: int, space: Tensor | None
            ) -> list[Tensor]:
    """The blocks of `num_seqs` sequences (`blocks` flat, sequence by sequence) as keys and values
    [S, Hkv, blocks * block_size, D], written into `space` when given (the keys, then the values).
    index_select copies whole blocks (4x faster than pool[table] on a CPU)."""
    gathered = []
    for i, pool in enumerate((key_pool, value_pool)):
        if space is None:
            rows = pool.index_select(0, blocks)
        else:
            size = blocks.numel() * math.prod(pool.shape[1:])
            out = space[i * size : (i + 1) * size].view(blocks.numel(), *pool.shape[1:])
            rows = torch.index_select(pool, 0, blocks, out=out)
        gathered.append(rows.view(num_seqs, -1, *pool.shape[2:]).transpose(1, 2))
    return gathered
