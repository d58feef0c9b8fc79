"""Records written as parquet shards, in FineVision's layout (images, texts, source, per-turn ratings and
their minimums) or the_cauldron's (images, texts), as `datasets` stores them (images as {"bytes", "path"}),
with the records' question types and scene labels where they have them: what data/streaming.py streams.

    keys = write_shards(Path("shards"), records, layout="finevision", files=8, rows_per_group=256)

The synthetic shapes set of a config, to train on streamed (configs/tiny-stream.yaml, docs/streaming.md):

    python -m training.write_shards runs/shards/tiny --config configs/tiny.yaml
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import pyarrow as pa
import pyarrow.parquet as pq
from datasets import Dataset, concatenate_datasets
from PIL import Image

from data.streaming import PASSED, RATINGS
from data.synthetic import ShapesConfig, make_shapes_dataset

_TURN = pa.struct([("user", pa.string()), ("assistant", pa.string())])
_IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


def png(image: Image.Image) -> dict:
    """A PIL image as a stored image: its PNG bytes."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return {"bytes": buffer.getvalue(), "path": None}


def write_shards(directory: Path, records: Sequence[dict],
                 layout: Literal["finevision", "cauldron"] = "cauldron", files: int = 1,
                 rows_per_group: int = 1000, source: str = "") -> list[str]:
    """`records` ({"images": [PIL image or {"bytes", "path"}], "texts": [...]}, optionally the PASSED columns
    where the first record has them, and for FineVision optionally "source" and "<rating>_ratings", one per
    turn: 5, the top, where absent) in order over `files` parquet files of `rows_per_group`-row row groups;
    returns the samples' keys as data/streaming.py names them. Only a file's records are held at a time."""
    directory.mkdir(parents=True, exist_ok=True)
    passed = [name for name in PASSED if records and name in records[0]]
    fields = [("images", pa.list_(_IMAGE)), ("texts", pa.list_(_TURN))]
    fields += [(name, PASSED[name]) for name in passed]
    if layout == "finevision":
        fields += [("source", pa.string())]
        fields += [field for rating in RATINGS
                   for field in ((f"{rating}_ratings", pa.list_(pa.int64())), (f"{rating}_min", pa.int64()))]
    per_file = -(-len(records) // files)
    keys = []
    for number in range(files):
        chunk = records[number * per_file:(number + 1) * per_file]
        name = f"train-{number:05d}-of-{files:05d}.parquet"
        rows = [_row(record, layout, source, passed) for record in chunk]
        table = pa.Table.from_pylist(rows, schema=pa.schema(fields))
        pq.write_table(table, directory / name, row_group_size=rows_per_group)
        keys += [f"{(directory / name).absolute()}#{row}" for row in range(len(chunk))]
    return keys


def _row(record: dict, layout: str, source: str, passed: list[str]) -> dict:
    images = [png(image) if isinstance(image, Image.Image) else image for image in record["images"] or []]
    row = {"images": images, "texts": record["texts"], **{name: record[name] for name in passed}}
    if layout == "finevision":
        row["source"] = record.get("source", source)
        for rating in RATINGS:
            ratings = record.get(f"{rating}_ratings", [5] * len(record["texts"]))
            row[f"{rating}_ratings"], row[f"{rating}_min"] = ratings, min(ratings, default=None)
    return row


class DatasetRecords(Sequence):
    """A `datasets.Dataset`'s records as a sequence, a slice read at a time (for `write_shards`)."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        if isinstance(index, slice):
            rows = range(len(self))[index]
            return list(self.dataset.select(rows)) if rows else []
        return self.dataset[index]


def write_synthetic_shards(directory: Path, shapes: ShapesConfig, files: int = 8,
                           rows_per_group: int = 500) -> list[str]:
    """The synthetic shapes set `shapes` describes (the same records as in memory, with their scene labels),
    validation records first, then training records: streamed with `data.holdout` set to
    `shapes.num_validation`, the first rows are the validation split, the rest the training split. Returns
    the keys."""
    common = dict(seed=shapes.seed, image_size=shapes.image_size, noise=shapes.noise,
                  validation_fraction=shapes.validation_fraction, labels=True)
    validation = make_shapes_dataset("validation", shapes.num_validation, turns=1, **common)
    train = make_shapes_dataset("train", shapes.num_train, turns=shapes.train_turns,
                                question_types=shapes.train_question_types, **common)
    records = DatasetRecords(concatenate_datasets([validation, train]))
    return write_shards(directory, records, "cauldron", files, rows_per_group)
