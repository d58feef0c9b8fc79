"""Paged KV-cache bookkeeping: fixed-size blocks, ref counts, a free list, prefix reuse and copy-on-write.

Follows PagedAttention (Kwon et al., SOSP 2023) and vLLM / nano-vllm's block manager. The pool holds
`num_blocks` blocks of `block_size` token slots per layer (serving/runner.py); block 0 is the null block,
never handed out, where padded rows write. A sequence owns a block table (its blocks in order); token t of the
sequence lives in slot `table[t // block_size] * block_size + t % block_size`.

Prefix caching: a full block is registered under a hash chained over every token before it (the hash of the
previous block and this block's token keys), so a block is reused only by a sequence whose whole prefix up to
it is the same. Token keys are token ids, and for image tokens (image digest, index in the image), so two
different images never share a block. A hit is checked against the stored keys, never the hash alone. Freed
blocks keep their contents and hash and go to the back of the free list, so the most recently used prefixes
are evicted last.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Hashable, Sequence

NULL_BLOCK = 0

TokenKey = Hashable  # a token id, or (image digest, index) for an image token


@dataclasses.dataclass
class Block:
    id: int
    ref_count: int = 0
    hash: int | None = None  # set while the block is full and registered for reuse
    keys: tuple[TokenKey, ...] = ()


def chain_hash(previous: int | None, keys: Sequence[TokenKey]) -> int:
    return hash((previous, tuple(keys)))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2 or block_size < 1:
            raise ValueError(f"need at least 2 blocks (one is the null block) of >= 1 slot, "
                             f"got {num_blocks} x {block_size}")
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        # unreferenced blocks, least recently freed first: an ordered set, O(1) to take, reclaim (a prefix
        # hit) or free
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self.cached: dict[int, int] = {}  # chain hash -> block id (full blocks, in use or free)
        self.hits = self.lookups = 0  # full prompt blocks found in the prefix cache, and looked up

    @property
    def num_usable(self) -> int:
        return len(self.blocks) - 1

    @property
    def num_free(self) -> int:
        return len(self.free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_hashes(self, keys: Sequence[TokenKey], hashes: list[int],
                     limit: int | None = None) -> list[int]:
        """`hashes` extended in place to one chain hash per full block of `keys` (of its first `limit` keys):
        a sequence keeps its list, so each block is hashed once."""
        size = self.block_size
        for b in range(len(hashes), (len(keys) if limit is None else limit) // size):
            hashes.append(chain_hash(hashes[-1] if hashes else None, keys[b * size : (b + 1) * size]))
        return hashes

    def allocate_prompt(self, keys: Sequence[TokenKey], hashes: list[int]) -> tuple[list[int], int] | None:
        """Blocks for a new sequence's prompt, reusing cached full blocks of its prefix; returns (block table,
        number of prompt tokens already in the cache), or None (nothing taken) when too few blocks are free.

        The block holding the prompt's last token is never taken from the cache, so at least that token is
        computed again: the model needs its logits, and its K/V then go to a block this sequence owns."""
        size = self.block_size
        hashes = self.block_hashes(keys, hashes)[: (len(keys) - 1) // size]
        reused = []
        for b, chain in enumerate(hashes):
            block_id = self.cached.get(chain)
            if block_id is None or self.blocks[block_id].keys != tuple(keys[b * size : (b + 1) * size]):
                break
            reused.append(block_id)
        needed = self.blocks_for(len(keys)) - len(reused)
        if needed + sum(self.blocks[i].ref_count == 0 for i in reused) > self.num_free:
            return None
        self.lookups += len(hashes)
        self.hits += len(reused)
        for block_id in reused:
            self._reference(block_id)
        return reused + [self._take() for _ in range(needed)], len(reused) * size

    def commit(self, table: list[int], keys: Sequence[TokenKey], hashes: list[int], num_computed: int,
               num_registered: int) -> int:
        """Register the sequence's full blocks whose tokens are all computed (the first `num_computed` of
        `keys`) from block `num_registered` on, so later prompts can reuse them; returns how many leading
        blocks are registered. Only computed blocks are registered: a hit never reads K/V still to be written.
        A decode step touches only the block that just filled, whatever the context length."""
        size = self.block_size
        full = num_computed // size
        self.block_hashes(keys, hashes, full * size)
        for b in range(num_registered, full):
            block = self.blocks[table[b]]
            if block.hash is None and hashes[b] not in self.cached:
                block.hash, block.keys = hashes[b], tuple(keys[b * size : (b + 1) * size])
                self.cached[hashes[b]] = block.id
        return full

    def fork(self, table: list[int]) -> list[int]:
        """Another sequence sharing `table`'s blocks (a parallel sample of the same prompt)."""
        for block_id in table:
            self._reference(block_id)
        return list(table)

    def append_slot(self, table: list[int], position: int) -> tuple[int, int] | None:
        """Make room for the token at `position` of a sequence whose table covers every earlier token; returns
        a (source, destination) block copy to perform first when the token's block is shared (copy-on-write),
        or None. The table is changed in place. Raises MemoryError when no block is free (check `can_append`
        first)."""
        if position // self.block_size == len(table):
            table.append(self._take())
            return None
        last = table[-1]
        if self.blocks[last].ref_count == 1:  # a partial block: never registered for reuse, so it may change
            return None
        copy = self._take()
        self.blocks[last].ref_count -= 1
        table[-1] = copy
        return last, copy

    def needs_block(self, table: list[int], position: int) -> bool:
        """Whether the token at `position` needs a block taken from the free list: a new one, or a private
        copy of a shared last block (copy-on-write). Most decode steps need none."""
        return position // self.block_size == len(table) or self.blocks[table[-1]].ref_count > 1

    def can_append(self, table: list[int], position: int) -> bool:
        return not self.needs_block(table, position) or self.num_free > 0

    def release(self, table: list[int]) -> None:
        """Drop a sequence's references (finish, abort, preemption); blocks nobody uses go back to the free
        list."""
        # the prefix's first blocks end up last in the free list: evicted last
        for block_id in reversed(table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
        table.clear()

    def _take(self) -> int:
        if not self.free:
            raise MemoryError("no free KV-cache block")
        block_id, _ = self.free.popitem(last=False)
        self._unregister(block_id)
        self.blocks[block_id].ref_count = 1
        return block_id

    def _reference(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def _unregister(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.hash is not None and self.cached.get(block.hash) == block_id:
            del self.cached[block.hash]
        block.hash, block.keys = None, ()

    def check(self) -> None:
        """Invariants (for tests): the free list holds exactly the unreferenced blocks; the null block is
        never handed out; every cached hash points at a block that carries it."""
        free = set(self.free)
        assert NULL_BLOCK not in free and self.blocks[NULL_BLOCK].ref_count == 0
        for block in self.blocks[1:]:
            assert block.ref_count >= 0
            assert (block.ref_count == 0) == (block.id in free), f"block {block.id}: ref {block.ref_count}"
        for chain, block_id in self.cached.items():
            assert self.blocks[block_id].hash == chain
