"""A streamed image folder (`data.streams[].files: my_folder`), the folder `datasets`' imagefolder (and
data/sources.py's `load_imagefolder`) reads: its metadata.jsonl streamed as JSONL files stream
(data/jsonl_stream.py: blocks of lines split, shuffled, held out and resumed as row groups), each line
{"file_name", "question", "answer"} or {"file_name", "text"} read into the record `load_imagefolder` gives,
the image opened from the folder when the record is checked. A bad line (not JSON, a missing field, an image
that is not there) is a bad record, skipped and counted under its key `<folder>/metadata.jsonl#<number>`.
"""

from __future__ import annotations

from pathlib import Path

from data.jsonl_records import read_metadata_line
from data.jsonl_stream import JsonlSource
from typed_config import ConfigError

METADATA = "metadata.jsonl"
# the other metadata files `datasets`' imagefolder reads, which do not stream here
OTHER_METADATA = ("metadata.csv", "metadata.parquet")


def is_image_folder(files: str) -> bool:
    """Whether a stream's `files` names an image folder: a local directory, or its metadata.jsonl."""
    return Path(files).name == METADATA or Path(files).is_dir()


class ImageFolderSource(JsonlSource):
    """An image folder's metadata.jsonl, a line per image."""

    kind = "an image folder"
    parse = staticmethod(read_metadata_line)

    @staticmethod
    def glob(files: str) -> str:
        """The folder's metadata.jsonl; a folder without one is a one-line error."""
        folder = Path(files).parent if Path(files).name == METADATA else Path(files)
        if not (folder / METADATA).is_file():
            other = next((name for name in OTHER_METADATA if (folder / name).is_file()), None)
            raise ConfigError(
                f"data.streams[].files: {folder} has {other} but no {METADATA}, the only metadata an image "
                "folder streams from: write its rows to metadata.jsonl, a JSON object a line" if other else
                f"data.streams[].files: {folder} has no {METADATA}, which a streamed image folder needs (a "
                'line per image: {"file_name": ..., "question": ..., "answer": ...} or {"file_name": ..., '
                '"text": ...})')
        return str(folder / METADATA)
