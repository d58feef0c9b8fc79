"""Streamed training data: parquet shards (local, or the hub's through `hf://`) read a row group at a time,
in FineVision's layout (images, texts, per-turn quality ratings, source) or the_cauldron's (images, texts),
mixed by weight, split across ranks and DataLoader workers, shuffled through a buffer, and resumable exactly.

    config = StreamConfig(files="shards/*.parquet", layout="finevision", min_relevance=3)
    sources = [Source.open(config)]
    reader = SlotReader(sources, slot=0, slots=1, seed=0, buffer_size=1000)
    key, record = next(reader)          # record in the_cauldron format, images still encoded
    saved = reader.state()              # JSON; SlotReader(..., state=saved) goes on with the next sample

Units of work are parquet row groups. Epoch e orders every source's row groups by a permutation seeded by
(seed, e), and slot s of `slots` (a rank's DataLoader worker: rank x workers + worker) reads every slots-th of
them, so each row of an epoch is read by exactly one slot. Rows pass through a shuffle buffer of
`buffer_size` (as `datasets`' `IterableDataset.shuffle`), flushed shuffled at the end of each epoch.

Why pyarrow, not `datasets.load_dataset(..., streaming=True)`: `IterableDataset.state_dict()` does not keep a
shuffle buffer's contents (its documentation: a resumed shuffled stream does not continue exactly), and it
splits a stream among workers by whole files, which cannot feed ranks x workers from a dataset of few files.
Here the state is the epoch, the unit and row reached, the generators' states and the buffer's sample ids: a
few KiB, and a resumed stream continues with exactly the samples, in the order, that it would have.
"""

from __future__ import annotations

import dataclasses
import random
from collections import defaultdict
from collections.abc import Iterator
from typing import Any, Literal

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from models.errors import TinyVLMError
from typed_config import Config, ConfigError, check, one_line

RATINGS = ("relevance", "image_correspondence", "visual_dependency", "formatting")
# Columns a record keeps where every file of its source has them, in either layout: the held-out scores'
# question types, and the synthetic scenes' per-cell labels that the ViT's "cells" pre-training learns from.
PASSED = {"question_type": pa.string(), "cell_labels": pa.list_(pa.list_(pa.int64()))}
Key = str  # a sample's id: "<file's path>#<row in the file>"


class StreamError(TinyVLMError, ValueError):
    """Streamed shards that cannot be listed or read."""


@dataclasses.dataclass
class StreamConfig(Config):
    """One streamed source: parquet shards in FineVision's or the_cauldron's layout, JSONL files or an image
    folder."""

    # a glob of parquet files, local or on the hub, e.g. hf://datasets/HuggingFaceM4/FineVision/ai2d_merged/*.parquet;
    # a glob of JSONL files (*.jsonl, data.source=jsonl's records); or an image folder (or its metadata.jsonl)
    files: str = ""
    # finevision: images, texts, source and per-turn <rating>_ratings; cauldron: images and texts
    layout: Literal["finevision", "cauldron"] = "cauldron"
    weight: float = 1.0  # the share of samples drawn from this source is weight / (the sources' weights)
    # FineVision's ratings (1-5, per turn): a turn rated under a minimum is dropped, as nanoVLM does, and a
    # record left with no turn is skipped (counted as filtered, not bad); 0 keeps every turn
    min_relevance: int = 0
    min_image_correspondence: int = 0
    min_visual_dependency: int = 0
    min_formatting: int = 0

    def __post_init__(self) -> None:
        check(bool(self.files), "data.streams[].files: a glob of parquet or JSONL files, or an image folder, "
              "is needed")
        check(self.weight > 0, f"data.streams[].weight must be positive, got {self.weight}")
        for rating in RATINGS:
            minimum = getattr(self, f"min_{rating}")
            check(0 <= minimum <= 5, f"data.streams[].min_{rating} must lie in [0, 5], got {minimum}")
            check(minimum == 0 or self.layout == "finevision",
                  f"data.streams[].min_{rating}: the_cauldron's layout has no ratings (layout: finevision)")

    def minimums(self) -> dict[str, int]:
        """The ratings filtered on, with their minimums."""
        minimums = {rating: getattr(self, f"min_{rating}") for rating in RATINGS}
        return {rating: minimum for rating, minimum in minimums.items() if minimum}


@dataclasses.dataclass(frozen=True)
class Unit:
    """Rows [start, stop) of one row group of one parquet file; `offset` is the row group's first row in
    the file."""

    file: str
    row_group: int
    offset: int
    start: int
    stop: int


