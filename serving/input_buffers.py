"""The runner's inputs: one persistent row per seated sequence, and pinned staging buffers that each step's
inputs are packed into and sent to the device with non-blocking copies.

As vLLM's persistent input batch and nano-vllm's flat tensors: a row (block table, sampling settings) is
written whole when a sequence takes its seat (admission, a forked sample) and handed back when it leaves
(finished, aborted, preempted). The block tables live on the device too: a row goes there once when it is
taken, and a decode step then sends one entry per sequence (its last block, which may be new or a
copy-on-write copy) and reads the rows it needs by seat on the device. The host's work per step is a few
Python attribute reads per sequence and a fixed number of numpy calls; the number of tensor operations does
not depend on the batch.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from torch import Tensor

from serving.row_sampling import RowSettings
from serving.sequence import Sequence

ALIGN = 16  # packed parts start at multiples of 16 elements: Triton specializes kernels on pointer alignment
# A compiled prefill's first call (ModelRunner._compile_prefill) has 2 sequences, 5 tokens, the longest 4, and
# tables this wide: sizes that differ, so that dynamo gives each its own symbol
FIRST_PADDED_WIDTH = 6


class Staging:
    """A pinned host buffer, its numpy view, and where its contents go on the device (the same tensor on a
    CPU). Write the host side through `open()`, which first waits for the buffer's previous copy to the
    device."""

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self.host = torch.zeros(size, dtype=dtype, pin_memory=cuda)
        self.array = self.host.numpy()
        self.device = torch.zeros(size, dtype=dtype, device=device) if cuda else self.host
        self.copied = torch.cuda.Event() if cuda else None

    def open(self) -> np.ndarray:
        if self.copied is not None:
            # an event wait: no stall in practice, and not a sync of any tensor operation
            self.copied.synchronize()
        return self.array

    def upload(self, begin: int, end: int) -> Tensor:
        """The device buffer, with entries begin .. end - 1 sent (non-blocking)."""
        if self.copied is not None:
            self.device[begin:end].copy_(self.host[begin:end], non_blocking=True)
            self.copied.record()
        return self.device


@dataclasses.dataclass
class StepInputs:
    """A packed forward's device tensors: N tokens of S sequences (see serving.paged_layout.Paged)."""

    tokens: Tensor  # [N]
    positions: Tensor  # [N]
    slot_mapping: Tensor  # [N]
    query_start: Tensor  # [S + 1]
    context_lens: Tensor  # [S]
    block_table: Tensor  # [S, blocks]
    max_query_len: int
    # each sequence's last token in the N, null chunks' left out (prefill; a decode's is its own)
    last: Tensor | None = None
    context_total: int | None = None  # the sum of context_lens, host-known (decode_inputs')
    image_slots: Tensor | None = None  # [K] the image placeholders among the N (prefill)
    # image features [lo, hi)
    image_chunks: list[tuple[Sequence, int, int]] = dataclasses.field(default_factory=list)


