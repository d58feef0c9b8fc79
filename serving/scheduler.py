"""Continuous batching: which sequences run in the next step, and how many of their tokens.

Requests join and leave the running batch at every step (Orca, Yu et al. OSDI 2022; vLLM). Each step first gives
every decoding sequence its one token, then fills the rest of the token budget with prompt chunks (chunked prefill:
a long prompt is computed over several steps, so running decodes never stall behind it), oldest request first. When
the KV cache has no block for a decode, the newest running request is preempted: its blocks are freed and it waits at
the front of the queue, to be recomputed (prompt and tokens so far) when blocks free up.
"""

from __future__ import annotations

import dataclasses
from collections import deque

from serving.block_manager import BlockManager
from serving.sequence import Group, Sequence, Status


@dataclasses.dataclass
class Step:
    """One step's work: (sequence, tokens to compute) pairs, and copy-on-write block copies to make first."""

    work: list[tuple[Sequence, int]]
    copies: list[tuple[int, int]]


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_batch_tokens: int) -> None:
        if max_batch_tokens < max_num_seqs:
            raise ValueError(f"max_batch_tokens ({max_batch_tokens}) must be >= max_num_seqs ({max_num_seqs}): "
                             f"every running sequence decodes a token each step")
        self.blocks, self.max_num_seqs, self.max_batch_tokens = blocks, max_num_seqs, max_batch_tokens
        self.waiting: deque[Group] = deque()
        self.running: list[Group] = []  # oldest first
        self.num_preemptions = 0

    def add(self, group: Group) -> None:
        self.waiting.append(group)

    def remove(self, group: Group) -> None:
        """Drop a finished or aborted request and free its blocks."""
        for sequence in group.sequences:
            self.blocks.release(sequence.table)
        if group in self.running:
            self.running.remove(group)
        elif group in self.waiting:
            self.waiting.remove(group)
        group.status = Status.FINISHED

    @property
    def num_running_sequences(self) -> int:
        return sum(len(g.live) if g.forked else g.params.n for g in self.running)

    def schedule(self) -> Step:
        budget, work, copies = self.max_batch_tokens, [], []
        for group in list(self.running):  # decodes, oldest request first
            if group.status is not Status.RUNNING:
                continue  # preempted for an older request's decode
            decodes = [s for s in group.live if s.num_pending == 1 and s.num_computed > 0]
            group_copies = []
            for sequence in decodes:
                if not self._make_room(sequence, group):
                    break  # the request itself was preempted: none of its decodes run
                copy = self.blocks.append_slot(sequence.table, sequence.num_computed)
                group_copies += [copy] if copy else []
            else:
                work += [(sequence, 1) for sequence in decodes]
                copies += group_copies
                budget -= len(decodes)
        for group in self.running:  # prompt chunks of admitted requests
            for sequence in group.live:
                if budget and (sequence.num_pending > 1 or sequence.num_computed == 0):
                    count = min(sequence.num_pending, budget)
                    work.append((sequence, count))
                    budget -= count
        while budget and self.waiting and self._admit(self.waiting[0]):
            group = self.waiting.popleft()
            for sequence in group.live:
                count = min(sequence.num_pending, budget)
                if count:
                    work.append((sequence, count))
                    budget -= count
        return Step(work, copies)

    def _make_room(self, sequence: Sequence, group: Group) -> bool:
        """Preempt the newest running requests until `sequence` can take its next slot; False if it was itself
        preempted."""
        while not self.blocks.can_append(sequence.table, sequence.num_computed):
            victim = max(self.running, key=lambda g: g.arrival)
            self._preempt(victim)
            if victim is group:
                return False
        return True

    def _preempt(self, group: Group) -> None:
        for sequence in group.sequences:
            self.blocks.release(sequence.table)
            sequence.num_computed = 0
        self.running.remove(group)
        group.status = Status.WAITING
        self.waiting.appendleft(group)
        self.num_preemptions += 1

    def _admit(self, group: Group) -> bool:
        """Give each live sequence of `group` blocks for all its tokens (cached prefix blocks reused), or nothing."""
        seats = len(group.live) if group.forked else group.params.n
        if self.num_running_sequences + seats > self.max_num_seqs:
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
            admitted.append(sequence)
        group.status = Status.RUNNING
        self.running.append(group)
        self.running.sort(key=lambda g: g.arrival)
        return True
