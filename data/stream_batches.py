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

A batch is `batch_size` records packed as the collator packs them, or with `fill_rows=True`
(train.packing=max_length) `batch_size` rows of up to the collator's max_length tokens, filled from a window
of encoded samples whose keys join the slot's position (`StreamedBatches._filled_batches`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info

from data.bad_records import CheckedRecords, Policy
from data.batches import BAD, ERROR, TOO_LONG, _Collate
from data.collator import VQACollator
from data.packing import pack_rows
from data.streaming import Key, SlotReader, Source, check_readers
from models.errors import TinyVLMError

STREAM = "stream"
# train.packing=max_length: the window of encoded samples is refilled to this many batches' worth of tokens
# (batch_size x max_length each) before each batch, so that the rows taken are nearly full
WINDOW_BATCHES = 2


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


class _Slot:
    """One slot's reader, with its checked records and its counts so far (tokens per source, records the
    ratings filters emptied)."""

    def __init__(self, batches: StreamedBatches, slot: int, position: dict[str, Any]) -> None:
        self.slot, self.readers = slot, batches.world_size * batches.workers
        self.sources = batches.sources
        self.reader = SlotReader(batches.sources, slot, self.readers, batches.seed, batches.buffer_size,
                                 position["reader"])
        self.tokens, self.filtered = Counter(position["source_tokens"]), position["filtered"]
        self.latest = _Latest()
        self.checked = CheckedRecords(self.latest, batches.policy, "train", batches.report,
                                      batches.check_texts)

    def next(self) -> tuple[Key, int, dict[str, Any] | None]:
        """The next record that the ratings left a turn: its key, its source's index, and the record checked
        (None: bad, skipped). A bad record under data.on_bad_record=fail raises."""
        while True:
            key, self.latest.record = next(self.reader)
            if self.latest.record is not None:
                return key, self.reader.source, self.checked[key]
            self.filtered += 1

    def restored(self, entries: list[list[Any]]) -> list[tuple[int, Key, dict[str, Any]]]:
        """The records of saved [source index, key] entries, checked, in their order."""
        rows: dict[Key, dict[str, Any]] = {}
        for index, source in enumerate(self.sources):
            rows.update(source.read_keys([key for entry, key in entries if entry == index]))
        restored = []
        for index, key in entries:
            self.latest.record = self.sources[index].record(rows[key])
            restored.append((index, key, self.checked[key]))
        return restored

    def stream(self, keys: list[Key], **position: Any) -> dict[str, Any]:
        """A batch's stream bookkeeping: its slot and sample keys, and the slot's position after it."""
        return {"slot": self.slot, "keys": keys, "position": {
            "reader": self.reader.state(), "readers": self.readers, "source_tokens": dict(self.tokens),
            "filtered": self.filtered, **position}}


class StreamedBatches(IterableDataset):
    """Endless collated batches of the streamed `sources` for one rank; see the module's docstring: each
    batch `batch_size` records packed as the collator packs them, or with `fill_rows`, `batch_size` rows of up
    to the collator's `max_length` tokens, first-fit decreasing from a window of encoded samples (see
    `_filled_batches`). `positions` maps a slot ("0", "1", ...) to the position its batches last reported
    (its reader's state and its counts so far: tokens per source, records filtered; the window's sample
    keys) to continue from."""

    def __init__(self, sources: list[Source], collator: VQACollator, batch_size: int, seed: int,
                 buffer_size: int, policy: Policy, rank: int = 0, world_size: int = 1, num_workers: int = 0,
                 consumed: int = 0, positions: dict[str, Any] | None = None,
                 report: Callable[[str], None] | None = None,
                 check_texts: Callable[[list[dict[str, str]]], None] | None = None, fill_rows: bool = False):
        self.collator = VQACollator.for_encoder(LengthRecorder(collator.encoder), collator.max_length,
                                                collator.padding_side, collator.ensure_image, collator.pack)
        self.sources, self.batch_size, self.fill_rows = sources, batch_size, fill_rows
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
        reader = _Slot(self, slot, position)
        return self._filled_batches(reader, position.get("window", [])) if self.fill_rows else \
            self._batches(reader)

    def _batches(self, slot: _Slot) -> Iterator[dict[str, Any]]:
        """Batches of `batch_size` records, packed (or not) by the collator."""
        collate, recorder = _Collate(self.collator), self.collator.encoder
        while True:
            keys, records, sources, error = [], [], [], None
            while len(keys) < self.batch_size:
                try:
                    key, source, record = slot.next()
                except TinyVLMError as e:  # data.on_bad_record=fail: raised in the training process
                    error = e
                    break
                records.append(record)
                keys.append(key)
                sources.append(self.sources[source].name)
            recorder.lengths.clear()
            batch = collate((keys, records, error))
            too_long = set(batch.get("too_long_record_indices", []))
            encoded = [(key, source) for key, source, record in zip(keys, sources, records)
                       if record is not None]
            for (key, source), length in zip(encoded, recorder.lengths):
                slot.tokens[source] += 0 if key in too_long else length
            batch[STREAM] = slot.stream(keys)
            yield batch

    def _filled_batches(self, slot: _Slot, saved: list[list[Any]]) -> Iterator[dict[str, Any]]:
        """Batches of `batch_size` rows of up to `max_length` tokens: the rows that first-fit decreasing
        (data/packing.py) packs first from a window of encoded samples, which the stream refills to
        WINDOW_BATCHES batches' worth of tokens before each batch; the samples left over stay in it for the
        next. A batch's keys are its samples' keys, row by row; its position adds the window's [source, key]
        entries, which a resumed slot reads, checks and encodes again (`saved`)."""
        capacity = self.collator.max_length
        window = [(source, key, self.collator.encode(record))
                  for source, key, record in slot.restored(saved) if record is not None]
        while True:
            self.collator.encoder.lengths.clear()  # the LengthRecorder's: this loop counts tokens itself
            bad, too_long, tokens = [], [], sum(len(sample[0]) for _, _, sample in window)
            while tokens < WINDOW_BATCHES * self.batch_size * capacity:
                try:
                    key, source, record = slot.next()
                except TinyVLMError as e:  # data.on_bad_record=fail: raised in the training process
                    yield {ERROR: e}
                    return
                sample = None if record is None else self.collator.encode(record)
                if sample is None or len(sample[0]) > capacity:
                    (bad if sample is None else too_long).append(key)
                    continue
                window.append((source, key, sample))
                tokens += len(sample[0])
            rows = pack_rows([len(sample[0]) for _, _, sample in window], capacity)[:self.batch_size]
            batch = self.collator.assemble([sample for _, _, sample in window], rows)
            taken = [index for row in rows for index in row]
            for index in taken:
                source, _, sample = window[index]
                slot.tokens[self.sources[source].name] += len(sample[0])
            keys, left = [window[index][1] for index in taken], set(range(len(window))) - set(taken)
            window = [entry for index, entry in enumerate(window) if index in left]
            yield {**batch, BAD: bad, TOO_LONG: too_long,
                   STREAM: slot.stream(keys, window=[[source, key] for source, key, _ in window])}


def take_stream(batch: dict[str, Any]) -> dict[str, Any] | None:
    """Pop a streamed batch's stream bookkeeping (None for a batch of the in-memory path): its slot, its
    sample keys, and the slot's position after it (reader state; tokens per source and records filtered by
    the ratings so far)."""
    return batch.pop(STREAM, None)
