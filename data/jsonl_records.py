"""One line of an own-data JSONL file, or of an image folder's metadata.jsonl, read into a record: its
images' and clip's paths made absolute and checked, its turns and its optional fields; or a one-line
DataSourceError (or the file's image or clip error) naming the line. data/sources.py reads a JSONL file whole
with it, data/jsonl_stream.py a line at a time."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from data.bad_records import Policy, record_images
from data.images import ImageLoadError
from data.prompts import CAPTION_PROMPT
from data.video import VideoError
from models.errors import TinyVLMError


class DataSourceError(TinyVLMError, ValueError):
    """A data file or folder that is missing or does not describe records."""


def read_line(line: str, where: str, root: Path, on_bad_record: Policy) -> dict[str, Any]:
    """An own-data JSONL line's record (data/sources.py `load_jsonl` describes the format)."""
    return _read(_parse_line, line, where, root, on_bad_record)


def read_metadata_line(line: str, where: str, root: Path, on_bad_record: Policy) -> dict[str, Any]:
    """An image folder's metadata.jsonl line, {"file_name": ..., "question": ..., "answer": ...} or
    {"file_name": ..., "text": ...}, as the record data/sources.py `load_imagefolder` gives: the image (its
    path relative to the folder) and one turn (`metadata_turns`)."""
    return _read(_parse_metadata_line, line, where, root, on_bad_record)


def metadata_turns(row: dict[str, Any], where: str) -> list[dict[str, str]]:
    """An image folder row's turn: its question and answer, else its `text` caption answering
    CAPTION_PROMPT."""
    if isinstance(row.get("question"), str) and isinstance(row.get("answer"), str):
        return [{"user": row["question"], "assistant": row["answer"]}]
    if isinstance(row.get("text"), str):
        return [{"user": CAPTION_PROMPT, "assistant": row["text"]}]
    raise DataSourceError(f"{where}: needs 'question' and 'answer' strings, or a 'text' caption")


def _read(parse: Callable[[dict[str, Any], str, Path], dict[str, Any]], line: str, where: str, root: Path,
          on_bad_record: Policy) -> dict[str, Any]:
    """The line parsed by `parse`; a bad line raises under "fail", else is a record carrying its `problem`."""
    try:
        return parse(_json_object(line, where), where, root)
    except (DataSourceError, ImageLoadError, VideoError) as error:
        if on_bad_record == "fail":
            raise
        return {"images": [], "texts": [], "problem": str(error)}


def _json_object(line: str, where: str) -> dict[str, Any]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataSourceError(f"{where}: not valid JSON ({e.msg})") from None
    if not isinstance(row, dict):
        raise DataSourceError(f"{where}: expected a JSON object")
    return row


def _parse_metadata_line(row: dict[str, Any], where: str, root: Path) -> dict[str, Any]:
    if not isinstance(row.get("file_name"), str):
        raise DataSourceError(f"{where}: needs a 'file_name' (the image's path in the folder)")
    return {"images": _image_paths([row["file_name"]], where, root), "texts": metadata_turns(row, where)}


def _parse_line(row: dict[str, Any], where: str, root: Path) -> dict[str, Any]:
    record = {"images": _image_paths(record_images(row), where, root), "texts": _turns(row, where)}
    if "question_type" in row:
        if not isinstance(row["question_type"], str):
            raise DataSourceError(f"{where}: 'question_type' must be a string")
        record["question_type"] = row["question_type"]
    if row.get("video") is not None:
        record.update(_video(row, where, root))
        if record["images"]:
            raise DataSourceError(f"{where}: a record holds a clip or images, not both (a video prompt holds "
                                  "the clip's frames and no other images)")
    return record


def _video(row: dict[str, Any], where: str, root: Path) -> dict[str, Any]:
    """The line's clip path (made absolute, checked to exist) and its own sampling settings."""
    video, fps, max_frames = row["video"], row.get("fps"), row.get("max_frames")
    if not isinstance(video, str):
        raise DataSourceError(f"{where}: 'video' must be a file path")
    if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float)) or fps <= 0):
        raise DataSourceError(f"{where}: 'fps' must be a positive number, got {fps!r}")
    if max_frames is not None and (isinstance(max_frames, bool) or not isinstance(max_frames, int)
                                   or max_frames < 1):
        raise DataSourceError(f"{where}: 'max_frames' must be a positive whole number, got {max_frames!r}")
    path = root / video
    if not path.is_file():
        raise VideoError(f"{path}: no such video file (listed at {where})")
    return {"video": str(path), "fps": fps, "max_frames": max_frames}


def _image_paths(images: Any, where: str, root: Path) -> list[str]:
    """Paths made absolute (relative ones are taken from the JSONL file's folder) and checked to exist."""
    if not (isinstance(images, list) and all(isinstance(image, str) for image in images)):
        raise DataSourceError(f"{where}: 'images' must be a list of file paths")
    paths = [root / image for image in images]
    for path in paths:
        if not path.is_file():
            raise ImageLoadError(f"{path}: no such file (listed at {where})")
    return [str(path) for path in paths]


def _turns(row: dict[str, Any], where: str) -> list[dict[str, str]]:
    """The row's `texts`, or its `conversations` paired into user/assistant turns."""
    if "conversations" in row:
        messages = row["conversations"]
        alternating = (isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages)
                       and [m.get("role") for m in messages] == ["user", "assistant"] * (len(messages) // 2))
        if not alternating:
            raise DataSourceError(f"{where}: 'conversations' must alternate user and assistant messages, "
                                  "user first")
        turns = [{"user": u.get("content"), "assistant": a.get("content")}
                 for u, a in zip(messages[::2], messages[1::2])]
    else:
        turns = row.get("texts")
    if not (isinstance(turns, list) and turns and all(_is_turn(turn) for turn in turns)):
        raise DataSourceError(f"{where}: needs 'texts' (a list of user/assistant string pairs) or "
                              "'conversations'")
    return [{"user": turn["user"], "assistant": turn["assistant"]} for turn in turns]


def _is_turn(turn: Any) -> bool:
    return (
        isinstance(turn, dict)
        and isinstance(turn.get("user"), str)
        and isinstance(turn.get("assistant"), str)
    )
