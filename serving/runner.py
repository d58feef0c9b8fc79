"""One engine step on the device: the decode rows (one token each; on a GPU, a CUDA graph per batch bucket),
the prompt chunks (packed into one row, no padding), then one sampling call for every row that needs a token
and the step's one device-to-host copy (the sampled ids).

The pool holds, per layer, keys and values [num_blocks, block_size, kv_heads, head_dim]; the model's own
blocks run every forward with a paged layout (serving/paged_layout.py) built from the persistent input rows
(serving/input_buffers.py). Attention reads the pool through the block tables: gathered + SDPA ("gather":
exact; an eager decode sorts its rows by table length so that groups of them gather only what they need), in
place with a Triton kernel ("triton": GPUs; the default there), or, for decode rows on a CPU, in place with
sparse-matrix kernels ("sparse": the default there; prompt chunks are gathered). On a CPU the language model's
linears run through oneDNN on weights packed once (serving/packed_linear.py). Which of these a runner uses is
its resolved ServingConfig (serving/config.py).

The runner reaches the model only through serving/served_model.py's narrow interface (embed, hidden states
through the blocks over a paged layout, logits, the KV shape, image features), never through its attributes.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch
from torch import Tensor

from models.compiled_decode import CompiledCall
from serving.config import ServingConfig
from serving.decode_graphs import DecodeGraphs
from serving.input_buffers import FIRST_PADDED_WIDTH, InputBuffers, StepInputs
from serving.paged_attention import GatherPlan, SparseIndex, sparse_index
from serving.paged_layout import PAGED_LAYOUTS, Gathered, Sparse
from serving.requests import MAX_LOGPROBS, TokenLogprobs
from serving.row_sampling import sample_rows
from serving.sequence import Sequence
from serving.served_model import ServedModel
from serving.structured import apply_masks, matcher


@dataclasses.dataclass
class SampledIds:
    """A sampling call's results on their way to the host (ModelRunner.sample)."""

    host: Tensor  # [rows] ids, or [rows, 2 + 2k] ids, their log-probabilities, the top k's ids and values
    ready: torch.cuda.Event | None  # the copy's event (None: `host` is already there)
    asked: list[int] | None  # each row's top log-probabilities asked for (-1: none); None: no row asked
    stuck: list[int]  # rows whose grammar allowed no token

    def read(self) -> tuple[list[int | None], list[TokenLogprobs | None] | None]:
        """The ids, each row's log-probabilities if asked, None for a row whose grammar allowed no token (its
        row's logits were all masked, so what was drawn from them is no token of the answer). The step's one
        wait for the device: on the event of the copy, not a sync of any tensor operation."""
        if self.ready is not None:
            self.ready.synchronize()
        host = self.host.tolist()
        results = None
        if self.asked is None:
            ids = host
        else:
            k = (len(host[0]) - 2) // 2 if host else 0
            results = [None if want < 0 else TokenLogprobs(row[1], list(zip(map(int, row[2 : 2 + want]),
                                                                         row[2 + k : 2 + k + want])))
                       for row, want in zip(host, self.asked)]
            ids = [int(row[0]) for row in host]
        for row in self.stuck:
            ids[row] = None
        return ids, results


