"""Records written as parquet shards, in FineVision's layout (images, texts, source, per-turn ratings and
their minimums) or the_cauldron's (images, texts), as `datasets` stores them (images as {"bytes", "path"}):
what data/streaming.py streams.

    keys = write_shards(Path("shards"), records, layout="finevision", files=8, rows_per_group=256)
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Literal

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from data.streaming import RATINGS

_TURN = pa.struct([("user", pa.string()), ("assistant", pa.string())])
_IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


def png(image: Image.Image) -> dict:
    """A PIL image as a stored image: its PNG bytes."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return {"bytes": buffer.getvalue(), "path": None}


def write_shards(directory: Path, records: list[dict], layout: Literal["finevision", "cauldron"] = "cauldron",
                 files: int = 1, rows_per_group: int = 1000, source: str = "") -> list[str]:
    """`records` ({"images": [PIL image or {"bytes", "path"}], "texts": [...]}, and for FineVision optionally
    "source" and "<rating>_ratings", one per turn: 5, the top, where absent) in order over `files` parquet
    files of `rows_per_group`-row row groups; returns the samples' keys as data/streaming.py names them."""
    directory.mkdir(parents=True, exist_ok=True)
    fields = [("images", pa.list_(_IMAGE)), ("texts", pa.list_(_TURN))]
    if layout == "finevision":
        fields += [("source", pa.string())]
        fields += [field for rating in RATINGS
                   for field in ((f"{rating}_ratings", pa.list_(pa.int64())), (f"{rating}_min", pa.int64()))]
    per_file = -(-len(records) // files)
    keys = []
    for number in range(files):
        chunk = records[number * per_file:(number + 1) * per_file]
        name = f"train-{number:05d}-of-{files:05d}.parquet"
        rows = [_row(record, layout, source) for record in chunk]
        table = pa.Table.from_pylist(rows, schema=pa.schema(fields))
        pq.write_table(table, directory / name, row_group_size=rows_per_group)
        keys += [f"{(directory / name).absolute()}#{row}" for row in range(len(chunk))]
    return keys


def _row(record: dict, layout: str, source: str) -> dict:
    images = [png(image) if isinstance(image, Image.Image) else image for image in record["images"] or []]
    row = {"images": images, "texts": record["texts"]}
    if layout == "finevision":
        row["source"] = record.get("source", source)
        for rating in RATINGS:
            ratings = record.get(f"{rating}_ratings", [5] * len(record["texts"]))
            row[f"{rating}_ratings"], row[f"{rating}_min"] = ratings, min(ratings, default=None)
    return row
