"""Packing a batch's samples into shared rows, so that a step computes on fewer padding tokens.

Each row holds whole samples one after another; the attention mask numbers them 1, 2, ... within the row (0
for padding), and the language model keeps them apart: a token attends only to earlier tokens of its own
sample, and rotary positions restart at 0 for each sample (see `LanguageModel.forward`). So a packed batch
gives every sample the logits it would get alone: packing changes the speed of a step, not its result.
"""

from __future__ import annotations


def pack_rows(lengths: list[int], capacity: int | None = None) -> list[list[int]]:
    """Sample indices grouped into rows of at most `capacity` tokens (default: the longest sample), by
    first-fit decreasing: the longest samples are placed first, each into the first row with room for it."""
    capacity = max(lengths, default=0) if capacity is None else capacity
    if any(length > capacity for length in lengths):
        raise ValueError(f"a sample of {max(lengths)} tokens does not fit a row of {capacity}")
    rows: list[list[int]] = []
    room: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        row = next((r for r, free in enumerate(room) if free >= lengths[index]), len(rows))
        if row == len(rows):
            rows.append([])
            room.append(capacity)
        rows[row].append(index)
        room[row] -= lengths[index]
    return rows
