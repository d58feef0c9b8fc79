"""`python train.py --check-data`: every training and validation record read and encoded as training would
(the same processor, the same checks), and a report of what training would meet, before it trains a step.

    python train.py --data.source jsonl --data.path mine.jsonl --check-data
    python train.py --config configs/nanovlm-222m-finevision.yaml --check-data --data.check_samples 5000

A stream (data.source=stream) is checked on its first data.check_samples rows of each source, in the shards'
order, with the ratings filters' effect and the ratings' spread; its validation records whole.

A JSONL file's records are named by their line; other sources' by their index in the training or validation
split.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from PIL import UnidentifiedImageError

from data import IGNORE_INDEX, PromptError, build_datasets, load_jsonl
from data.bad_records import MAX_BAD_SHARE, checked_record
from data.chat_processors import ConversationEncoder
from data.images import ImageLoadError
from data.sources import stream_sources
from data.streaming import RATINGS, Source
from data.video import Clip, VideoError
from models.split_config import VideoConfig
from training.config import RunConfig, check_fresh_start
from training.setup import model_and_processor
from typed_config import one_line

MAX_LISTED = 20  # bad records listed one by one per cause; any further ones are only counted


@dataclasses.dataclass
class SourceReport:
    """What reading and encoding one source's records found."""

    name: str
    records: int = 0
    # cause -> records
    bad: dict[str, list[str]] = dataclasses.field(default_factory=lambda: defaultdict(list))
    lengths: list[int] = dataclasses.field(default_factory=list)  # tokens per good record
    answer_tokens: list[int] = dataclasses.field(default_factory=list)
    image_tokens: list[int] = dataclasses.field(default_factory=list)
    image_sides: list[int] = dataclasses.field(default_factory=list)  # each image's width and height
    frames: list[int] = dataclasses.field(default_factory=list)  # sampled frames per record with a clip
    # per record with a clip: its prompt's tokens (frames' placeholders, their timestamps, SmolVLM2's words)
    video_tokens: list[int] = dataclasses.field(default_factory=list)
    filtered: int = 0  # a stream's records whose every turn the ratings filters dropped
    ratings: dict[str, list[int]] = dataclasses.field(default_factory=lambda: defaultdict(list))  # per turn

    @property
    def num_bad(self) -> int:
        return sum(map(len, self.bad.values()))

    def lines(self, max_length: int) -> list[str]:
        lines = [f"{self.name}: {self.records:,} records, {self.num_bad:,} bad"]
        lines += [f"  dropped by the ratings filters: {self.filtered:,} records"] if self.filtered else []
        lines += [f"  {name} ratings per turn: {_spread(values)}" for name, values in self.ratings.items()]
        for cause, where in sorted(self.bad.items(), key=lambda item: -len(item[1])):
            lines.append(f"  {cause}: {len(where):,}")
            lines += [f"    {entry}" for entry in where[:MAX_LISTED]]
            lines += [f"    ... and {len(where) - MAX_LISTED:,} more"] if len(where) > MAX_LISTED else []
        if self.lengths:
            too_long = [i for i, length in enumerate(self.lengths) if length > max_length]
            lost = sum(self.answer_tokens[i] for i in too_long)
            lines.append(f"  tokens per record: {_spread(self.lengths)}; answer tokens in all: "
                         f"{sum(self.answer_tokens):,}")
            lines.append(f"  longer than train.max_length ({max_length}): {len(too_long):,} records "
                         f"(training skips them, never truncates), {lost:,} answer tokens lost")
        if self.image_sides:
            lines.append(f"  image sides in pixels: {_spread(self.image_sides)}; image tokens per record: "
                         f"{_spread(self.image_tokens)}")
        if self.frames:
            lines.append(f"  records with a clip: {len(self.frames):,}; frames per clip: "
                         f"{_spread(self.frames)}; video tokens per clip: {_spread(self.video_tokens)}")
        return lines


def _spread(values: list[int]) -> str:
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return (
        f"min {ordered[0]:,} / median {statistics.median(ordered):,.0f} / p99 {p99:,} / max {ordered[-1]:,}"
    )


def cause(error: Exception) -> str:
    """A bad record's cause, as the report groups them."""
    text = str(error)
    if "no such video file" in text:  # a line's problem, kept as text (data/sources.py)
        return "missing video file"
    if isinstance(error, VideoError):
        return "unreadable video"
    if "no such file" in text:
        return "missing image file"
    if isinstance(error, (ImageLoadError, UnidentifiedImageError)):  # a file, or a stored image's bytes
        return "unreadable image"
    if isinstance(error, PromptError):
        return "image placeholder in a text" if "the text holds" in text else "images and text do not match"
    if "empty answer" in text:
        return "empty answer"
    return "malformed record"


