"""A streamed source of JSONL files (`data.streams[].files: mine/*.jsonl`), in the record format
data/sources.py's `load_jsonl` reads: read a line at a time, never loaded whole, and split, shuffled and
resumed like parquet shards (data/streaming.py), with blocks of lines in place of row groups.

Opening a source reads each file once, a buffered line at a time, and keeps the byte offset of every
LINES_PER_UNIT-th non-blank line (a few bytes per thousand lines): a unit is such a block, read by seeking to
it. A sample's key is `<file>#<its number among the file's non-blank lines>`, as a parquet row's is; a line
that is not a record (not JSON, no turns, a missing image) becomes a record carrying its `problem`, skipped
and counted by data/bad_records.py as in memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec

from data.jsonl_records import read_line
from data.streaming import Key, Source, StreamConfig, StreamError, Unit
from typed_config import check, one_line

LINES_PER_UNIT = 1000  # lines per unit of work (what a reader takes at a time)


@dataclasses.dataclass(frozen=True)
class Block:
    """Where a unit's lines start in its file: the byte offset and the (1-based) line number of its first
    non-blank line."""

    byte: int
    line: int


class JsonlSource(Source):
    """A JSONL source: its blocks of lines, and how a line becomes a record."""

    kind = "JSONL"  # what the files are, in errors
    parse = staticmethod(read_line)  # (line, where, folder, on_bad_record) -> record

    def __init__(self, config: StreamConfig, units: list[Unit], filesystem: fsspec.AbstractFileSystem,
                 blocks: dict[str, list[Block]]):
        super().__init__(config, units, filesystem, passed=("question_type",))
        self.blocks = blocks

    @classmethod
    def open(cls, config: StreamConfig, skip: int = 0) -> JsonlSource:
        """The source's files (in name order) in blocks of LINES_PER_UNIT lines, the first `skip` records left
        out (held out for validation)."""
        check(config.layout == "cauldron", f"data.streams[].files: {config.files} is {cls.kind}, whose "
              "records have no ratings (layout: cauldron)")
        where, indexed, glob = config.files, {}, cls.glob(config.files)
        try:
            filesystem, pattern = fsspec.core.url_to_fs(glob)
            paths = sorted(filesystem.glob(pattern))
            for where in paths:
                indexed[where] = _index(filesystem, where)
        except (OSError, ValueError) as e:  # offline, a missing repository
            raise StreamError(f"data.streams[].files: {where} could not be read "
                              f"({type(e).__name__}: {one_line(e)})") from None
        check(bool(paths), f"data.streams[].files: no JSONL file matches {config.files}")
        units, seen = [], 0
        for path, (blocks, count) in indexed.items():
            for number in range(len(blocks)):
                rows = min(LINES_PER_UNIT, count - number * LINES_PER_UNIT)
                start = min(rows, max(0, skip - seen))
                if start < rows:
                    units.append(Unit(path, number, number * LINES_PER_UNIT, start, rows))
                seen += rows
        return cls(config, units, filesystem, {path: blocks for path, (blocks, _) in indexed.items()})

    @staticmethod
    def glob(files: str) -> str:
        """The glob of the JSONL files a stream's `files` names."""
        return files

    def read(self, unit: Unit, rows: list[int] | None = None) -> Iterator[tuple[Key, dict[str, Any]]]:
        """(key, raw row: the line, where it is and its folder) for the unit's rows (or only `rows`, positions
        in the block), in order."""
        wanted = iter(range(unit.start, unit.stop) if rows is None else rows)
        target, block = next(wanted, None), self.blocks[unit.file][unit.row_group]
        with self.filesystem.open(unit.file, "rb") as file:
            file.seek(block.byte)
            row, line = 0, block.line
            while target is not None:
                text = file.readline().decode("utf-8", errors="replace")
                if not text:  # the file changed since it was indexed
                    raise StreamError(f"{unit.file}: ended before its line {line}; was it changed during the "
                                      "run?")
                if text.strip():
                    if row == target:
                        raw = {"line": text, "where": f"{unit.file}:{line}",
                               "root": str(Path(unit.file).parent)}
                        yield f"{unit.file}#{unit.offset + row}", raw
                        target = next(wanted, None)
                    row += 1
                line += 1

    def record(self, row: dict[str, Any]) -> dict[str, Any]:
        """The line parsed by `parse`, as data/sources.py parses it in memory (a bad one: a record carrying
        its `problem`), its images to be opened from their paths when the record is checked."""
        record = self.parse(row["line"], row["where"], Path(row["root"]), "skip")
        return {**record, "images": [{"bytes": None, "path": path} for path in record["images"]]}


def _index(filesystem: fsspec.AbstractFileSystem, path: str) -> tuple[list[Block], int]:
    """The file's blocks of LINES_PER_UNIT non-blank lines, and its count of non-blank lines."""
    blocks, count, byte = [], 0, 0
    with filesystem.open(path, "rb") as file:
        for number, line in enumerate(file, 1):
            if line.strip():
                if count % LINES_PER_UNIT == 0:
                    blocks.append(Block(byte, number))
                count += 1
            byte += len(line)
    return blocks, count


