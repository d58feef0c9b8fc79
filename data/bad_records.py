"""Bad records (a corrupt image, malformed texts) met while training: skipped and counted, or a clear error,
by config."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, Literal

import datasets
from datasets.features.features import require_decoding
from torch.utils.data import Dataset

from data.images import to_rgb
from data.video import Clip, read_video, video_sampling
from models.errors import TinyVLMError
from models.split_config import VideoConfig
from typed_config import one_line

Policy = Literal["skip", "fail"]
MAX_REPORTS = 10  # bad records reported one by one; any further ones are only counted
# past this share of the records read (after MIN_READ), the data or its format is wrong: stop
MAX_BAD_SHARE = 0.5
MIN_READ = 20


class BadRecordError(TinyVLMError, ValueError):
    """A record that cannot be read or is malformed, met with `data.on_bad_record=fail`."""


def record_images(record: dict[str, Any]) -> list:
    """A record's images; "images": null (or no "images" at all) is a text-only record."""
    images = record.get("images")
    return [] if images is None else images


def record_video(record: dict[str, Any], config: VideoConfig) -> Clip | None:
    """A record's clip: one already sampled (a `Clip`), or a file's frames sampled as inference samples them
    (data/video.py), by `config` with the record's own "fps" / "max_frames" in place of its own; None without
    one."""
    video = record.get("video")
    if video is None or isinstance(video, Clip):
        return video
    return read_video(video, video_sampling(config, record.get("fps"), record.get("max_frames")))


# decodes a stored image ({"bytes", "path"}) as `datasets` does: EXIF orientation applied
_IMAGE = datasets.Image()


def checked_record(record: dict[str, Any], video: VideoConfig | None = None) -> dict[str, Any]:
    """The record with its images fully decoded to RGB (stored ones, {"bytes", "path"}, too; corrupt image
    data fails here, not inside a batch), its clip's frames read (`record_video`, by `video`: the model's
    sampling) and its texts checked to be user/assistant pairs of valid Unicode strings with no empty answer;
    anything else raises (so does a record that carries the `problem` its source met, as data/sources.py's
    load_jsonl keeps one)."""
    if record.get("problem"):
        raise ValueError(record["problem"])
    texts = record["texts"]
    if not (
        isinstance(texts, list)
        and texts
        and all(
            isinstance(turn, dict)
            and isinstance(turn.get("user"), str)
            and isinstance(turn.get("assistant"), str)
            for turn in texts
        )
    ):
        raise ValueError("'texts' must be a non-empty list of user/assistant string pairs")
    for turn in texts:
        # a lone surrogate (JSON allows "\ud800") raises here
        (turn["user"] + turn["assistant"]).encode("utf-8")
        if not turn["assistant"].strip():
            raise ValueError("an empty answer: the turn would teach the model to stop at once")
    images = [
        _IMAGE.decode_example(image) if isinstance(image, dict) else image for image in record_images(record)
    ]
    checked = {**record, "images": [to_rgb(image) for image in images]}
    if record.get("video") is not None:
        checked["video"] = record_video(record, video or VideoConfig())
    return checked


def _stored_images_view(dataset: Any) -> datasets.Dataset | None:
    """The dataset as Arrow rows, for reading records with their images still encoded, where that gives the
    same records: a `datasets.Dataset` with no format or transform whose one column needing decoding is
    "images", a list of `datasets.Image` (the_cauldron's layout, and the synthetic shapes'). None otherwise.

    `datasets` decodes the first image of every such list twice (once to test whether decoding changes it),
    which doubles the image decoding of one-image records; `checked_record` decodes each image once
    instead."""
    if not isinstance(dataset, datasets.Dataset) or (shown := dataset.format)["type"] is not None:
        return None
    features = dataset.features
    images = features.get("images")
    if not (
        isinstance(images, (datasets.List, datasets.LargeList))
        and isinstance(images.feature, datasets.Image)
        and images.feature.decode
        and images.feature.mode is None
    ):
        return None
    if any(require_decoding(feature) for name, feature in features.items() if name != "images"):
        return None
    return dataset.with_format("arrow", columns=shown["columns"],
                               output_all_columns=shown["output_all_columns"])


def _to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class CheckedRecords(Dataset):
    """`dataset[i]` read and checked eagerly (see `checked_record`). A bad record raises BadRecordError naming
    it under policy "fail", or becomes None under "skip" (the collator leaves Nones out), counted in
    `num_bad`; when most records are bad, the data or its format is wrong, and even "skip" stops with a
    BadRecordError.

    A dataset's format is read once, here: change it with `with_format` / `with_transform` (a new dataset),
    not in place. The counts are this process's reads (a DataLoader worker keeps its own): training learns
    which records were bad from each batch instead (data/batches.py).
    """

    def __init__(self, dataset, policy: Policy, name: str = "train",
                 report: Callable[[str], None] | None = None,
                 check_texts: Callable[[list[dict[str, str]]], None] | None = None,
                 video: VideoConfig | None = None):
        if policy not in ("skip", "fail"):
            raise ValueError(f"policy must be 'skip' or 'fail', got {policy!r}")
        self.dataset = dataset
        self.policy = policy
        self.name = name
        self._stored = _stored_images_view(dataset)
        # the model's format refusing a text (a typed <image>): a bad record too
        self.check_texts = check_texts
        self.video = video  # how a record's clip is sampled: the model's video settings
        self.report = report or _to_stderr
        self.num_bad = self.num_read = 0

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, Any] | None:
        return self._read(index, lambda: self.dataset[index])

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any] | None]:
        """A batch in one read where the dataset supports it (Arrow slices are much faster than rows one by
        one)."""
        try:
            records = (self._stored[indices].to_pylist() if self._stored is not None
                       else self.dataset.__getitems__(indices))
        # no batch reads, or a bad record somewhere in the batch: go row by row
        except Exception:  # noqa: BLE001
            return [self[index] for index in indices]
        return [self._read(index, lambda record=record: record) for index, record in zip(indices, records)]

    def _read(self, index: int, fetch: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        self.num_read += 1
        try:
            record = checked_record(fetch(), self.video)
            if self.check_texts is not None:
                self.check_texts(record["texts"])
            return record
        # whatever reading one record raises (PIL, Arrow, a transform) makes it bad
        except Exception as e:  # noqa: BLE001
            return self._bad(index, e)

    def _bad(self, index: int, error: Exception) -> None:
        message = f"{self.name} record {index} is bad ({type(error).__name__}: {one_line(error)})"
        if self.policy == "fail":
            raise BadRecordError(
                f"{message}; set data.on_bad_record=skip to skip and count such records"
            ) from None
        self.num_bad += 1
        if self.num_read >= MIN_READ and self.num_bad > MAX_BAD_SHARE * self.num_read:
            raise BadRecordError(
                f"{self.num_bad} of the {self.num_read} {self.name} records read so far are "
                f"bad, the latest: {message}; the dataset or its format is likely wrong"
            ) from None
        if self.num_bad <= MAX_REPORTS:
            more = "; further bad records are only counted" if self.num_bad == MAX_REPORTS else ""
            self.report(f"skipped {message}{more}")
        return None