class Source:
    """A streamed source's row groups and how its rows become records."""

    def __init__(self, config: StreamConfig, units: list[Unit], filesystem: fsspec.AbstractFileSystem,
                 passed: tuple[str, ...] = ()):
        self.config, self.units, self.filesystem, self.passed = config, units, filesystem, passed
        self.name = config.files

    @staticmethod
    def columns(config: StreamConfig) -> list[str]:
        """The columns the config's layout needs."""
        ratings = ["source"] + [f"{rating}_ratings" for rating in RATINGS]
        return ["images", "texts"] + (ratings if config.layout == "finevision" else [])

    @classmethod
    def open(cls, config: StreamConfig, skip: int = 0) -> Source:
        """The source's files listed (in name order) with their row groups, the first `skip` rows left out
        (held out for validation). Files that cannot be listed or read (offline, not parquet) raise
        StreamError. JSONL files and image folders are data/jsonl_stream.py and data/imagefolder_stream.py
        sources (data/sources.py `open_stream` picks)."""
        where, metadata = config.files, {}
        try:
            filesystem, pattern = fsspec.core.url_to_fs(config.files)
            paths = sorted(filesystem.glob(pattern))
            for where in paths:
                with filesystem.open(where) as file:
                    metadata[where] = pq.ParquetFile(file).metadata
        except (OSError, ValueError, pa.ArrowException) as e:  # offline, a missing repository, not parquet
            raise StreamError(f"data.streams[].files: {where} could not be read "
                              f"({type(e).__name__}: {one_line(e)})") from None
        check(bool(paths), f"data.streams[].files: no parquet file matches {config.files}")
        columns = cls.columns(config)
        names = [metadata[path].schema.to_arrow_schema().names for path in paths]
        for path, present in zip(paths, names):
            missing = [name for name in columns if name not in present]
            if missing:
                raise ConfigError(f"data.streams[].files: {path} has no column {missing[0]!r}, which layout "
                                  f"{config.layout} needs")
        passed = tuple(name for name in PASSED if all(name in present for present in names))
        units, seen = [], 0  # seen: the source's rows before the row group
        for path in paths:
            offset = 0
            for group in range(metadata[path].num_row_groups):
                rows = metadata[path].row_group(group).num_rows
                start = min(rows, max(0, skip - seen))
                if start < rows:
                    units.append(Unit(path, group, offset, start, rows))
                offset, seen = offset + rows, seen + rows
        return cls(config, units, filesystem, passed)

    def read(self, unit: Unit, rows: list[int] | None = None) -> Iterator[tuple[Key, dict[str, Any]]]:
        """(key, raw row) for the unit's rows (or only `rows`, positions in the row group), in order."""
        with self.filesystem.open(unit.file) as file:
            table = pq.ParquetFile(file).read_row_group(unit.row_group,
                                                        columns=[*self.columns(self.config), *self.passed])
        for row in range(unit.start, unit.stop) if rows is None else rows:
            yield f"{unit.file}#{unit.offset + row}", table.slice(row, 1).to_pylist()[0]

    def read_keys(self, keys: list[Key]) -> dict[Key, dict[str, Any]]:
        """The raw rows of `keys` (of this source's units), read a unit at a time."""
        by_file: dict[str, list[tuple[int, Any]]] = defaultdict(list)
        for index, unit in enumerate(self.units):
            by_file[unit.file].append((index, unit))
        wanted: dict[int, list[int]] = defaultdict(list)
        for key in keys:
            file, _, number = key.rpartition("#")
            found = next(((index, unit) for index, unit in by_file.get(file, [])
                          if unit.offset + unit.start <= int(number) < unit.offset + unit.stop), None)
            if found is None:
                raise StreamError(f"{key}: no such sample in {self.name}; were its files changed during the "
                                  "run?")
            wanted[found[0]].append(int(number) - found[1].offset)
        return {key: row for index, rows in wanted.items()
                for key, row in self.read(self.units[index], sorted(rows))}

    def rows(self) -> Iterator[tuple[Key, dict[str, Any]]]:
        """(key, raw row) of every row, in file order."""
        return (item for unit in self.units for item in self.read(unit))

    def head(self, count: int) -> list[dict[str, Any]]:
        """The records of the source's first `count` rows, in file order (less those the ratings emptied)."""
        rows = (row for _, (_, row) in zip(range(count), self.rows()))
        return [record for row in rows if (record := self.record(row)) is not None]

    def record(self, row: dict[str, Any]) -> dict[str, Any] | None:
        """The row as a record (images still encoded; data/bad_records.py checks and decodes them), its
        turns filtered by the configured minimum ratings, with the PASSED columns the source has; None when no
        turn is left."""
        record = {"images": row["images"], "texts": row["texts"], **{name: row[name] for name in self.passed}}
        if self.config.layout == "cauldron":
            return record
        minimums = self.config.minimums()
        if minimums and isinstance(row["texts"], list):
            record["texts"] = [turn for index, turn in enumerate(row["texts"])
                               if all(_rating(row, rating, index) >= minimum
                                      for rating, minimum in minimums.items())]
        record["source"] = row["source"]
        return record if record["texts"] != [] else None


def _rating(row: dict[str, Any], rating: str, turn: int) -> float:
    """A turn's rating; an unrated turn (no list, or None) passes every minimum, as in nanoVLM."""
    ratings = row.get(f"{rating}_ratings")
    value = ratings[turn] if isinstance(ratings, list) and turn < len(ratings) else None
    return float("inf") if value is None else value


