"""Attention of a block's queries over its keys: rotary positions and masks for padded and packed rows,
causal SDPA, grouped-query attention under a mask, and FlexAttention for packed training. The KV-cache layouts
(models/kv_cache.py) call `attend` with the keys they hold.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention


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


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | BlockMask | None,
           start_pos: int | Tensor) -> Tensor:
    """q [B, H, T, D] (at slots start_pos ..) over k, v [B, Hkv, S, D] -> [B, H, T, D]: plain causal
    self-attention when there is no mask and the keys are the queries' own (the fastest kernels), a BlockMask
    through FlexAttention, else SDPA under `mask` (None: causal from start_pos)."""
    seq = q.shape[2]
    if mask is None and k.shape[2] == seq:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    if isinstance(mask, BlockMask):
        return flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
    if mask is None:
        mask = causal_mask(start_pos, seq, k.shape[2], q.device)
    return grouped_attention(q, k, v, mask)


def positions_and_mask(attention_mask: Tensor | None, start_pos: int | Tensor, batch: int, seq: int,
                       num_keys: int, device: torch.device, flex: bool = False
                       ) -> tuple[Tensor, Tensor | BlockMask | None]:
    """Rotary positions [B, T] and the attention mask [B, 1, T, S] of T tokens at slots start_pos .. over
    `num_keys` slots (None for plain causal attention; with `flex`, a call of T tokens from slot 0 with an
    attention mask takes FlexAttention's BlockMask).

    `attention_mask` [B, L]: 1 for real tokens, 0 for padding, or 1, 2, ... for the sequences packed in a row.
    A token's position is the number of real tokens before it in its own sequence; a token sees the earlier
    tokens of its sequence, and a pad sees only itself, so that no softmax row is empty."""
    slots = torch.arange(seq, device=device) + start_pos
    if attention_mask is None:
        if num_keys == seq:
            return slots.expand(batch, seq), None
        return slots.expand(batch, seq), causal_mask(start_pos, seq, num_keys, device)[None, None]
    sequence = attention_mask[:, :num_keys].long()
    real = sequence > 0
    # Real tokens of the earlier sequences of the row, for each sequence number (never above num_keys): no
    # host sync.
    per_sequence = torch.zeros(batch, num_keys + 1, dtype=torch.long,
                               device=device).scatter_add_(1, sequence, real.long())
    earlier = (per_sequence.cumsum(-1) - per_sequence).gather(1, sequence)
    positions = (real.long().cumsum(-1) - 1 - earlier).clamp(min=0).gather(1, slots.expand(batch, seq))
    if flex:
        return positions, sequence_block_mask(sequence)
    query_sequence = sequence.gather(1, slots.expand(batch, seq))
    same_sequence = (query_sequence[:, :, None] == sequence[:, None, :]) & real[:, None, :]
    own_slot = torch.arange(num_keys, device=device) == slots[:, None]
    mask = causal_mask(start_pos, seq, num_keys, device) & (same_sequence | own_slot)
    return positions, mask[:, None]
