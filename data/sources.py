"""Real data in the same record format: the_cauldron, users' JSONL files and image folders, or streamed
parquet shards (data/streaming.py); `DataConfig` picks one."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any, Literal

from datasets import Dataset, Features, List, Value, concatenate_datasets, load_dataset

from data.bad_records import Policy
from data.imagefolder_stream import ImageFolderSource, is_image_folder
from data.images import load_image
from data.jsonl_records import DataSourceError, metadata_turns, read_line
from data.jsonl_stream import JsonlSource
from data.streaming import Source, StreamConfig
from data.synthetic import ShapesConfig, shapes_datasets
from data.synthetic_video import VideoShapesConfig, video_shapes_datasets
from typed_config import Config, check, one_line

MAX_DEFAULT_HOLDOUT = 500
_TEXTS = List({"user": Value("string"), "assistant": Value("string")})


def load_cauldron(subset: str, split: str = "train") -> Dataset:
    """One subset of HuggingFaceM4/the_cauldron (downloads it); records as they are: images and texts."""
    try:
        dataset = load_dataset("HuggingFaceM4/the_cauldron", subset, split=split)
    except (OSError, ValueError) as e:  # offline (ConnectionError), an unknown subset, a failed download, ...
        raise DataSourceError(f"the_cauldron subset {subset!r}: the hub could not provide it "
                              f"({type(e).__name__}: {one_line(e)})") from None
    return dataset.select_columns(["images", "texts"])


def load_jsonl(path: str | Path, on_bad_record: Policy = "fail") -> Dataset:
    """Records from a JSONL file, a line each; images (paths relative to the file) are opened when a record is
    read.

    A line is {"images": ["a.png", ...], "texts": [{"user": ..., "assistant": ...}, ...]}, or has
    "conversations": [{"role": "user" | "assistant", "content": ...}, ...] in place of "texts"; a text-only
    record has no "images", or "images": [] or null. A line may carry a "question_type" string: the held-out
    exact-match scores are then given per type ("caption" is left out of the overall accuracy; lines without
    one count as "question"). A line may carry a clip in place of images, "video": "clip.mp4" (relative to the
    file too), with its own "fps" and "max_frames" in place of the model's: its frames are sampled and
    prompted as inference does when the record is read (data/bad_records.py `record_video`). Other fields
    are dropped.

    A malformed line (not JSON, no user/assistant turns, an image or clip file that is not there, a clip
    beside images) stops the load under `on_bad_record="fail"`; under "skip" it is kept as a record carrying
    its `problem`, which reading it raises, so that training skips and counts it with every other bad record
    (data/bad_records.py).
    """
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise DataSourceError(f"{path}: cannot read ({e.strerror or e})") from None
    records = [read_line(line, f"{path}:{number}", path.parent, on_bad_record)
               for number, line in enumerate(lines, 1) if line.strip()]
    if not records:
        raise DataSourceError(f"{path}: no records")
    features = {"images": List(Value("string")), "texts": _TEXTS}
    optional = {"question_type": "string", "problem": "string", "video": "string", "fps": "float64",
                "max_frames": "int64"}
    for name, kind in optional.items():
        if any(name in record for record in records):
            features[name] = Value(kind)
            for record in records:
                record.setdefault(name, None)
    dataset = Dataset.from_list(records, features=Features(features))
    return dataset.with_transform(_open_images)


def _open_images(batch: dict[str, list]) -> dict[str, list]:
    return {**batch, "images": [[load_image(path) for path in paths] for paths in batch["images"]]}


def load_imagefolder(directory: str | Path, split: str = "train") -> Dataset:
    """An image folder whose metadata.jsonl gives each `file_name` a `question` and `answer`, or a `text`
    caption (each line its own: a folder may mix them)."""
    if not Path(directory).is_dir():
        raise DataSourceError(f"{directory}: no such directory")
    dataset = load_dataset("imagefolder", data_dir=str(directory), split=split)
    columns = set(dataset.column_names)
    if not ({"question", "answer"} <= columns or "text" in columns):
        raise DataSourceError(f"{directory}: metadata.jsonl needs 'question' and 'answer' fields, or 'text' "
                              "captions")
    where = f"{directory}/metadata.jsonl"
    return dataset.with_transform(functools.partial(_imagefolder_records, where=where))


def _imagefolder_records(batch: dict[str, list], where: str) -> dict[str, list]:
    """Each row's image and turn (`metadata_turns`: a folder may mix questions and captions)."""
    rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
    texts = [metadata_turns(row, where) for row in rows]
    return {"images": [[image] for image in batch["image"]], "texts": texts}


