"""The training DataLoader over streamed sources (data/streaming.py): each DataLoader worker of each rank
reads its own slot of the stream, checks, encodes and collates its batches, and each batch brings back
where its slot's stream stands after it, for the checkpoint.

    batches = StreamedBatches(sources, collator, batch_size=32, seed=0, buffer_size=1000, policy="skip",
                              rank=0, world_size=1, num_workers=2, consumed=0, positions={})
    with loader_batches(batches, 2, prefetch_factor=2, pin_memory=False, batch_size=None) as loader:
        batch = next(loader)          # data.batches.take_bookkeeping(batch), then take_stream(batch)

Slots: rank r's worker w reads slot r x W + (w + consumed) mod W (W workers, at least 1). A DataLoader hands
out its workers' batches in turn, worker 0 first, so batch k of a rank comes from slot k mod W of its W: a
run resumed after `consumed` batches, its workers renumbered from 0, starts where the uninterrupted run's
next batch would have come from.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info

from data.bad_records import CheckedRecords, Policy
from data.batches import _Collate
from data.collator import VQACollator
from data.streaming import SlotReader, Source, check_readers
from models.errors import TinyVLMError

STREAM = "stream"


class _Latest:
    """The one record `CheckedRecords` is about to read (it reads `dataset[key]`)."""

    record: dict[str, Any] | None = None

    def __getitem__(self, key: str) -> dict[str, Any] | None:
        return self.record


class LengthRecorder:
    """A conversation encoder that notes the length of every conversation it encodes (the collator's encoder
    wrapped: the tokens each source contributes are counted without encoding twice)."""

    def __init__(self, encoder) -> None:
        self.encoder, self.lengths = encoder, []

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # unpickling in a worker looks for __setstate__ before `encoder` is set
            raise AttributeError(name)
        return getattr(self.encoder, name)

    def encode_conversation(self, *args, **kwargs):
        ids, targets, pixels = self.encoder.encode_conversation(*args, **kwargs)
        self.lengths.append(len(ids))
        return ids, targets, pixels


class StreamedBatches(IterableDataset):
    """Endless collated batches of `batch_size` records of the streamed `sources` for one rank; see the
    module's docstring. `positions` maps a slot ("0", "1", ...) to the position its batches last reported
    (its reader's state and its counts so far: tokens per source, records filtered) to continue from."""

    def __init__(self, sources: list[Source], collator: VQACollator, batch_size: int, seed: int,
                 buffer_size: int, policy: Policy, rank: int = 0, world_size: int = 1, num_workers: int = 0,
                 consumed: int = 0, positions: dict[str, Any] | None = None,
                 report: Callable[[str], None] | None = None,
                 check_texts: Callable[[list[dict[str, str]]], None] | None = None):
        self.collator = VQACollator.for_encoder(LengthRecorder(collator.encoder), collator.max_length,
                                                collator.padding_side, collator.ensure_image, collator.pack)
        self.sources, self.batch_size = sources, batch_size
        self.seed, self.buffer_size, self.policy = seed, buffer_size, policy
        self.rank, self.world_size, self.workers = rank, world_size, max(num_workers, 1)
        self.consumed, self.positions = consumed, positions or {}
        for source in sources:  # here, not in a worker, whose error would come with a traceback
            check_readers(source, world_size * self.workers)
        self.report, self.check_texts = report, check_texts

    def slot(self, worker: int) -> int:
        return self.rank * self.workers + (worker + self.consumed) % self.workers

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        slot = self.slot(info.id if info is not None else 0)
        position = self.positions.get(str(slot), {"reader": None, "source_tokens": {}, "filtered": 0})
        reader = SlotReader(self.sources, slot, self.world_size * self.workers, self.seed, self.buffer_size,
                            position["reader"])
        tokens, filtered = Counter(position["source_tokens"]), position["filtered"]
        latest = _Latest()
        checked = CheckedRecords(latest, self.policy, "train", self.report, self.check_texts)
        collate, recorder = _Collate(self.collator), self.collator.encoder
        while True:
            keys, records, sources, error = [], [], [], None
            while len(keys) < self.batch_size:
                key, latest.record = next(reader)
                if latest.record is None:  # every turn under the ratings' minimums
                    filtered += 1
                    continue
                try:
                    records.append(checked[key])
                except TinyVLMError as e:  # data.on_bad_record=fail: raised in the training process
                    error = e
                    break
                keys.append(key)
                sources.append(self.sources[reader.source].name)
            recorder.lengths.clear()
            batch = collate((keys, records, error))
            too_long = set(batch.get("too_long_record_indices", []))
            encoded = [(key, source) for key, source, record in zip(keys, sources, records)
                       if record is not None]
            for (key, source), length in zip(encoded, recorder.lengths):
                tokens[source] += 0 if key in too_long else length
            batch[STREAM] = {"slot": slot, "keys": keys, "position": {
                "reader": reader.state(), "readers": self.world_size * self.workers,
                "source_tokens": dict(tokens), "filtered": filtered}}
            yield batch


def take_stream(batch: dict[str, Any]) -> dict[str, Any] | None:
    """Pop a streamed batch's stream bookkeeping (None for a batch of the in-memory path): its slot, its
    sample keys, and the slot's position after it (reader state; tokens per source and records filtered by
    the ratings so far)."""
    return batch.pop(STREAM, None)
