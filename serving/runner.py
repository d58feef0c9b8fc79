"""One forward pass over a step's work: every scheduled sequence's tokens, in one padded batch over the paged cache.

The pool holds, per layer, keys and values [num_blocks, block_size, kv_heads, head_dim]; each row of the batch is one
sequence's chunk (a decode's single token, or part of a prompt), at its own position, with its block table and the
pool slot of each new token (see models/kv_cache.py, "paged"). The model's own blocks and attention run it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from models import VisionLanguageModel
from serving.block_manager import NULL_BLOCK
from serving.sequence import Sequence

ATTENTION = ("gather", "flex")


class ModelRunner:
    """`attention`: "gather" (each row's blocks gathered, then SDPA: exact, any block size, the reference) or "flex"
    (FlexAttention over the pool in place, compiled once per query-count bucket; block sizes that are multiples of
    16: compiled CPU flex with blocks of 8 gave wrong values on torch 2.14)."""

    def __init__(self, model: VisionLanguageModel, num_blocks: int, block_size: int, attention: str = "gather",
                 max_rows: int = 64) -> None:
        if attention not in ATTENTION:
            raise ValueError(f"attention must be one of {ATTENTION}, got {attention!r}")
        if attention == "flex" and block_size % 16:
            raise ValueError(f"flex attention needs a block size that is a multiple of 16, got {block_size}")
        self.model, self.block_size, self.attention, self.max_rows = model, block_size, attention, max_rows
        config, weight = model.config.language, model.language.token_embedding.weight
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.pools = [{"key": torch.zeros(shape, dtype=weight.dtype, device=weight.device),
                       "value": torch.zeros(shape, dtype=weight.dtype, device=weight.device)}
                      for _ in range(config.num_layers)]
        image_token = model.config.image_token_id
        self.image_token = -1 if image_token is None else image_token
        self.filler = 1 if image_token == 0 else 0  # the id padded positions carry: never the image token
        self.device = weight.device

    @staticmethod
    def bytes_per_block(model: VisionLanguageModel, block_size: int) -> int:
        config, weight = model.config.language, model.language.token_embedding.weight
        return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * weight.element_size()

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if copies:
            source, destination = (torch.tensor(ids, device=self.device) for ids in zip(*copies))
            for pool in self.pools:
                for tensor in pool.values():
                    tensor[destination] = tensor[source]

    @torch.inference_mode()
    def run(self, work: list[tuple[Sequence, int]]) -> Tensor:
        """Logits [len(work), vocab] at each row's last computed token. Decodes (one token each) run as one batch and
        prompt chunks as another, so a decode row is never padded to a prompt chunk's length."""
        logits: list[Tensor | None] = [None] * len(work)
        for single in (True, False):
            rows = [i for i, (_, count) in enumerate(work) if (count == 1) == single]
            if rows:
                for i, row_logits in zip(rows, self._forward([work[i] for i in rows])):
                    logits[i] = row_logits
        return torch.stack(logits)

    def _forward(self, work: list[tuple[Sequence, int]]) -> Tensor:
        size, width = self.block_size, max(count for _, count in work)
        num_blocks = max(len(sequence.table) for sequence, _ in work)
        ids = torch.full((len(work), width), self.filler, dtype=torch.long)
        image_slots = torch.zeros(len(work), width, dtype=torch.bool)
        slots = torch.full((len(work), width), NULL_BLOCK * size, dtype=torch.long)
        tables = torch.full((len(work), num_blocks), NULL_BLOCK, dtype=torch.long)
        features = []
        for row, (sequence, count) in enumerate(work):
            start = sequence.num_computed
            ids[row, :count] = torch.tensor(sequence.tokens[start : start + count])
            positions = torch.arange(start, start + count)
            table = torch.tensor(sequence.table)
            slots[row, :count] = table[positions // size] * size + positions % size
            tables[row, : len(table)] = table
            if start < sequence.num_prompt:  # only the prompt's image-token ids are placeholders
                prompt = sequence.tokens[: sequence.num_prompt]
                here = torch.tensor([token == self.image_token for token in prompt[start : start + count]],
                                    dtype=torch.bool)
                image_slots[row, : len(here)] = here
                if here.any():
                    before = sum(token == self.image_token for token in prompt[:start])
                    features.append(self._features(sequence)[before : before + int(here.sum())])
        ids, slots, tables = ids.to(self.device), slots.to(self.device), tables.to(self.device)
        embeddings = self.model.embed(ids, features=torch.cat(features) if features else None,
                                      slots=image_slots.to(self.device))
        layout = {"block_table": tables, "slot_mapping": slots}
        if self.attention == "flex":
            layout.update(self._flex_mask(work, width))
        caches = [{**pool, **layout} for pool in self.pools]
        starts = torch.tensor([sequence.num_computed for sequence, _ in work], device=self.device)
        hidden, _ = self.model.language(embeddings, kv_cache=caches, start_pos=starts)
        last = torch.tensor([count - 1 for _, count in work], device=self.device)
        return self.model.language.head(hidden[torch.arange(len(work), device=self.device), last])

    def _flex_mask(self, work: list[tuple[Sequence, int]], width: int) -> dict:
        """The FlexAttention block mask of a forward: query q (a real token of row r at position p) sees pool slot s
        when s's block is in r's table, at a logical position <= p. Queries are padded to a power of two (>= 16) and
        the block-to-position table has `max_rows` rows whatever the batch, so one compiled kernel per query bucket
        serves every batch (the mask's tensors are graph inputs, and their shapes are guarded); padded queries see
        nothing."""
        from torch.nn.attention.flex_attention import create_block_mask

        size, pool_blocks = self.block_size, self.pools[0]["key"].shape[0]
        rows = [row for row, (_, count) in enumerate(work) for _ in range(count)]
        index = torch.tensor([row * width + t for row, (_, count) in enumerate(work) for t in range(count)])
        length = max(16, 1 << (len(rows) - 1).bit_length())
        query_row = torch.zeros(length, dtype=torch.long)
        query_position = torch.full((length,), -1, dtype=torch.long)
        query_row[: len(rows)] = torch.tensor(rows)
        query_position[: len(rows)] = torch.cat([torch.arange(s.num_computed, s.num_computed + c) for s, c in work])
        logical = torch.full((self.max_rows, pool_blocks), -1, dtype=torch.long)
        for row, (sequence, _) in enumerate(work):
            logical[row, torch.tensor(sequence.table)] = torch.arange(len(sequence.table))
        query_row, query_position, logical = (t.to(self.device) for t in (query_row, query_position, logical))

        def visible(batch, head, query, slot):
            block = logical[query_row[query], slot // size]
            return (block >= 0) & (block * size + slot % size <= query_position[query])

        mask = create_block_mask(visible, 1, None, length, pool_blocks * size, device=self.device)
        return {"block_mask": mask, "query_index": index.to(self.device)}

    def _features(self, sequence: Sequence) -> Tensor:
        group = sequence.group
        if group.features is None:
            group.features = self.model.image_features(group.images.to(self.device)).flatten(0, 1)
        return group.features
