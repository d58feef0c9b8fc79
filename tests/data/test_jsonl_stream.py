"""JSONL files streamed (data/jsonl_stream.py): the records data/sources.py's load_jsonl reads from the same
file, bad lines kept as bad records, every record of an epoch read by exactly one of 2 ranks x 2 workers, held
out lines never streamed, and a stream resumed from its state continuing as the uninterrupted one."""

import json

import numpy as np
import pytest
from PIL import Image

from data import jsonl_stream
from data.bad_records import checked_record
from data.sources import load_jsonl, open_stream
from data.streaming import SlotReader, Source, SourceStream, StreamConfig
from typed_config import ConfigError

BAD = 2  # the file's lines that are not records: one not JSON, one with an image that is not there


@pytest.fixture
def jsonl(tmp_path, monkeypatch):
    """A JSONL file of 40 records (coloured images in a folder beside it, question types) with blank lines and
    BAD bad lines among them; units of 3 lines."""
    monkeypatch.setattr(jsonl_stream, "LINES_PER_UNIT", 3)
    (tmp_path / "pics").mkdir()
    lines = []
    for i in range(40):
        Image.new("RGB", (4, 4), (i, 2 * i, 7)).save(tmp_path / "pics" / f"{i}.png")
        lines.append(json.dumps({"images": [f"pics/{i}.png"], "question_type": "colour",
                                 "texts": [{"user": f"What is {i}?", "assistant": f"It is {i}."}]}))
        if i % 9 == 0:
            lines.append("")
    missing = {"images": ["pics/gone.png"], "texts": [{"user": "a", "assistant": "b"}]}
    lines[5:5] = ["{not json", json.dumps(missing)]
    (tmp_path / "data.jsonl").write_text("\n".join(lines) + "\n")
    return tmp_path / "data.jsonl"


def _source(path, skip=0) -> Source:
    return open_stream(StreamConfig(files=str(path)), skip=skip)


def epoch_keys(source: Source, readers: int = 4) -> list[str]:
    """The keys every one of `readers` readers (2 ranks x 2 workers) reads in an epoch, all together."""
    return [key for slot in range(readers)
            for key, _ in SourceStream(source, slot, readers, seed=0, buffer_size=5, epochs=1)]


def resumed_and_uninterrupted(source: Source, read: int = 11, more: int = 30) -> tuple[list, list]:
    """A reader's next `more` samples (keys and records) after `read`: resumed from its state (through
    JSON), and uninterrupted."""
    reader = SlotReader([source], 1, 2, seed=3, buffer_size=4)
    for _ in range(read):
        next(reader)
    state = json.loads(json.dumps(reader.state()))
    expected = [next(reader) for _ in range(more)]
    resumed = SlotReader([source], 1, 2, seed=3, buffer_size=4, state=state)
    return [next(resumed) for _ in range(more)], expected


def test_a_streamed_jsonl_file_holds_the_records_load_jsonl_reads(jsonl):
    source = _source(jsonl)
    streamed = [source.record(row) for _, row in source.rows()]
    in_memory = load_jsonl(jsonl, on_bad_record="skip")
    assert len(streamed) == len(in_memory) == 40 + BAD
    assert len(source.blocks[str(jsonl)]) == 14  # an offset per 3 lines, not the lines
    for record, expected in zip(streamed, in_memory):
        if expected.get("problem"):
            assert record["problem"] == expected["problem"]
            with pytest.raises(ValueError):
                checked_record(record)
            continue
        record = checked_record(record)
        assert record["texts"] == expected["texts"] and record["question_type"] == expected["question_type"]
        assert np.array_equal(np.asarray(record["images"][0]), np.asarray(expected["images"][0]))


def test_every_record_of_an_epoch_is_read_by_exactly_one_of_two_ranks_by_two_workers(jsonl):
    source = _source(jsonl)
    every, read = [key for key, _ in source.rows()], epoch_keys(source)
    assert sorted(read) == sorted(every) and len(set(read)) == len(every) == 40 + BAD


def test_held_out_lines_are_never_streamed(jsonl):
    every = [key for key, _ in _source(jsonl).rows()]
    streamed = {key for key, _ in SourceStream(_source(jsonl, skip=7), 0, 1, seed=1, buffer_size=4, epochs=2)}
    assert streamed == set(every[7:])


def test_a_jsonl_stream_resumed_from_its_state_continues_exactly(jsonl):
    resumed, expected = resumed_and_uninterrupted(_source(jsonl), more=30)  # into the next epoch
    assert resumed == expected


def test_ratings_on_a_jsonl_stream_are_a_clear_error(jsonl):
    with pytest.raises(ConfigError, match="is JSONL, whose records have no ratings"):
        open_stream(StreamConfig(files=str(jsonl), layout="finevision"))