def check_source(report: SourceReport, dataset, processor: ConversationEncoder, image_token: int | None,
                 locate: Callable[[int], str], video: VideoConfig | None = None) -> None:
    """Read, check and encode every record of `dataset` as training does (clips sampled by `video`, the
    model's settings), into `report`."""
    for index in range(len(dataset)):
        report.records += 1
        try:
            record = checked_record(dataset[index], video)
            processor.check_texts(record["texts"])
            clip = record.get("video")
            ids, targets, _ = processor.encode_conversation(record["texts"], record["images"], clip)
        # whatever training would meet reading or encoding this record
        except Exception as error:  # noqa: BLE001
            where, message = locate(index), one_line(error, 200)
            report.bad[cause(error)].append(message if message.startswith(where) else f"{where}: {message}")
            continue
        report.lengths.append(len(ids))
        report.answer_tokens.append(sum(target != IGNORE_INDEX for target in targets))
        report.image_tokens.append(sum(token == image_token for token in ids))
        report.image_sides += [side for image in record["images"] for side in image.size]
        if clip is not None:
            report.frames.append(len(clip.frames))
            report.video_tokens.append(_clip_tokens(processor, clip))


def _clip_tokens(processor: ConversationEncoder, clip: Clip) -> int:
    """The tokens a clip adds to a prompt: the prompt with it less the prompt without it."""
    return len(processor.encode("", [], clip)[0]) - len(processor.encode("", [])[0])


def _stream_head(source: Source, count: int) -> tuple[SourceReport, list[dict[str, Any]], list[str]]:
    """A stream's first `count` rows: a report holding their ratings and the records the filters dropped,
    the records kept and their keys."""
    report, records, keys = SourceReport(source.name), [], []
    for _, (key, row) in zip(range(count), source.rows()):
        for rating in RATINGS:
            report.ratings[rating] += [v for v in row.get(f"{rating}_ratings") or [] if v is not None]
        record = source.record(row)
        if record is None:
            report.filtered += 1
        else:
            records.append(record)
            keys.append(key)
    report.ratings = {rating: values for rating, values in report.ratings.items() if values}
    return report, records, keys


def _sources(config: RunConfig) -> list[tuple[SourceReport, Any, Callable[[int], str]]]:
    """(report, dataset, record index -> where) of what the run reads: a JSONL file whole, in its line order;
    a stream's first data.check_samples rows of each source."""
    data = config.data
    if data.source == "stream":
        sources, validation = stream_sources(data)
        heads = [_stream_head(source, data.check_samples) for source in sources]
        return ([(report, records, lambda i, keys=keys: keys[i]) for report, records, keys in heads]
                + [(SourceReport("validation"), validation, lambda i: f"validation record {i}")])
    if data.source != "jsonl":
        train, validation = build_datasets(data)
        return [(SourceReport(split), dataset, lambda i, split=split: f"{split} record {i}")
                for split, dataset in (("train", train), ("validation", validation))]
    sources = []
    for path in filter(None, (data.path, data.validation_path)):
        dataset = load_jsonl(path, "skip")  # a file that cannot be read stops here, with one line
        numbers = [n for n, line in enumerate(Path(path).read_text().splitlines(), 1) if line.strip()]
        sources.append((SourceReport(path), dataset,
                        lambda i, path=path, numbers=numbers: f"{path}:{numbers[i]}"))
    return sources


def check_data(config: RunConfig) -> int:
    """Print the report of every source; the exit code: 0, or 1 where training would stop on the data (a bad
    record under data.on_bad_record=fail, or more than MAX_BAD_SHARE of the records bad)."""
    check_fresh_start(config)
    sources = _sources(config)
    # the tokenizer as training builds it, on the training split's texts (read past bad lines: all are
    # reported)
    skipping = dataclasses.replace(config.data, on_bad_record="skip")
    train_data = sources[0][1] if config.data.source != "jsonl" else build_datasets(skipping)[0]
    model, processor = model_and_processor(config, None, train_data)
    max_length = config.train.max_length
    reports = []
    for report, dataset, locate in sources:
        check_source(report, dataset, processor, model.config.image_token_id, locate, model.config.video)
        reports.append(report)
        print("\n".join(report.lines(max_length)), flush=True)
    bad, records = sum(r.num_bad for r in reports), sum(r.records for r in reports)
    if bad and config.data.on_bad_record == "fail":
        print(f"data check failed: {bad:,} bad records, and data.on_bad_record=fail stops training at the "
              "first")
        return 1
    for report in reports:  # training stops on a split (train or validation) that is mostly bad
        if report.num_bad > MAX_BAD_SHARE * report.records:
            print(f"data check failed: {report.num_bad:,} of {report.records:,} records of {report.name} are "
                  f"bad, more than training accepts ({MAX_BAD_SHARE:.0%}): the data or its format is likely "
                  "wrong")
            return 1
    too_long = sum(length > max_length for r in reports for length in r.lengths)
    print(f"data check passed: {records - bad - too_long:,} of {records:,} records train"
          + (f"; {bad:,} bad ones are skipped and counted" if bad else "")
          + (f"; {too_long:,} too long ones are skipped" if too_long else ""))
    return 0
