"""The training batch sampler: endless shuffled batches that resume from any sample count, split across
ranks."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


class ResumableBatchSampler(Sampler[list[int]]):
    """Endless shuffled batches for one rank of `world_size`.

    The epochs' permutations (epoch e seeded by seed + e) form one stream of sample indices; global batch k is
    the stream's samples [start + k*G, start + (k+1)*G) with G = batch_size * world_size, and rank r takes the
    r-th slice of it. So a run resumes from any sample count at any world size, and 2 ranks x batch b see
    exactly the samples that 1 rank x batch 2b sees.

    With `lengths` (one per sample), batches are grouped by length to save padding: each window of `group`
    global batches of the stream is sorted by length in buckets of `bucket` (so that records of about the same
    length keep their random order and batches still mix kinds of record), cut into global batches again, and
    those are taken in a seeded shuffled order. The same samples are seen, in batches of similar lengths; a
    run then resumes exactly from any multiple of G (any step), at any world size that keeps G.
    """

    def __init__(self, num_samples: int, batch_size: int, seed: int, start: int = 0, rank: int = 0,
                 world_size: int = 1, lengths: list[int] | None = None, group: int = 16, bucket: int = 64):
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.seed = seed
        self.start = start
        self.rank = rank
        self.world_size = world_size
        self.lengths = lengths
        self.group = group
        self.bucket = bucket
        self._epoch, self._order = None, []

    def __iter__(self) -> Iterator[list[int]]:
        size = self.batch_size * self.world_size  # G: one global batch
        mine = slice(self.rank * self.batch_size, (self.rank + 1) * self.batch_size)
        global_batches = self._plain(size) if self.lengths is None else self._grouped(size)
        return (batch[mine] for batch in global_batches)

    def _plain(self, size: int) -> Iterator[list[int]]:
        for position in itertools.count(self.start, size):
            yield self._stream(position, size)

    def _grouped(self, size: int) -> Iterator[list[int]]:
        first_batch = self.start // size
        for window in itertools.count(first_batch // self.group):
            by_length = sorted(self._stream(window * size * self.group, size * self.group),
                               key=lambda i: self.lengths[i] // self.bucket)
            batches = [by_length[k * size : (k + 1) * size] for k in range(self.group)]
            random.Random(f"{self.seed}:{window}").shuffle(batches)
            yield from batches[max(0, first_batch - window * self.group):]

    def _stream(self, position: int, count: int) -> list[int]:
        """Sample indices at stream positions position .. position + count - 1."""
        indices = []
        for p in range(position, position + count):
            if p // self.num_samples != self._epoch:
                self._epoch = p // self.num_samples
                generator = torch.Generator().manual_seed(self.seed + self._epoch)
                self._order = torch.randperm(self.num_samples, generator=generator).tolist()
            indices.append(self._order[p % self.num_samples])
        return indices
