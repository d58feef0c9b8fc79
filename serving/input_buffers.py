"""The runner's host-side inputs: one persistent row per seated sequence, and pinned staging buffers that each step's
inputs are packed into and sent to the device in one non-blocking copy.

As vLLM's persistent input batch and nano-vllm's flat tensors: a row (block table, sampling settings) is written whole
when a sequence takes its seat (admission, a forked sample) and handed back when it leaves (finished, aborted,
preempted); a decode step then touches each sequence's row at one entry (its last block, which may be new or a
copy-on-write copy) and packs the batch with a fixed number of numpy calls. The host's work per step is a few Python
attribute reads per sequence, and the number of tensor operations does not depend on the batch.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from torch import Tensor

from models.sampling import RowSettings
from serving.sequence import Sequence


class Staging:
    """A pinned host buffer, its numpy view, and where its contents go on the device (the same tensor on a CPU)."""

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.host = torch.zeros(size, dtype=dtype, pin_memory=device.type == "cuda")
        self.array = self.host.numpy()
        self.device = self.host if device.type == "cpu" else torch.zeros(size, dtype=dtype, device=device)

    def upload(self, used: int) -> Tensor:
        """The device buffer, with the first `used` entries sent (non-blocking: the host buffer is not written again
        before the step's one device-to-host copy, which waits for it)."""
        if self.device is not self.host:
            self.device[:used].copy_(self.host[:used], non_blocking=True)
        return self.device


@dataclasses.dataclass
class StepInputs:
    """A packed forward's device tensors: N tokens of S sequences (see models.kv_cache.Paged)."""

    tokens: Tensor  # [N]
    positions: Tensor  # [N]
    slot_mapping: Tensor  # [N]
    query_start: Tensor  # [S + 1]
    context_lens: Tensor  # [S]
    block_table: Tensor  # [S, width]
    max_query_len: int
    last: Tensor | None = None  # [S] each sequence's last token in the N (prefill; a decode's is its own)
    image_slots: Tensor | None = None  # [K] the image placeholders among the N (prefill)
    image_chunks: list[tuple[Sequence, int, int]] = dataclasses.field(default_factory=list)  # image features [lo, hi)


class InputBuffers:
    def __init__(self, max_rows: int, max_blocks: int, max_tokens: int, block_size: int,
                 device: torch.device) -> None:
        self.max_rows, self.max_blocks, self.block_size = max_rows, max_blocks, block_size
        self.tables = np.zeros((max_rows, max_blocks), np.int64)
        self.num_blocks = np.zeros(max_rows, np.int64)
        self.greedy = np.ones(max_rows, bool)
        self.temperature = np.ones(max_rows, np.float32)
        self.top_k = np.zeros(max_rows, np.int64)
        self.top_p = np.ones(max_rows, np.float32)
        self.free_rows = list(range(max_rows - 1, -1, -1))
        # decode: tokens | positions | slots | context lengths | block-table rows, at fixed offsets (the CUDA graphs'
        # static inputs are views of its device buffer)
        self.decode = Staging(4 * max_rows + max_rows * max_blocks, torch.int64, device)
        self.decode.array[3 * max_rows : 4 * max_rows] = 1  # context lengths of 1 until a step writes them
        self.decode.upload(4 * max_rows)
        self.decode_query_start = torch.arange(max_rows + 1, device=device)
        self.prefill = Staging(4 * max_tokens + 3 * max_rows + 1 + max_rows * max_blocks, torch.int64, device)
        self.sampling = Staging(4 * max_rows, torch.float32, device)

    # -- rows ----------------------------------------------------------------------------------------------------
    def take(self, sequence: Sequence) -> None:
        """Seat `sequence` in a free row: its whole block table and its request's sampling settings."""
        row = sequence.row = self.free_rows.pop()
        table, params = sequence.table, sequence.group.params
        self.tables[row, : len(table)] = table
        self.num_blocks[row] = len(table)
        self.greedy[row] = params.is_greedy
        self.temperature[row] = 1.0 if params.is_greedy else params.temperature
        self.top_k[row], self.top_p[row] = params.top_k, params.top_p

    def give_back(self, sequence: Sequence) -> None:
        if sequence.row is not None:
            self.free_rows.append(sequence.row)
            sequence.row = None

    # -- a step's inputs -----------------------------------------------------------------------------------------
    def decode_inputs(self, sequences: list[Sequence], rows: int | None = None) -> StepInputs:
        """One token per sequence at position num_computed. With `rows` (a CUDA-graph bucket >= len(sequences)) the
        batch is padded to that many rows, which write the null block and read one slot of it, and the block table
        keeps its full width (the graph's static shape); without, it is cut to the longest table."""
        n, size, stride = len(sequences), self.block_size, self.max_rows
        seats, tokens, positions, lengths, last_blocks = [], [], [], [], []
        for sequence in sequences:
            table = sequence.table
            seats.append(sequence.row)
            tokens.append(sequence.tokens[-1])
            positions.append(sequence.num_computed)
            lengths.append(len(table))
            last_blocks.append(table[-1])
        seat, position, length = np.array(seats), np.array(positions), np.array(lengths)
        self.tables[seat, length - 1] = last_blocks  # a new block, or a copy-on-write copy of the last one
        self.num_blocks[seat] = length
        buffer, padded = self.decode.array, rows or n
        buffer[:n] = tokens
        buffer[stride : stride + n] = position
        buffer[2 * stride : 2 * stride + n] = self.tables[seat, position // size] * size + position % size
        buffer[3 * stride : 3 * stride + n] = position + 1
        for start, pad in ((0, 0), (stride, 0), (2 * stride, 0), (3 * stride, 1)):  # padded rows: the null block
            buffer[start + n : start + padded] = pad
        columns = self.max_blocks if rows else int(length.max())
        table = buffer[4 * stride :].reshape(stride, self.max_blocks)
        table[:n, :columns] = self.tables[seat, :columns]
        self.decode.upload(4 * stride + padded * self.max_blocks)
        return self.decode_views(padded, columns)

    def decode_views(self, rows: int, columns: int) -> StepInputs:
        """The decode inputs of the first `rows` rows as views of the device buffer (fixed addresses)."""
        device, stride = self.decode.device, self.max_rows
        return StepInputs(device[:rows], device[stride : stride + rows], device[2 * stride : 2 * stride + rows],
                          self.decode_query_start[: rows + 1], device[3 * stride : 3 * stride + rows],
                          device[4 * stride :].view(stride, self.max_blocks)[:rows, :columns], max_query_len=1)

    def prefill_inputs(self, work: list[tuple[Sequence, int]]) -> StepInputs:
        """The prompt chunks of `work` packed into one row: sequence i computes `count` tokens from num_computed."""
        size, num_seqs = self.block_size, len(work)
        tokens, seats, starts, counts, image_chunks, image_slots = [], [], [], [], [], []
        for sequence, count in work:
            start = sequence.num_computed
            if start < sequence.num_prompt:  # only the prompt's image-token ids are placeholders
                placeholders = sequence.group.image_positions
                lo, hi = np.searchsorted(placeholders, (start, start + count))
                if hi > lo:
                    image_chunks.append((sequence, int(lo), int(hi)))
                    image_slots.append(placeholders[lo:hi] - start + len(tokens))
            tokens += sequence.tokens[start : start + count]
            seats.append(sequence.row)
            starts.append(start)
            counts.append(count)
        seat, start, count = np.array(seats), np.array(starts), np.array(counts)
        query_start = np.zeros(num_seqs + 1, np.int64)
        np.cumsum(count, out=query_start[1:])
        num_tokens = int(query_start[-1])
        positions = np.arange(num_tokens) - np.repeat(query_start[:-1] - start, count)
        slots = self.tables[np.repeat(seat, count), positions // size] * size + positions % size
        images = np.concatenate(image_slots) if image_slots else np.zeros(0, np.int64)
        columns = int(self.num_blocks[seat].max())
        parts = [tokens, positions, slots, images, query_start, start + count, query_start[1:] - 1,
                 self.tables[seat, :columns]]
        device = self._pack(self.prefill, parts)
        return StepInputs(*device[:3], device[4], device[5], device[7].view(num_seqs, columns),
                          max_query_len=int(count.max()), last=device[6], image_slots=device[3],
                          image_chunks=image_chunks)

    def sampling_settings(self, sequences: list[Sequence]) -> RowSettings | None:
        """Each sequence's settings on the device, or None when every one is greedy (an argmax is all it takes)."""
        seat = np.array([sequence.row for sequence in sequences])
        greedy = self.greedy[seat]
        if greedy.all():
            return None
        n, stride, buffer = len(sequences), self.max_rows, self.sampling.array
        top_k, top_p = self.top_k[seat], self.top_p[seat]
        buffer[:n] = self.temperature[seat]
        buffer[stride : stride + n] = top_p
        buffer[2 * stride : 2 * stride + n] = top_k
        buffer[3 * stride : 3 * stride + n] = greedy
        device = self.sampling.upload(4 * stride)
        return RowSettings(greedy=device[3 * stride : 3 * stride + n] > 0, temperature=device[:n, None],
                           top_k=device[2 * stride : 2 * stride + n, None].long() if (top_k > 0).any() else 0,
                           top_p=device[stride : stride + n, None] if (top_p < 1).any() else 1.0)

    @staticmethod
    def _pack(staging: Staging, parts: list) -> list[Tensor]:
        """`parts` (lists or numpy arrays) laid end to end in `staging`, sent at once; their flat device views."""
        bounds, offset = [], 0
        for part in parts:
            part = np.asarray(part).ravel()
            staging.array[offset : offset + part.size] = part
            bounds.append((offset, offset + part.size))
            offset += part.size
        device = staging.upload(offset)
        return [device[begin:end] for begin, end in bounds]