class InputBuffers:
    def __init__(self, max_rows: int, max_blocks: int, max_tokens: int, block_size: int,
                 device: torch.device) -> None:
        self.max_rows = max_rows
        self.max_blocks = max_blocks
        self.block_size = block_size
        self.device = device
        self.null_seat = max_rows  # an all-zero row: padded decode rows read the null block through it
        self.tables = np.zeros((max_rows + 1, max_blocks), np.int64)
        self.tables_device = (torch.from_numpy(self.tables) if device.type == "cpu"
                              else torch.zeros(max_rows + 1, max_blocks, dtype=torch.long, device=device))
        self.unsent: list[int] = []  # seats whose whole row the device has not been sent yet
        self.num_blocks = np.zeros(max_rows + 1, np.int64)
        self.greedy = np.ones(max_rows, bool)
        self.temperature = np.ones(max_rows, np.float32)
        self.top_k = np.zeros(max_rows, np.int64)
        self.top_p = np.ones(max_rows, np.float32)
        self.logprobs = np.full(max_rows, -1, np.int64)  # top log-probabilities asked for, -1 for none
        self.free_rows = list(range(max_rows - 1, -1, -1))
        # decode: tokens | positions | slots | context lengths | seats | each seat's last block's column |
        # that block, at fixed offsets: the CUDA graphs' static inputs are views of the device buffer
        self.decode = Staging(7 * max_rows, torch.int64, device)
        array = self.decode.open()
        # until a step writes them, rows read one slot of the null block
        array[3 * max_rows : 4 * max_rows] = 1
        array[4 * max_rows : 5 * max_rows] = self.null_seat
        self.decode.upload(0, 7 * max_rows)
        self.decode_query_start = torch.arange(max_rows + 1, device=device)
        # each seat's last sampled token, written on the device by the sampling call: a decode whose token
        # the host has not read yet (Sequence.unread) is sent -1 and reads it from here
        self.sampled_tokens = torch.zeros(max_rows + 1, dtype=torch.int64, device=device)
        # tokens and sequences, with room for a padded call's null chunks (prefill_inputs)
        self.prefill = Staging(4 * (max_tokens + 2) + 4 * (max_rows + 2) + 8 * ALIGN, torch.int64, device)
        self.rows = Staging(max_rows * (max_blocks + 1) + ALIGN, torch.int64, device)
        self.sampling = Staging(4 * max_rows, torch.float32, device)
        self.indices = Staging(16 * max_rows + 4 * ALIGN, torch.int64, device)  # a ring of small index lists
        self.indices_at = 0

    # -- rows ------------------------------------------------------------------------------------------------
    def take(self, sequence: Sequence) -> None:
        """Seat `sequence` in a free row: its whole block table and its request's sampling settings."""
        row = sequence.row = self.free_rows.pop()
        table, params = sequence.table, sequence.group.params
        self.tables[row, : len(table)] = table
        self.num_blocks[row] = len(table)
        self.unsent.append(row)
        self.greedy[row] = params.is_greedy
        self.temperature[row] = 1.0 if params.is_greedy else params.temperature
        self.top_k[row] = params.top_k
        self.top_p[row] = params.top_p
        self.logprobs[row] = -1 if params.logprobs is None else params.logprobs

    def give_back(self, sequence: Sequence) -> None:
        if sequence.row is not None:
            self.free_rows.append(sequence.row)
            sequence.row = None

    # -- a step's inputs -------------------------------------------------------------------------------------
    def decode_inputs(self, sequences: list[Sequence], rows: int | None = None) -> StepInputs | None:
        """One token per sequence at position num_computed, written to the device buffer, and their views
        there with the block table cut to the longest table (two blocks at least). With `rows` (a CUDA-graph
        bucket >= len(sequences)) the batch is padded to that many rows, which read and write only the null
        block, and nothing is returned: the graph reads the buffer through the views it captured."""
        self._send_rows()
        n = len(sequences)
        size = self.block_size
        stride = self.max_rows
        seats = []
        tokens = []
        positions = []
        lengths = []
        last_blocks = []
        for sequence in sequences:
            table = sequence.table
            seats.append(sequence.row)
            tokens.append(-1 if sequence.unread else sequence.tokens[-1])
            positions.append(sequence.num_computed)
            lengths.append(len(table))
            last_blocks.append(table[-1])
        seat = np.array(seats)
        position = np.array(positions)
        length = np.array(lengths)
        self.tables[seat, length - 1] = last_blocks  # a new block, or a copy-on-write copy of the last one
        self.num_blocks[seat] = length
        buffer, padded = self.decode.open(), rows or n
        buffer[:n] = tokens
        buffer[stride : stride + n] = position
        buffer[2 * stride : 2 * stride + n] = self.tables[seat, position // size] * size + position % size
        buffer[3 * stride : 3 * stride + n] = position + 1
        buffer[4 * stride : 4 * stride + n] = seat
        buffer[5 * stride : 5 * stride + n] = length - 1
        buffer[6 * stride : 6 * stride + n] = last_blocks
        # padded rows: the null row and block
        for region, pad in enumerate((0, 0, 0, 1, self.null_seat, 0, 0)):
            buffer[region * stride + n : region * stride + padded] = pad
        self.decode.upload(0, 7 * stride)
        if rows is not None:
            return None
        # at least two columns (the second the null block's): a compiled step would take a new graph for one
        inputs = self.decode_views(n, min(max(2, int(length.max())), self.max_blocks))
        inputs.context_total = int(position.sum()) + n  # each context: its position + 1
        return inputs

    def decode_views(self, rows: int, columns: int) -> StepInputs:
        """The decode inputs of the first `rows` rows, read from the device buffer (fixed addresses): each
        seat's last block entered into the device's block tables, then the rows' tables gathered by seat; a
        token sent as -1 is the seat's last sampled one."""
        device, stride = self.decode.device, self.max_rows
        seats = device[4 * stride : 4 * stride + rows]
        self.tables_device[seats, device[5 * stride : 5 * stride + rows]] = device[
            6 * stride : 6 * stride + rows
        ]
        sent = device[:rows]
        tokens = torch.where(sent < 0, self.sampled_tokens[seats], sent)
        return StepInputs(tokens, device[stride : stride + rows],
                          device[2 * stride : 2 * stride + rows], self.decode_query_start[: rows + 1],
                          device[3 * stride : 3 * stride + rows], self.tables_device[:, :columns][seats],
                          max_query_len=1)

    def prefill_inputs(self, chunks: list[tuple[Sequence | None, int]], padded: bool = False) -> StepInputs:
        """The prompt chunks (sequence, count) packed into one row: each sequence computes `count` tokens from
        num_computed; a sequence of None is a chunk of the null seat (token 0 from position 0, writing the
        null block), after the others. `padded` (a compiled forward's): a null chunk of one token makes up two
        sequences at least, and max_query_len and the tables' width are two at least: dynamo compiles sizes
        of 0 and 1 apart, so one graph then serves every call."""
        self._send_rows()
        size = self.block_size
        chunks = chunks + [(None, 1)] * (2 - len(chunks) if padded else 0)
        tokens = []
        seats = []
        starts = []
        counts = []
        image_chunks = []
        image_slots = []
        for sequence, count in chunks:
            if sequence is None:
                tokens += [0] * count
                seats.append(self.null_seat)
                starts.append(0)
                counts.append(count)
                continue
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
        num_seqs = len(seats)
        seat = np.array(seats)
        start = np.array(starts)
        count = np.array(counts)
        query_start = np.zeros(num_seqs + 1, np.int64)
        np.cumsum(count, out=query_start[1:])
        num_tokens = int(query_start[-1])
        positions = np.arange(num_tokens) - np.repeat(query_start[:-1] - start, count)
        slots = self.tables[np.repeat(seat, count), positions // size] * size + positions % size
        images = np.concatenate(image_slots) if image_slots else np.zeros(0, np.int64)
        parts = self._pack(self.prefill, [tokens, positions, slots, images, query_start, start + count,
                                          query_start[1:][seat != self.null_seat] - 1, seat])
        columns = int(self.num_blocks[seat].max())
        if padded:  # two columns at least; every column where there are fewer than the first call's width
            columns = self.max_blocks if self.max_blocks < FIRST_PADDED_WIDTH else max(2, columns)
        return StepInputs(*parts[:3], parts[4], parts[5], self.tables_device[:, :columns][parts[7]],
                          max_query_len=max(int(count.max()), 2 if padded else 1), last=parts[6],
                          image_slots=parts[3], image_chunks=image_chunks)

    def sampling_settings(self, sequences: list[Sequence]) -> RowSettings | None:
        """Each sequence's settings on the device, or None when every one is greedy (an argmax is all it
        takes)."""
        seat = np.array([sequence.row for sequence in sequences])
        greedy = self.greedy[seat]
        if greedy.all():
            return None
        n = len(sequences)
        stride = self.max_rows
        buffer = self.sampling.open()
        top_k, top_p = self.top_k[seat], self.top_p[seat]
        buffer[:n] = self.temperature[seat]
        buffer[stride : stride + n] = top_p
        buffer[2 * stride : 2 * stride + n] = top_k
        buffer[3 * stride : 3 * stride + n] = greedy
        device = self.sampling.upload(0, 4 * stride)
        return RowSettings(greedy=device[3 * stride : 3 * stride + n] > 0, temperature=device[:n, None],
                           top_k=device[2 * stride : 2 * stride + n, None].long() if (top_k > 0).any() else 0,
                           top_p=device[stride : stride + n, None] if (top_p < 1).any() else 1.0)

    def index(self, values: list[int]) -> Tensor:
        """`values` as a device index tensor through pinned memory (a plain torch.tensor(..., device=cuda)
        copies from pageable memory, which waits for the device)."""
        size = -(-max(len(values), 1) // ALIGN) * ALIGN
        if self.indices_at + size > len(self.indices.array):
            self.indices_at = 0
        begin, self.indices_at = self.indices_at, self.indices_at + size
        # a lap done: wait for its last copy
        array = self.indices.open() if begin == 0 else self.indices.array
        array[begin : begin + len(values)] = values
        return self.indices.upload(begin, begin + len(values))[begin : begin + len(values)]

    def _send_rows(self) -> None:
        """Send the device the whole rows of the sequences seated since the last step."""
        if not self.unsent:
            return
        seats, self.unsent = self.unsent, []
        if self.device.type == "cpu":  # the device's tables are the host's
            return
        seat, rows = self._pack(self.rows, [seats, self.tables[seats]])
        self.tables_device[seat] = rows.view(len(seats), self.max_blocks)

    @staticmethod
    def _pack(staging: Staging, parts: list) -> list[Tensor]:
        """`parts` (lists or numpy arrays) laid end to end in `staging`, each at an aligned offset, sent at
        once; their flat device views."""
        array = staging.open()
        bounds = []
        offset = 0
        for part in parts:
            part = np.asarray(part).ravel()
            array[offset : offset + part.size] = part
            bounds.append((offset, offset + part.size))
            offset = -(-(offset + part.size) // ALIGN) * ALIGN
        device = staging.upload(0, bounds[-1][1])
        return [device[begin:end] for begin, end in bounds]
