"""Paged attention in one Triton kernel that reads the KV pool in place through the block tables (no gather).

After vLLM's Triton "unified attention", with FlashAttention's online softmax: one program per (sequence, tile
of BLOCK_Q queries, kv head) holds the tile's queries of every query head of that kv head's group as the rows
of one matrix ([BLOCK_Q x group] x head_dim: grouped-query attention reads each K/V block once for the whole
group), walks the sequence's keys BLOCK_N at a time (each key's block looked up in the table), and keeps a
running max and sum. Decode steps (one query per sequence) run with BLOCK_Q = 1 and a fixed grid, so the
launch fits in a CUDA graph; padded sequences (context length 1, the null block) cost one block each.

With TRITON_INTERPRET=1 set before triton is imported (tests/conftest.py does so on machines without CUDA) it
runs on CPU tensors in Triton's interpreter (numpy): slow, and meant for tests of this kernel against the
gathered reference (serving/paged_attention.py), which stays the CPU path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl
from torch import Tensor

if TYPE_CHECKING:
    from serving.paged_layout import Paged


@triton.jit(do_not_specialize=["stride_qh", "stride_oh", "stride_table"])  # they vary with the call's shape
def _kernel(q_ptr, k_ptr, v_ptr, out_ptr, table_ptr, query_start_ptr, context_lens_ptr, scale,
            stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_ot,
            stride_oh, stride_table, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_Q: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
            PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_begin = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_begin
    q0 = tile * BLOCK_Q
    if q0 < q_len:
        context = tl.load(context_lens_ptr + seq)
        rows = tl.arange(0, BLOCK_Q * BLOCK_G)
        query, group = q0 + rows // BLOCK_G, rows % BLOCK_G
        row_valid = (query < q_len) & (group < GROUP)
        dims = tl.arange(0, BLOCK_D)
        dim_valid = dims < HEAD_DIM
        head = kv_head * GROUP + group
        q = tl.load(
            q_ptr + (q_begin + query)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
            mask=row_valid[:, None] & dim_valid[None, :],
            other=0.0,
        )
        position = context - q_len + query  # each row's query position in its sequence
        last = context - q_len + tl.minimum(q0 + BLOCK_Q, q_len) - 1  # the tile's last query position
        running_max = tl.full([BLOCK_Q * BLOCK_G], float("-inf"), tl.float32)
        running_sum = tl.zeros([BLOCK_Q * BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_Q * BLOCK_G, BLOCK_D], tl.float32)
        for start in range(0, last + 1, BLOCK_N):
            keys = start + tl.arange(0, BLOCK_N)
            key_valid = keys <= last
            block = tl.load(table_ptr + seq * stride_table + keys // BLOCK_SIZE, mask=key_valid, other=0)
            offset = keys % BLOCK_SIZE
            load_mask = key_valid[:, None] & dim_valid[None, :]
            k = tl.load(k_ptr + block[:, None] * stride_kb + offset[:, None] * stride_ks + kv_head * stride_kh
                        + dims[None, :], mask=load_mask, other=0.0)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            scores = tl.where(keys[None, :] <= position[:, None], scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, 1))
            weights = tl.exp(scores - new_max[:, None])
            correction = tl.exp(running_max - new_max)
            v = tl.load(v_ptr + block[:, None] * stride_vb + offset[:, None] * stride_vs + kv_head * stride_vh
                        + dims[None, :], mask=load_mask, other=0.0)
            acc = acc * correction[:, None] + tl.dot(weights.to(v.dtype), v, input_precision=PRECISION)
            running_sum = running_sum * correction + tl.sum(weights, 1)
            running_max = new_max
        out = acc / running_sum[:, None]
        tl.store(out_ptr + (q_begin + query)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])


def triton_paged_attention(q: Tensor, key_pool: Tensor, value_pool: Tensor, layout: Paged) -> Tensor:
    """q [N, H, D] -> [N, H, D]; the contract of serving.paged_attention.gathered_paged_attention."""
    num_tokens, heads, dim = q.shape
    _, block_size, kv_heads, _ = key_pool.shape
    group = heads // kv_heads
    block_q = 1 if layout.max_query_len == 1 else max(1, 64 // triton.next_power_of_2(group))
    block_g = triton.next_power_of_2(group) if block_q > 1 else max(16, triton.next_power_of_2(group))
    dtype = q.dtype
    q = q.to(key_pool.dtype)  # (under autocast the projections may differ from the pool; never copy the pool)
    out = torch.empty_like(q)
    num_seqs = layout.context_lens.shape[0]
    grid = (num_seqs, triton.cdiv(layout.max_query_len, block_q), kv_heads)
    _kernel[grid](
        q, key_pool, value_pool, out, layout.block_table, layout.query_start, layout.context_lens, dim**-0.5,
        q.stride(0), q.stride(1), key_pool.stride(0), key_pool.stride(1), key_pool.stride(2),
        value_pool.stride(0), value_pool.stride(1), value_pool.stride(2), out.stride(0), out.stride(1),
        layout.block_table.stride(0), GROUP=group, BLOCK_G=block_g, BLOCK_Q=block_q, BLOCK_N=64,
        BLOCK_SIZE=block_size, HEAD_DIM=dim, BLOCK_D=max(16, triton.next_power_of_2(dim)),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
    return out.to(dtype)
