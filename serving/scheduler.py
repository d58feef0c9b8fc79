"""Continuous batching: which sequences run in the next step, and how many of their tokens.

Requests join and leave the running batch at every step (Orca, Yu et al. OSDI 2022; vLLM). Each step first
gives every decoding sequence its one token, then fills the rest of the token budget with prompt chunks
(chunked prefill: a long prompt is computed over several steps, so running decodes never stall behind it),
oldest request first. When the KV cache has no block for a decode, the newest running request is preempted:
its blocks are freed and it waits at the front of the queue, to be recomputed (prompt and tokens so far) when
blocks free up.

A request holds a seat per sample (`max_num_seqs` in all) from admission to its end; the step says which
sequences were admitted and preempted, so the runner can give them input rows or take those back.

With CUDA graphs a decode-only step replays a graph, but a step with prompt chunks runs them eagerly, ~4x its
cost: a full batch admitting each request as a seat frees would keep nearly every step eager. So while
sequences decode, waiting requests join in batches of `admission_batch` seats (or what the queue's head wants,
if less), or after MAX_HELD_STEPS steps held back (as TGI's max_waiting_tokens).
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections import deque

from serving.block_manager import BlockManager
from serving.sequence import RequestState, Sequence, Status

MAX_HELD_STEPS = 16


@dataclasses.dataclass
class ScheduledStep:
    """One step's work: decoding sequences (one token each), prompt chunks (sequence, tokens to compute), the
    copy-on-write block copies to make first, and the sequences admitted (or preempted) while scheduling."""

    decodes: list[Sequence] = dataclasses.field(default_factory=list)
    prefills: list[tuple[Sequence, int]] = dataclasses.field(default_factory=list)
    copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    admitted: list[Sequence] = dataclasses.field(default_factory=list)
    preempted: list[Sequence] = dataclasses.field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefills


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_batch_tokens: int,
                 admission_batch: int = 1) -> None:
        """The sizes as a ServingConfig checks them (serving/config.py): max_batch_tokens >= max_num_seqs
        >= admission_batch >= 1."""
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_batch_tokens = max_batch_tokens
        self.admission_batch = admission_batch
        self.held = 0  # steps in a row that held waiting requests back
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []  # oldest first
        self.num_preemptions = 0
        # sequences the running requests hold (n for a request whose samples have not forked yet)
        self.seats = 0

    def add(self, group: RequestState) -> None:
        self.waiting.append(group)

    def remove(self, group: RequestState) -> None:
        """Drop a finished or aborted request and free its blocks."""
        for sequence in group.sequences:
            self.blocks.release(sequence.table)
        if group.status is Status.RUNNING:
            self.running.remove(group)
            self.seats -= self._seats(group)
        elif group in self.waiting:
            self.waiting.remove(group)
        group.status = Status.FINISHED

    def finish(self, sequence: Sequence) -> None:
        """One sample of a running request is done: its blocks and seat are free (its request may go on)."""
        self.blocks.release(sequence.table)
        self.seats -= 1

    def schedule(self) -> ScheduledStep:
        step = ScheduledStep()
        budget = self.max_batch_tokens
        prompts = []
        for group in list(self.running):  # decodes, oldest request first
            if group.status is not Status.RUNNING:
                continue  # preempted for an older request's decode
            decodes, copies = [], []
            for sequence in group.sequences:
                if sequence.finish_reason is not None:
                    continue
                if not sequence.decoding:
                    prompts.append(sequence)
                    continue
                if sequence.num_tokens >= group.max_length:
                    continue  # its token in flight ends it (an overlapped step's)
                if self.blocks.needs_block(sequence.table, sequence.num_computed):
                    if not self._make_room(sequence, group, step):
                        break  # the request itself was preempted: none of its decodes run
                    copy = self.blocks.append_slot(sequence.table, sequence.num_computed)
                    if copy:
                        copies.append(copy)
                decodes.append(sequence)
            else:
                step.decodes += decodes
                step.copies += copies
                budget -= len(decodes)
        for sequence in prompts:  # prompt chunks of admitted requests
            if budget and sequence.group.status is Status.RUNNING:
                count = min(sequence.num_pending, budget)
                step.prefills.append((sequence, count))
                budget -= count
        if not self.waiting:
            self.held = 0  # the count is of steps in a row that held a waiting request back
        admitting = budget and self.waiting and self._admitting(decoding=bool(step.decodes))
        while admitting and budget and self.waiting and self._admit(self.waiting[0], step):
            group = self.waiting.popleft()
            for sequence in group.live:
                count = min(sequence.num_pending, budget)
                if count:
                    step.prefills.append((sequence, count))
                    budget -= count
        return step

    def may_preempt(self) -> bool:
        """Whether the next step's decodes might not all find a block without preempting: each that needs
        one (a new block, or a copy of a shared last one) takes one, and only there does `schedule` preempt.
        Until a step's sampled ids are read, the sequences waiting on them must not be preempted."""
        blocks = self.blocks
        if blocks.num_free >= self.seats:  # every seat could take one
            return False
        needed = sum(blocks.needs_block(sequence.table, sequence.num_computed)
                     for group in self.running for sequence in group.live if sequence.decoding)
        return blocks.num_free < needed

    def fork(self, group: RequestState) -> list[Sequence]:
        """The prompt is done: the request's other n - 1 samples start here, sharing its blocks (their seats
        were held since admission)."""
        parent = group.sequences[0]
        children = [Sequence(group, index, list(parent.tokens), list(parent.keys),
                             table=self.blocks.fork(parent.table), hashes=list(parent.hashes),
                             num_computed=parent.num_computed, num_registered=parent.num_registered)
                    for index in range(1, group.params.n)]
        group.sequences += children
        group.forked = True
        return children

    def _seats(self, group: RequestState) -> int:
        return len(group.live) if group.forked else group.params.n

    def _make_room(self, sequence: Sequence, group: RequestState, step: ScheduledStep) -> bool:
        """Preempt the newest running requests until `sequence` can take its next slot; False if it was itself
        preempted."""
        while not self.blocks.can_append(sequence.table, sequence.num_computed):
            victim = max(self.running, key=lambda g: g.arrival)
            self._preempt(victim, step)
            if victim is group:
                return False
        return True

    def _preempt(self, group: RequestState, step: ScheduledStep) -> None:
        for sequence in group.live:
            self.blocks.release(sequence.table)
            sequence.num_computed = sequence.num_registered = 0
            step.preempted.append(sequence)
        self.running.remove(group)
        self.seats -= self._seats(group)
        group.status = Status.WAITING
        self.waiting.appendleft(group)
        self.num_preemptions += 1

    def _admitting(self, decoding: bool) -> bool:
        """Whether waiting requests may join this step (see the module's docstring)."""
        free = self.max_num_seqs - self.seats
        if not decoding:
            self.held = 0
            return True
        if not free:
            return False  # nothing could join: not a step held back
        wanted = sum(self._seats(group) for group in itertools.islice(self.waiting, self.admission_batch))
        if free >= min(self.admission_batch, wanted) or self.held >= MAX_HELD_STEPS:
            self.held = 0
            return True
        self.held += 1
        return False

    def _admit(self, group: RequestState, step: ScheduledStep) -> bool:
        """Give each live sequence of `group` blocks for all its tokens (cached prefix blocks reused), or
        nothing."""
        seats = self._seats(group)
        if self.seats + seats > self.max_num_seqs:
            return False
        admitted = []
        for sequence in group.live:
            allocated = self.blocks.allocate_prompt(sequence.keys, sequence.hashes)
            if allocated is None:
                for done in admitted:
                    self.blocks.release(done.table)
                    done.num_computed = 0
                return False
            sequence.table, sequence.num_computed = allocated
            sequence.num_registered = 0
            admitted.append(sequence)
        if group.num_cached is None:
            group.num_cached = group.sequences[0].num_computed
        group.status = Status.RUNNING
        bisect.insort(self.running, group, key=lambda g: g.arrival)
        self.seats += seats
        step.admitted += admitted
        return True
