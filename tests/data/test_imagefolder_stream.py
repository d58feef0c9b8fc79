"""Image folders streamed (data/imagefolder_stream.py): the records data/sources.py's load_imagefolder reads
from the same folder (questions and captions mixed), every record of an epoch read by exactly one of 2 ranks x
2 workers, held out lines never streamed, a resumed stream continuing as the uninterrupted one, bad lines
skipped and counted by their keys, and one-line errors for what does not stream."""

import json

import numpy as np
import pytest
from PIL import Image

from data import CAPTION_PROMPT, load_imagefolder
from data.bad_records import checked_record
from data.sources import open_stream
from data.streaming import StreamConfig
from tests.data.test_jsonl_stream import epoch_keys, resumed_and_uninterrupted
from tests.data.test_sources import image_folder, offline_cache  # noqa: F401 (a fixture)
from tests.data.test_stream_batches import _batches, collator  # noqa: F401 (a fixture)
from typed_config import ConfigError

COUNT = 20  # images in the folder: even ones captioned, odd ones asked about


def _turn(number: int) -> dict[str, str]:
    return {"question": f"What is {number}?", "answer": f"It is {number}."} if number % 2 else {
        "text": f"picture {number}"}


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """An image folder of COUNT images whose metadata.jsonl mixes question/answer and caption lines; units of
    3 lines."""
    monkeypatch.setattr("data.jsonl_stream.LINES_PER_UNIT", 3)
    return image_folder(tmp_path / "folder", [_turn(number) for number in range(COUNT)])


def _source(files, skip=0):
    return open_stream(StreamConfig(files=str(files)), skip=skip)


def test_a_streamed_image_folder_holds_the_records_load_imagefolder_reads(folder, offline_cache):  # noqa: F811
    streamed = [checked_record(_source(folder).record(row)) for _, row in _source(folder).rows()]
    in_memory = [checked_record(record) for record in load_imagefolder(folder)]
    expected = [[{"user": CAPTION_PROMPT, "assistant": f"picture {number}"} if number % 2 == 0 else
                 {"user": f"What is {number}?", "assistant": f"It is {number}."}] for number in range(COUNT)]
    assert [record["texts"] for record in streamed] == [record["texts"] for record in in_memory] == expected
    for record, reference in zip(streamed, in_memory):
        assert np.array_equal(np.asarray(record["images"][0]), np.asarray(reference["images"][0]))


def test_the_folder_or_its_metadata_jsonl_name_the_same_stream(folder):
    named = [key for key, _ in _source(folder / "metadata.jsonl").rows()]
    assert [key for key, _ in _source(folder).rows()] == named


def test_every_record_of_an_epoch_is_read_by_exactly_one_of_two_ranks_by_two_workers(folder):
    source = _source(folder)
    every, read = [key for key, _ in source.rows()], epoch_keys(source)
    assert sorted(read) == sorted(every) and len(set(read)) == len(every) == COUNT
    assert every[0] == f"{folder}/metadata.jsonl#0"


def test_held_out_lines_are_never_streamed_and_a_resumed_stream_continues_exactly(folder):
    every = [key for key, _ in _source(folder).rows()]
    assert set(epoch_keys(_source(folder, skip=7), readers=1)) == set(every[7:])
    resumed, expected = resumed_and_uninterrupted(_source(folder), more=20)  # into the next epoch
    assert resumed == expected


def test_bad_lines_are_skipped_and_counted_by_their_keys(folder, collator):  # noqa: F811
    (folder / "broken.png").write_bytes(b"not a png")
    bad = ["{not json", json.dumps({"file_name": "gone.png", "text": "a"}),
           json.dumps({"file_name": "0.png"}), json.dumps({"file_name": "broken.png", "text": "b"})]
    with open(folder / "metadata.jsonl", "a") as metadata:
        metadata.write("".join(line + "\n" for line in bad))
    taken = _batches([_source(folder)], collator, 7, workers=0)  # 20 good records and 4 bad: over an epoch
    assert {key for _, skipped in taken for key in skipped} == {
        f"{folder}/metadata.jsonl#{number}" for number in range(COUNT, COUNT + 4)}


def test_what_does_not_stream_is_a_one_line_error(folder, tmp_path):
    (tmp_path / "csv").mkdir()
    (tmp_path / "csv" / "metadata.csv").write_text("file_name,text\n0.png,a\n")
    (tmp_path / "bare").mkdir()
    Image.new("RGB", (4, 4)).save(tmp_path / "bare" / "0.png")
    for files, words in [(tmp_path / "csv", "has metadata.csv but no metadata.jsonl"),
                         (tmp_path / "bare", "has no metadata.jsonl")]:
        with pytest.raises(ConfigError, match=words):
            _source(files)
    with pytest.raises(ConfigError, match="is an image folder, whose records have no ratings"):
        open_stream(StreamConfig(files=str(folder), layout="finevision"))