def row_groups(lengths: np.ndarray, most: int = 4, least_rows: int = 8
               ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Decode rows sorted by table length, in up to `most` groups of equal size (`least_rows` rows each at
    least; neighbours of one width merged): each group's end row and width (its longest table)."""
    count = max(1, min(most, len(lengths) // least_rows))
    ends: list[int] = []
    widths: list[int] = []
    for group in range(count):
        end = len(lengths) * (group + 1) // count
        if widths and widths[-1] == lengths[end - 1]:
            ends[-1] = end
        else:
            ends.append(end)
            widths.append(int(lengths[end - 1]))
    return tuple(ends), tuple(widths)


class ModelRunner:
    def __init__(self, model: ServedModel, settings: ServingConfig) -> None:
        """`settings`: resolved (ServingConfig.resolve) for the model's device and dtype. `compile_decode`:
        the decode forward through torch.compile (Inductor fuses its elementwise work into far fewer kernels),
        before any capture: compiled once for a batch of many rows (its sizes symbolic) and once for one row.
        `compile_prefill`: prompt chunks' forward through torch.compile, once with every size symbolic.
        `pack_weights`: the language model's linears through oneDNN with prepacked weights
        (serving/packed_linear.py; as much memory again)."""
        kv, max_num_seqs = model.kv, settings.max_num_seqs
        self.model = model.with_packed_linears() if settings.pack_weights else model
        self.settings = settings
        self.device = model.device
        self.layout = PAGED_LAYOUTS[settings.attention]  # the decode calls' kernel
        # prompt chunks' (of one token too): gathered where decode rows are sparse
        self.prefill_layout = Gathered if self.layout is Sparse else self.layout
        shape = (settings.num_blocks, settings.block_size, kv.kv_heads, kv.head_dim)
        self.pools = [{"key": torch.zeros(shape, dtype=kv.dtype, device=self.device),
                       "value": torch.zeros(shape, dtype=kv.dtype, device=self.device)}
                      for _ in range(kv.layers)]
        max_blocks = -(-model.context // settings.block_size)
        self.inputs = InputBuffers(max_num_seqs, max_blocks, settings.max_batch_tokens, settings.block_size,
                                   self.device)
        # the sampled ids (and any log-probabilities) come back through these, in turn (an overlapped step's
        # copy lands while the host reads the step before's): room for max_num_seqs rows of the most a row
        # packs (2 + 2 x MAX_LOGPROBS float64s)
        cuda = self.device.type == "cuda"
        self.sampled = [torch.zeros(max_num_seqs * (2 + 2 * MAX_LOGPROBS), dtype=torch.float64,
                                    pin_memory=cuda) for _ in range(2)]
        self.sampled_ready = [torch.cuda.Event() if cuda else None for _ in range(2)]
        self.sampled_turn = 0
        self.bitmask: Tensor | None = None  # structured output's token masks (made when first needed)
        self.gather_space: Tensor | None = None  # the gathered path's buffer, reused by every layer
        self.decode_hidden = self._decode_hidden
        if settings.compile_decode:  # past the recompile limit a new shape runs eagerly (with a warning)
            self.decode_hidden = CompiledCall(self._decode_hidden, "engine decode steps (rows, table width)",
                                              lambda tokens, block_table, *rest: block_table.shape)
        self.prefill_hidden = self._prefill_hidden
        if settings.compile_prefill:  # sizes symbolic: padded calls (prefill_inputs) all take one graph
            self.prefill_hidden = CompiledCall(
                self._prefill_hidden, "engine prompt chunks (tokens, table)",
                lambda embeddings, table, *rest: (embeddings.shape[1], *table.shape), dynamic=True)
        self.graphs = None
        with torch.inference_mode():
            if settings.compile_prefill:
                self._compile_prefill()
            if settings.cuda_graphs:
                self.graphs = DecodeGraphs(self._graphed_decode, max_num_seqs)
            elif settings.compile_decode:  # compiled now, as a capture compiles it, not in the first steps
                for rows in sorted({min(2, max_num_seqs), 1}, reverse=True):
                    self._graphed_decode(rows)  # rows of the null seat: they write the null block alone

    # -- seats -----------------------------------------------------------------------------------------------
    def admit(self, sequences: list[Sequence]) -> None:
        for sequence in sequences:
            self.inputs.take(sequence)

    def release(self, sequences: list[Sequence]) -> None:
        for sequence in sequences:
            self.inputs.give_back(sequence)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if copies:
            source, destination = (self.inputs.index(list(ids)) for ids in zip(*copies))
            for pool in self.pools:
                for tensor in pool.values():
                    tensor[destination] = tensor[source]

    # -- the step --------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, decodes: list[Sequence], prefills: list[tuple[Sequence, int]]) -> Tensor:
        """Logits [len(decodes) + len(prefills), vocab]: each decode's, then each prompt chunk's last
        token's."""
        hidden = []
        if decodes:
            if self.graphs is not None:
                self.inputs.decode_inputs(decodes, rows=self.graphs.bucket(len(decodes)))
                hidden.append(self.graphs.run(len(decodes)))
            elif self.layout is Sparse:
                hidden.append(self._sparse_decode(decodes))
            elif self.layout is Gathered and not self.settings.compile_decode:
                hidden.append(self._grouped_decode(decodes))
            else:
                hidden.append(self._decode(self.inputs.decode_inputs(decodes)))
        if prefills:
            hidden.append(self._prefill(self.inputs.prefill_inputs(prefills, self.settings.compile_prefill)))
        return self.model.logits(hidden[0] if len(hidden) == 1 else torch.cat(hidden))

    @torch.inference_mode()
    def sample(self, logits: Tensor, sequences: list[Sequence], rows: list[int] | None = None) -> SampledIds:
        """A token for each of `sequences` from its row of `logits` (row rows[i], or i), each with its
        request's settings (and structured-output mask), in one call, and, if any of them asks, the
        log-probabilities (the log-softmax of the model's logits, before any mask) of the sampled tokens and
        of the top k: all in the step's one device-to-host copy, started here and waited for by
        `SampledIds.read`. Overlapped, each token is also kept on the device at its sequence's seat, where
        the next decode reads it if the host has not yet."""
        if rows is not None:
            logits = logits[self.inputs.index(rows)]
        seats = [sequence.row for sequence in sequences]
        asked = self.inputs.logprobs[seats]
        # the model's, before any mask
        logprobs = logits.float().log_softmax(-1) if asked.max() >= 0 else None
        stuck: list[int] = []
        if any(sequence.group.grammar is not None for sequence in sequences):
            stuck = apply_masks(logits, [self._matcher(sequence) for sequence in sequences],
                                self._bitmask(logits.shape[-1]))
        settings = self.inputs.sampling_settings(sequences)
        if settings is None:
            tokens = logits.argmax(-1)
        else:
            tokens = sample_rows(logits, settings, self._noise(logits, sequences))
        if self.settings.overlap:  # serial steps read every token before the next decode: the host sends it
            self.inputs.sampled_tokens[self.inputs.index(seats)] = tokens
        if logprobs is None:
            return SampledIds(*self._to_host(tokens), None, stuck)
        top = logprobs.topk(int(asked.max()), dim=-1)
        # one copy back: ids (exact in float64), the sampled tokens' log-probabilities, the top k's ids and
        # values
        parts = [tokens[:, None], logprobs.gather(1, tokens[:, None]), top.indices, top.values]
        return SampledIds(*self._to_host(torch.cat([part.double() for part in parts], 1)), asked.tolist(),
                          stuck)

    def _noise(self, logits: Tensor, sequences: list[Sequence]) -> Tensor:
        """Exponential noise for the sampling race: one draw for the batch, and rows of seeded requests from
        their own generator, [n, vocab] at a time for a request's n samples, as generate(num_samples=n) draws
        it, so that seeded results agree."""
        noise = torch.empty(logits.shape, device=logits.device).exponential_(1)
        seeded: dict = {}
        for row, sequence in enumerate(sequences):
            if sequence.group.generator is not None:
                seeded.setdefault(sequence.group, []).append((row, sequence.index))
        if seeded:
            draws = []
            rows = []
            picks = []
            start = 0
            for group, places in seeded.items():
                draw = torch.empty(group.params.n, logits.shape[1], device=logits.device)
                draws.append(draw.exponential_(1, generator=group.generator))
                rows += [row for row, _ in places]
                picks += [start + index for _, index in places]
                start += group.params.n
            noise[self.inputs.index(rows)] = torch.cat(draws)[self.inputs.index(picks)]
        return noise

    def _matcher(self, sequence: Sequence):
        """The sequence's grammar state (made at its first token), or None when its request is
        unconstrained."""
        if sequence.group.grammar is not None and sequence.matcher is None:
            sequence.matcher = matcher(sequence.group.grammar)
        return sequence.matcher

    def _bitmask(self, vocab_size: int) -> Tensor:
        """The pinned buffer structured-output masks are filled into: one row of 32-token words per row."""
        if self.bitmask is None:
            self.bitmask = torch.zeros(self.inputs.max_rows, -(-vocab_size // 32), dtype=torch.int32,
                                       pin_memory=self.device.type == "cuda")
        return self.bitmask

    def _to_host(self, sampled: Tensor) -> tuple[Tensor, torch.cuda.Event | None]:
        """`sampled` on its way to the host: a non-blocking copy into the next of the pinned buffers, and the
        event of that copy (on a CPU: the tensor itself, and no event)."""
        ready = self.sampled_ready[self.sampled_turn]
        if ready is None:
            return sampled, None
        host = self.sampled[self.sampled_turn].view(sampled.dtype)[: sampled.numel()].view(sampled.shape)
        self.sampled_turn ^= 1
        host.copy_(sampled, non_blocking=True)
        ready.record()
        return host, ready

    def _decode(self, inputs: StepInputs) -> Tensor:
        tensors = (inputs.tokens, inputs.block_table, inputs.slot_mapping, inputs.positions,
                   inputs.query_start, inputs.context_lens)
        if self.settings.compile_decode:  # sizes symbolic from the first call on: one compile for all batches
            for tensor in tensors:
                for dim in range(tensor.dim()):
                    torch._dynamo.maybe_mark_dynamic(tensor, dim)
        return self.decode_hidden(*tensors)

    def _decode_hidden(self, tokens: Tensor, block_table: Tensor, slot_mapping: Tensor, positions: Tensor,
                       query_start: Tensor, context_lens: Tensor, gather: GatherPlan | None = None,
                       sparse: SparseIndex | None = None) -> Tensor:
        """The final hidden states [S, hidden] of S decode rows (one token each). Compiled, a function of
        tensors alone: only the eager gathered path passes a gather plan, and the sparse path its index."""
        layout = self.layout(block_table, slot_mapping, positions, query_start, context_lens, 1,
                             **self._extra(gather=gather, index=sparse))
        return self.model.hidden_states(self.model.embed_tokens(tokens), self.pools, layout)

    def _grouped_decode(self, decodes: list[Sequence]) -> Tensor:
        """The eager gathered decode: its rows sorted by table length, so that each group of them gathers
        only the blocks its own longest table spans (with 64 sequences of 32-512 tokens that halves what a
        step gathers); the hidden states come back in the order of `decodes`."""
        lengths = np.fromiter((len(sequence.table) for sequence in decodes), np.int64, len(decodes))
        order = np.argsort(lengths, kind="stable")
        inputs = self.inputs.decode_inputs([decodes[i] for i in order])
        ends, widths = row_groups(lengths[order])
        gather = self._gather_plan(ends, widths)
        hidden = self._decode_hidden(inputs.tokens, inputs.block_table, inputs.slot_mapping, inputs.positions,
                                     inputs.query_start, inputs.context_lens, gather)
        return hidden[self.inputs.index(np.argsort(order))]

    def _sparse_decode(self, decodes: list[Sequence]) -> Tensor:
        """The sparse path's decode: every layer reads the pool in place through one index of the call."""
        inputs = self.inputs.decode_inputs(decodes)
        pool = self.pools[0]["key"]
        index = sparse_index(inputs.block_table, inputs.context_lens, inputs.context_total,
                             self.model.kv.heads, pool.shape, pool.dtype)
        return self._decode_hidden(inputs.tokens, inputs.block_table, inputs.slot_mapping, inputs.positions,
                                   inputs.query_start, inputs.context_lens, sparse=index)

    def _gather_plan(self, ends: tuple[int, ...], widths: tuple[int, ...]) -> GatherPlan:
        """A plan for groups of rows ending at `ends`, each gathering `widths` blocks, with the runner's
        gather buffer grown (never shrunk) to the largest group's keys and values."""
        pool = self.pools[0]["key"]
        rows = max((end - start) * width for start, end, width in zip((0, *ends[:-1]), ends, widths))
        needed = 2 * rows * math.prod(pool.shape[1:])
        if self.gather_space is None or self.gather_space.numel() < needed:
            self.gather_space = None  # the old buffer freed before the new one is made
            self.gather_space = torch.empty(needed, dtype=pool.dtype, device=pool.device)
        return GatherPlan(ends, widths, self.gather_space)

    def _graphed_decode(self, rows: int) -> Tensor:
        return self._decode(self.inputs.decode_views(rows, self.inputs.max_blocks))

    def _prefill(self, inputs: StepInputs) -> Tensor:
        """The hidden states of each prompt chunk's last token: the embeddings (image features spliced in),
        then the blocks, compiled with compile_prefill, else with a gather plan where the path gathers."""
        features = None
        if inputs.image_chunks:
            features = torch.cat([self._features(seq)[lo:hi] for seq, lo, hi in inputs.image_chunks])
        args = (self.model.embed(inputs.tokens, features, inputs.image_slots), inputs.block_table,
                inputs.slot_mapping, inputs.positions, inputs.query_start, inputs.context_lens,
                inputs.max_query_len)
        if self.settings.compile_prefill:
            return self.prefill_hidden(*args)[inputs.last]
        plan = None
        if self.prefill_layout is Gathered:
            plan = self._gather_plan((len(inputs.last),), (inputs.block_table.shape[1],))
        return self._prefill_hidden(*args, plan)[inputs.last]

    def _compile_prefill(self) -> None:
        """Compile the prompt chunks' forward now, not in the first request's step, on null chunks of sizes
        that differ from one another (2 sequences of 1 and 4 tokens, tables FIRST_PADDED_WIDTH wide: dynamo
        takes sizes equal when first seen for one symbol)."""
        inputs = self.inputs.prefill_inputs([(None, 1), (None, 4)], padded=True)
        width = min(FIRST_PADDED_WIDTH, self.inputs.max_blocks)
        inputs.block_table = inputs.block_table.new_zeros(2, width)  # the null seat's rows, that wide
        if width < FIRST_PADDED_WIDTH:  # a context that short: calls take every column, a constant
            torch._dynamo.mark_static(inputs.block_table, 1)
        for pool in self.pools:  # constants, not symbols that could take another size's
            for tensor in pool.values():
                torch._dynamo.mark_static(tensor)
        self._prefill(inputs)

    def _prefill_hidden(self, embeddings: Tensor, block_table: Tensor, slot_mapping: Tensor,
                        positions: Tensor, query_start: Tensor, context_lens: Tensor, max_query_len: int,
                        gather: GatherPlan | None = None) -> Tensor:
        """The final hidden states [N, hidden] of a call's packed prompt chunks (embeddings [1, N, hidden]).
        Compiled, a function of tensors and max_query_len alone: only the eager gathered path passes a gather
        plan."""
        layout = self.prefill_layout(block_table, slot_mapping, positions, query_start, context_lens,
                                     max_query_len, **self._extra(gather=gather))
        return self.model.hidden_states(embeddings, self.pools, layout)

    @staticmethod
    def _extra(**host_known) -> dict:
        """A layout's host-known extras (a gather plan, a sparse index), those given."""
        return {name: value for name, value in host_known.items() if value is not None}

    def _features(self, sequence: Sequence) -> Tensor:
        group = sequence.group
        if group.features is None:
            group.features = self.model.image_features(group.images)
        return group.features