@dataclasses.dataclass
class DataConfig(Config):
    """Where training and validation records come from; every source yields the_cauldron record format."""

    # where the records come from
    source: Literal["synthetic", "synthetic_video", "cauldron", "jsonl", "imagefolder",
                    "stream"] = "synthetic"
    # source=synthetic; source=synthetic_video draws its frames' scenes at shapes.image_size
    shapes: ShapesConfig = dataclasses.field(default_factory=ShapesConfig)
    # source=synthetic_video: clips of moving shapes (data/synthetic_video.py)
    video_shapes: VideoShapesConfig = dataclasses.field(default_factory=VideoShapesConfig)
    subsets: tuple[str, ...] = ()  # source=cauldron: the_cauldron subsets, concatenated
    path: str | None = None  # source=jsonl|imagefolder: the JSONL file or the image folder
    # source=jsonl|imagefolder: optional; without it, `holdout` records are held out
    validation_path: str | None = None
    # source=stream: parquet shards, JSONL files or image folders streamed, never loaded whole, mixed by their
    # weights; sections written in a YAML file (docs/streaming.md)
    streams: tuple[StreamConfig, ...] = ()
    shuffle_buffer: int = 1000  # source=stream: samples each reader shuffles among (1: the shards' order)
    check_samples: int = 1000  # source=stream: `train.py --check-data` checks each stream's first rows
    # training records held out for validation when there is no validation_path (default: a tenth, 1 to 500;
    # source=stream: the first stream's first 500 rows)
    holdout: int | None = None
    # a corrupt image or malformed record: skip and count it, or stop
    on_bad_record: Literal["skip", "fail"] = "skip"

    def __post_init__(self) -> None:
        check(self.source != "cauldron" or bool(self.subsets),
              "data.subsets: source=cauldron needs at least one subset, e.g. vqav2")
        files = self.source in ("jsonl", "imagefolder")
        check(not files or bool(self.path), f"data.path: source={self.source} needs a path")
        check(files or self.validation_path is None,
              f"data.validation_path applies to jsonl and imagefolder, not {self.source}")
        check(self.holdout is None or self.holdout > 0, f"data.holdout must be positive, got {self.holdout}")
        check((self.source == "stream") == bool(self.streams),
              "data.streams: source=stream needs at least one stream, and only source=stream takes them")
        check(self.shuffle_buffer >= 1, f"data.shuffle_buffer must be at least 1, got {self.shuffle_buffer}")
        check(self.check_samples >= 1, f"data.check_samples must be at least 1, got {self.check_samples}")


def build_datasets(config: DataConfig) -> tuple[Dataset, Dataset]:
    """(train, validation) datasets of records for the configured source."""
    if config.source == "synthetic":
        return shapes_datasets(config.shapes)
    if config.source == "synthetic_video":
        return video_shapes_datasets(config.video_shapes, config.shapes.image_size)
    if config.source == "cauldron":
        train = concatenate_datasets([load_cauldron(subset) for subset in config.subsets])
    else:
        load = (functools.partial(load_jsonl, on_bad_record=config.on_bad_record) if config.source == "jsonl"
                else load_imagefolder)
        train = load(config.path)
        if config.validation_path:
            return train, load(config.validation_path)
    holdout = config.holdout or min(max(len(train) // 10, 1), MAX_DEFAULT_HOLDOUT)
    check(holdout < len(train),
          f"data.holdout ({holdout}) must be smaller than the dataset ({len(train)} records)")
    split = train.train_test_split(test_size=holdout, seed=0)
    return split["train"], split["test"]


def stream_sources(config: DataConfig) -> tuple[list[Source], list[dict[str, Any]]]:
    """source=stream: the streamed sources, and the validation records (the first stream's first
    `holdout` rows, which training never reads)."""
    holdout = config.holdout or MAX_DEFAULT_HOLDOUT
    first, *others = config.streams
    validation = open_stream(first).head(holdout)
    check(bool(validation), f"data.streams[0] ({first.files}): its first {holdout} rows hold no record")
    return [open_stream(first, skip=holdout), *map(open_stream, others)], validation


def open_stream(config: StreamConfig, skip: int = 0) -> Source:
    """A stream's source: an image folder's metadata.jsonl (data/imagefolder_stream.py) or JSONL files
    (`*.jsonl`) read a line at a time (data/jsonl_stream.py), else parquet shards (data/streaming.py); its
    first `skip` rows left out (held out for validation)."""
    kind = (ImageFolderSource if is_image_folder(config.files)
            else JsonlSource if config.files.endswith(".jsonl") else Source)
    return kind.open(config, skip)
