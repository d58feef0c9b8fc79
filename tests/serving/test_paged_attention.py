"""Paged attention, every implementation (the gathered reference, the sparse CPU path, and the Triton kernel,
which runs in Triton's interpreter on a CPU), against attention computed in float64 from each sequence's keys
in order."""

import pytest
import torch

from serving.paged_attention import GatherPlan, gathered_paged_attention, sparse_index
from serving.paged_layout import PAGED_LAYOUTS, Gathered, Sparse
from tests.models.helpers import TRITON_ON_CPU


def _float64_attention(q, key_pool, value_pool, tables, query_lens, context_lens):
    """Each query of each sequence, one at a time: softmax(q k^T / sqrt(d)) v over its keys at
    positions <= its own."""
    heads, kv_heads, dim = q.shape[1], key_pool.shape[2], q.shape[2]
    out, token = [], 0
    for table, query_len, context in zip(tables, query_lens, context_lens):
        keys = key_pool[table].flatten(0, 1).double().repeat_interleave(heads // kv_heads, 1)  # [slots, H, D]
        values = value_pool[table].flatten(0, 1).double().repeat_interleave(heads // kv_heads, 1)
        for i in range(query_len):
            position = context - query_len + i
            scores = torch.einsum("hd,shd->hs", q[token].double(), keys[: position + 1]) / dim**0.5
            out.append(torch.einsum("hs,shd->hd", scores.softmax(-1), values[: position + 1]))
            token += 1
    return torch.stack(out)


@pytest.mark.parametrize("attention", ["gather", "sparse", pytest.param("triton", marks=TRITON_ON_CPU)])
@pytest.mark.parametrize("heads, kv_heads, dim, block_size", [(6, 2, 16, 4), (9, 3, 24, 16), (4, 4, 8, 8)])
@pytest.mark.parametrize("query_lens, context_lens", [
    ([1, 1, 1, 1], [1, 7, 70, 16]),  # decode steps: one query each, contexts across block and tile edges
    ([5, 3, 1, 20], [13, 3, 9, 90]),  # prompt chunks after cached prefixes, a whole prompt, one decode
], ids=["decode", "chunks"])
def test_paged_attention_equals_float64(attention, heads, kv_heads, dim, block_size, query_lens,
                                        context_lens):
    generator = torch.Generator().manual_seed(0)
    width = max(-(-c // block_size) for c in context_lens)
    num_blocks = len(context_lens) * width + 1
    key_pool = torch.randn(num_blocks, block_size, kv_heads, dim, generator=generator)
    value_pool = torch.randn(num_blocks, block_size, kv_heads, dim, generator=generator)
    order = torch.randperm(num_blocks - 1, generator=generator) + 1  # scattered blocks, never the null block
    tables = [
        order[i * width : (i + 1) * width][: -(-c // block_size)].tolist() for i, c in enumerate(context_lens)
    ]
    block_table = torch.zeros(len(tables), width, dtype=torch.long)
    for row, table in enumerate(tables):
        block_table[row, : len(table)] = torch.tensor(table)
    num_tokens = sum(query_lens)
    # [N, H, D], as the blocks give it
    q = torch.randn(heads, num_tokens, dim, generator=generator).transpose(0, 1)
    positions = torch.cat([torch.arange(c - n, c) for n, c in zip(query_lens, context_lens)])
    layout = PAGED_LAYOUTS[attention](block_table, torch.zeros(num_tokens, dtype=torch.long), positions,
                                      torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()]),
                                      torch.tensor(context_lens), max(query_lens))
    out = layout.kernel(q, key_pool, value_pool)
    expected = _float64_attention(q, key_pool, value_pool, tables, query_lens, context_lens)
    torch.testing.assert_close(out.double(), expected, atol=2e-6, rtol=0)
    if attention == "triton":  # and the two implementations agree with each other
        reference = gathered_paged_attention(q, key_pool, value_pool, layout)
        torch.testing.assert_close(out, reference, atol=2e-6, rtol=0)


@pytest.mark.parametrize("query_lens, context_lens, ends", [
    ([1] * 6, [3, 5, 9, 17, 40, 70], (2, 4, 6)),  # a decode call, sorted by length, in three groups
    ([5, 3, 1, 20], [13, 3, 9, 90], (4,)),  # a prefill call: one group
], ids=["decode-groups", "prefill"])
def test_a_gather_plan_gives_the_attention_of_one_gather(query_lens, context_lens, ends):
    """Groups of rows gathering only their own longest tables, every call into one reused buffer (left
    holding another call's values), give what one gather of every row's whole table gives, and float64's, at
    every layer of the call."""
    heads, kv_heads, dim, block_size = 6, 2, 16, 4
    generator = torch.Generator().manual_seed(1)
    blocks = [-(-c // block_size) for c in context_lens]
    width = max(blocks)
    key_pool = torch.randn(sum(blocks) + 1, block_size, kv_heads, dim, generator=generator)
    value_pool = torch.randn(sum(blocks) + 1, block_size, kv_heads, dim, generator=generator)
    order = (torch.randperm(sum(blocks), generator=generator) + 1).tolist()
    tables = [order[sum(blocks[:i]) : sum(blocks[: i + 1])] for i in range(len(blocks))]
    block_table = torch.zeros(len(tables), width, dtype=torch.long)
    for row, table in enumerate(tables):
        block_table[row, : len(table)] = torch.tensor(table)
    q = torch.randn(sum(query_lens), heads, dim, generator=generator)
    positions = torch.cat([torch.arange(c - n, c) for n, c in zip(query_lens, context_lens)])
    args = (block_table, torch.zeros(len(q), dtype=torch.long), positions,
            torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()]), torch.tensor(context_lens),
            max(query_lens))
    decode = max(query_lens) == 1
    widths = tuple(max(blocks[start:end]) if decode else width for start, end in zip((0, *ends[:-1]), ends))
    space = torch.randn(2 * len(tables) * width * block_size * kv_heads * dim, generator=generator)
    planned = Gathered(*args, gather=GatherPlan(ends, widths, space))
    out = planned.kernel(q, key_pool, value_pool)
    torch.testing.assert_close(out, Gathered(*args).kernel(q, key_pool, value_pool), atol=1e-6, rtol=0)
    expected = _float64_attention(q, key_pool, value_pool, tables, query_lens, context_lens)
    torch.testing.assert_close(out.double(), expected, atol=2e-6, rtol=0)
    # the next layer of the call: the groups the first layer made, for that layer's queries and pools
    groups = list(planned.gather.groups)
    next_q, next_key_pool, next_value_pool = q.flip(-1), key_pool.flip(-1), value_pool * 2
    torch.testing.assert_close(planned.kernel(next_q, next_key_pool, next_value_pool),
                               Gathered(*args).kernel(next_q, next_key_pool, next_value_pool),
                               atol=1e-6, rtol=0)
    assert len(groups) == len(planned.gather.groups) == len(ends)  # made once, by the first layer
    assert all(made is again for made, again in zip(groups, planned.gather.groups))


@pytest.mark.parametrize("heads, kv_heads, dtype", [(6, 2, torch.float32), (4, 4, torch.float32),
                                                    (6, 2, torch.float64)])
def test_sparse_attention_reads_each_query_context_alone_with_one_index_for_every_layer(heads, kv_heads,
                                                                                        dtype):
    """A decode call through the sparse path reads exactly each sequence's context: the pool is NaN wherever
    no query may look (unused blocks, the null block, slots past a context in its last block), two sequences
    share their first block (a prefix hit), and one SparseIndex made for the call serves two layers' queries
    and pools as an index made by each layer does, at float64's values."""
    dim, block_size = 8, 4
    generator = torch.Generator().manual_seed(2)
    context_lens = [1, 6, 9, 16, 23]
    tables = [[5], [1, 2], [1, 3, 4], [6, 7, 8, 9], [10, 11, 12, 13, 14, 15]]  # rows 1, 2 share block 1
    block_table = torch.zeros(len(tables), 6, dtype=torch.long)
    for row, table in enumerate(tables):
        block_table[row, : len(table)] = torch.tensor(table)
    layers = []
    for _ in range(2):
        pools = [torch.full((20, block_size, kv_heads, dim), float("nan"), dtype=dtype) for _ in range(2)]
        for table, context in zip(tables, context_lens):
            for pool in pools:
                pool.view(-1, kv_heads, dim)[torch.tensor([block * block_size + i for block in table
                                                           for i in range(block_size)][:context])] = \
                    torch.randn(context, kv_heads, dim, generator=generator, dtype=dtype)
        layers.append((torch.randn(len(tables), heads, dim, generator=generator, dtype=dtype), *pools))
    args = (block_table, torch.zeros(len(tables), dtype=torch.long), torch.tensor(context_lens) - 1,
            torch.arange(len(tables) + 1), torch.tensor(context_lens), 1)
    index = sparse_index(block_table, torch.tensor(context_lens), sum(context_lens), heads,
                         layers[0][1].shape, dtype)
    for q, key_pool, value_pool in layers:
        out = Sparse(*args, index=index).kernel(q, key_pool, value_pool)
        alone = Sparse(*args).kernel(q, key_pool, value_pool)
        torch.testing.assert_close(out, alone, atol=0, rtol=0)
        expected = _float64_attention(q, key_pool, value_pool, tables, [1] * len(tables), context_lens)
        atol = 2e-6 if dtype == torch.float32 else 1e-12
        torch.testing.assert_close(out.double(), expected, atol=atol, rtol=0)
        assert out.dtype == dtype
    assert not index.pattern.values().any()  # still zeros (see sparse_index)
