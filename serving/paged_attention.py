"""Paged attention kernels: the packed queries of a paged call (serving/paged_layout.py) against the shared
pool of K/V blocks, [N, H, D] -> [N, H, D], through each sequence's block table.

Three implementations of one contract: `gathered_paged_attention` (each sequence's blocks gathered, then SDPA:
exact, any block size, the reference, and a CPU's prompt chunks), a Triton kernel that reads the pool in place
(serving/paged_attention_triton.py: GPUs, and tests through Triton's interpreter), and
`sparse_paged_attention` (a CPU's decode calls: the pool read in place by sparse-matrix kernels).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from models.attention import grouped_attention

if TYPE_CHECKING:
    from serving.paged_layout import Paged


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
    Made once a call (`sparse_index`), read by every layer."""

    pattern: Tensor  # sparse CSR [S * H, pool slots * kv_heads], its values zeros
    dense: Tensor  # [entries] int64: each entry's place in the rows laid out dense, [S * H, slots]
    slots: int  # that layout's width: the block table's slots


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
def sparse_paged_attention(q: Tensor, key_pool: Tensor, value_pool: Tensor, layout: Paged,
                           index: SparseIndex | None = None) -> Tensor:
    """q [S, H, D], one query a sequence (a decode call), against the pool -> [S, H, D]: sampled_addmm scores
    each query against its pool rows (its sequence's keys of its kv head), a softmax runs over each query's
    entries (laid out dense for it, -inf where a row has none), and embedding_bag sums the same rows' values
    weighted by the probabilities. A CPU's (the two sparse kernels take float32 or float64; without the
    call's `index` one is made, reading its size back)."""
    num_seqs, heads, dim = q.shape
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


def gathered_paged_attention(q: Tensor, key_pool: Tensor, value_pool: Tensor, layout: Paged,
                             plan: GatherPlan | None = None) -> Tensor:
    """The reference: each sequence's blocks gathered ([S, Hkv, blocks * block_size, D]), its queries padded
    to `max_query_len`, SDPA under a causal mask at the queries' positions, the padding dropped again. No host
    sync: every shape comes from the layout's tensors and its host-known `max_query_len` and gather plan (a
    decode call's row groups each gather only their own longest table; a plan's call prepares its groups'
    indices and masks at its first layer, for every layer)."""
    if plan is None:
        groups, space = _groups(layout, None, key_pool.shape[1], q.shape[0]), None
    else:
        if not plan.groups:  # the call's first layer
            plan.groups.extend(_groups(layout, plan, key_pool.shape[1], q.shape[0]))
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


def _groups(layout: Paged, plan: GatherPlan | None, block_size: int, num_tokens: int) -> list[_Group]:
    """The groups of a call of `num_tokens` queries (no host sync: sizes come from the host-known plan,
    tables' widths and `max_query_len`)."""
    table, lens = layout.block_table, layout.context_lens.long()
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
