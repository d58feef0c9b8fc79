"""The paged KV-cache layout (PagedAttention, Kwon et al. 2023): the engine's way into the model's blocks,
plugged in at their cache's seam (models/kv_cache.py `Layout`).

The tokens of many sequences run as one row, [1, N], packed without padding; "key" and "value" are the pool
[blocks, block_size, kv_heads, D] shared by every sequence, and the layout says where each sequence's tokens
live (its block table), where each new token goes (`slot_mapping`), and which queries belong to which
sequence (`query_start`, as flash attention's cu_seqlens) at which positions. Each kernel is a layout class
(serving/paged_attention.py): `Gathered` (the reference; optionally a GatherPlan of row groups), `Sparse` (a
CPU's decode calls, with the call's SparseIndex) and `Triton` (GPUs); `PAGED_LAYOUTS` names them.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from models.kv_cache import KVCache, Layout
from serving.paged_attention import GatherPlan, SparseIndex, gathered_paged_attention, sparse_paged_attention


@dataclasses.dataclass(frozen=True, eq=False)
class Paged(Layout):
    """Where the tokens of a packed call live in the pool. Sequences s = 0 .. S-1 own queries query_start[s]
    .. query_start[s + 1] - 1 of the call, the last ones of their first context_lens[s] tokens.
    `max_query_len` (host-known) sizes the gathered path. Subclasses give the kernel."""

    block_table: Tensor  # [S, max blocks] int: each sequence's blocks in order, padded with the null block 0
    # [N] int64: the pool slot (block * block_size + offset) each new token is written to
    slot_mapping: Tensor
    positions: Tensor  # [N] int64: each token's position in its own sequence
    query_start: Tensor  # [S + 1] int: cumulative query counts
    context_lens: Tensor  # [S] int: each sequence's tokens in the cache once this call has written
    max_query_len: int

    def positions_and_mask(self, cache: KVCache | None, attention_mask: Tensor | None,
                           start_pos: int | Tensor, batch: int, seq: int, device: torch.device,
                           flex: bool = False
                           ) -> tuple[Tensor, None]:
        """The layout's own positions; the block tables and context lengths say what each query sees."""
        if batch != 1 or attention_mask is not None:
            raise ValueError("a paged call is one row of packed sequences [1, N], with no attention mask")
        return self.positions[None], None

    def write(self, cache: KVCache | None, key: Tensor, value: Tensor,
              start_pos: int | Tensor) -> tuple[KVCache, Tensor, Tensor]:
        """Scatter the call's K/V [1, Hkv, N, D] into the pool at `slot_mapping` (padded tokens write the null
        block); the pools are what attention reads."""
        for pool, new in ((cache["key"], key), (cache["value"], value)):
            num_blocks, size, heads, dim = pool.shape
            flat = pool.view(num_blocks * size, heads, dim)
            flat.index_copy_(0, self.slot_mapping, new[0].transpose(0, 1).to(pool.dtype))
        return cache, cache["key"], cache["value"]

    def attend(self, q: Tensor, key: Tensor, value: Tensor, mask: None, cache: KVCache | None,
               start_pos: int | Tensor) -> tuple[Tensor, KVCache]:
        cache, key_pool, value_pool = self.write(cache, key, value, start_pos)
        return self.kernel(q[0].transpose(0, 1), key_pool, value_pool).transpose(0, 1)[None], cache

    def kernel(self, q: Tensor, key_pool: Tensor, value_pool: Tensor) -> Tensor:
        """The packed queries [N, H, D] against the pools -> [N, H, D]."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True, eq=False)
class Gathered(Paged):
    """Each sequence's blocks gathered, then SDPA (exact; any device and dtype); `gather` runs a decode
    call's rows in groups of their own widths into one reused buffer (None: one fresh gather)."""

    gather: GatherPlan | None = None

    def kernel(self, q: Tensor, key_pool: Tensor, value_pool: Tensor) -> Tensor:
        return gathered_paged_attention(q, key_pool, value_pool, self, self.gather)


@dataclasses.dataclass(frozen=True, eq=False)
class Sparse(Paged):
    """A CPU's decode calls (one query a sequence) read the pool in place through sparse kernels, with the
    call's `index` (None: each layer makes one); prompt chunks are gathered."""

    index: SparseIndex | None = None

    def kernel(self, q: Tensor, key_pool: Tensor, value_pool: Tensor) -> Tensor:
        if self.max_query_len > 1:
            return gathered_paged_attention(q, key_pool, value_pool, self)
        return sparse_paged_attention(q, key_pool, value_pool, self, self.index)


@dataclasses.dataclass(frozen=True, eq=False)
class Triton(Paged):
    """One Triton kernel that reads the pool in place (GPUs; a CPU's tests through Triton's interpreter)."""

    def kernel(self, q: Tensor, key_pool: Tensor, value_pool: Tensor) -> Tensor:
        from serving.paged_attention_triton import triton_paged_attention  # imports triton

        return triton_paged_attention(q, key_pool, value_pool, self)


PAGED_LAYOUTS: dict[str, type[Paged]] = {"gather": Gathered, "sparse": Sparse, "triton": Triton}