def check_readers(source: Source, slots: int) -> None:
    """Refuse more readers than the source has row groups: some would have nothing to read."""
    check(len(source.units) >= slots,
          f"{source.name}: {len(source.units)} parquet row groups cannot feed {slots} readers (ranks x "
          "DataLoader workers): write smaller row groups or use fewer workers")


class SourceStream:
    """One source's rows for slot `slot` of `slots`, endless (epoch after epoch) or for `epochs` epochs:
    (unit index, row, key, raw row) items through a shuffle buffer. `state()` after any item, given back as
    `state`, continues with the next."""

    def __init__(self, source: Source, slot: int, slots: int, seed: int, buffer_size: int,
                 state: dict[str, Any] | None = None, epochs: int | None = None):
        check_readers(source, slots)
        self.source, self.slot, self.slots, self.seed = source, slot, slots, seed
        self.buffer_size, self.epochs = max(buffer_size, 1), epochs
        self.epoch, self.position, self.row = 0, 0, 0
        self.rng = random.Random(f"{seed}:{slot}")
        self.buffer: list[tuple[int, int, Key, dict[str, Any]]] = []
        if state is not None:
            self._restore(state)
        self._items = self._iterate()

    def __iter__(self) -> Iterator[tuple[Key, dict[str, Any]]]:
        return self

    def __next__(self) -> tuple[Key, dict[str, Any]]:
        return next(self._items)

    def _order(self, epoch: int) -> list[int]:
        """The unit indices this slot reads in `epoch`, in order."""
        order = list(range(len(self.source.units)))
        random.Random(f"{self.seed}:epoch:{epoch}").shuffle(order)
        return order[self.slot::self.slots]

    def _iterate(self) -> Iterator[tuple[Key, dict[str, Any]]]:
        while self.epochs is None or self.epoch < self.epochs:
            order = self._order(self.epoch)
            while self.position < len(order):
                unit = order[self.position]
                rows = self.source.units[unit]
                for key, row in self.source.read(rows, list(range(rows.start + self.row, rows.stop))):
                    item = (unit, rows.start + self.row, key, row)
                    self.row += 1
                    if len(self.buffer) < self.buffer_size:
                        self.buffer.append(item)
                        continue
                    index = self.rng.randrange(self.buffer_size)
                    item, self.buffer[index] = self.buffer[index], item
                    yield item[2], item[3]
                self.position, self.row = self.position + 1, 0
                if self.position == len(order):  # the epoch's last rows are in: flush them shuffled
                    self.rng.shuffle(self.buffer)
            while self.buffer:
                _, _, key, row = self.buffer.pop()
                yield key, row
            self.epoch, self.position = self.epoch + 1, 0

    def state(self) -> dict[str, Any]:
        """Where the stream stands (JSON): epoch, unit position and row reached, its generator's state and
        the buffered rows' places."""
        version, internal, gauss = self.rng.getstate()
        return {"epoch": self.epoch, "position": self.position, "row": self.row,
                "rng": [version, list(internal), gauss],
                "buffer": [[unit, row] for unit, row, _, _ in self.buffer]}

    def _restore(self, state: dict[str, Any]) -> None:
        self.epoch, self.position, self.row = state["epoch"], state["position"], state["row"]
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        wanted: dict[int, list[int]] = defaultdict(list)
        for unit, row in state["buffer"]:
            wanted[unit].append(row)
        rows = {(unit, row): item for unit, positions in wanted.items()
                for row, item in zip(sorted(positions), self.source.read(self.source.units[unit],
                                                                         sorted(positions)))}
        self.buffer = [(unit, row, *rows[unit, row]) for unit, row in state["buffer"]]


class SlotReader:
    """What one slot (a rank's DataLoader worker) reads: its share of every source, a source drawn for each
    sample with probability proportional to its weight (a generator seeded by seed and slot); endless.
    Yields (key, record or None): None for a record whose turns the ratings filters all dropped."""

    def __init__(self, sources: list[Source], slot: int, slots: int, seed: int, buffer_size: int,
                 state: dict[str, Any] | None = None):
        self.sources = sources
        self.streams = [SourceStream(source, slot, slots, seed + index, buffer_size,
                                     state and state["sources"][index])
                        for index, source in enumerate(sources)]
        self.weights = [source.config.weight for source in sources]
        self.rng = random.Random(f"{seed}:mix:{slot}")
        if state is not None:
            version, internal, gauss = state["rng"]
            self.rng.setstate((version, tuple(internal), gauss))
        self.source = 0  # the latest sample's source

    def __iter__(self) -> Iterator[tuple[Key, dict[str, Any] | None]]:
        return self

    def __next__(self) -> tuple[Key, dict[str, Any] | None]:
        self.source = self.rng.choices(range(len(self.sources)), self.weights)[0]
        key, row = next(self.streams[self.source])
        return key, self.sources[self.source].record(row)

    def state(self) -> dict[str, Any]:
        version, internal, gauss = self.rng.getstate()
        return {"rng": [version, list(internal), gauss], "sources": [s.state() for s in self.streams]}
