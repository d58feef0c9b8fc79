"""Streamed sources (data/streaming.py) against the shards the tests wrote: records as written, ratings
filters against the test's own predicate, every sample of an epoch read once across slots, a seed's order
reproduced, and a stream resumed from its state continuing exactly as the uninterrupted stream."""

import random

import numpy as np
import pytest

from data.bad_records import checked_record
from data.shards import write_shards
from data.streaming import RATINGS, SlotReader, Source, SourceStream, StreamConfig, StreamError
from tests.shards import tiny_records
from typed_config import ConfigError


def _epoch(source: Source, slot: int = 0, slots: int = 1, seed: int = 0, buffer: int = 1) -> list[str]:
    return [key for key, _ in SourceStream(source, slot, slots, seed, buffer, epochs=1)]


def test_cauldron_layout_records_as_written(tmp_path):
    records = tiny_records(10, turns=2)
    keys = write_shards(tmp_path, records, "cauldron", files=2, rows_per_group=3)
    source = Source.open(StreamConfig(files=str(tmp_path / "*.parquet")))
    read = dict(SourceStream(source, 0, 1, seed=0, buffer_size=1, epochs=1))
    assert sorted(read) == sorted(keys)
    for key, written in zip(keys, records):
        record = checked_record(source.record(read[key]))
        assert record["texts"] == written["texts"]
        assert np.array_equal(np.asarray(record["images"][0]), np.asarray(written["images"][0]))


def test_finevision_ratings_filter_turns_under_the_minimums(tmp_path):
    rng = random.Random(0)
    records = tiny_records(40, turns=3)
    for record in records:
        for rating in RATINGS:
            record[f"{rating}_ratings"] = [rng.randint(1, 5) for _ in record["texts"]]
    keys = write_shards(tmp_path, records, "finevision", files=2, rows_per_group=5, source="test")
    minimums = {"relevance": 3, "visual_dependency": 2}
    config = StreamConfig(files=str(tmp_path / "*.parquet"), layout="finevision",
                          **{f"min_{rating}": minimum for rating, minimum in minimums.items()})
    source = Source.open(config)
    read = {key: source.record(row) for key, row in SourceStream(source, 0, 1, 0, 1, epochs=1)}
    for key, written in zip(keys, records):
        kept = [turn for t, turn in enumerate(written["texts"])
                if written["relevance_ratings"][t] >= 3 and written["visual_dependency_ratings"][t] >= 2]
        assert (read[key] or {}).get("texts", []) == kept
        assert read[key] is None or read[key]["source"] == "test"
    assert any(record is None for record in read.values())  # the draw leaves some records with no turn


def test_ratings_on_the_cauldron_layout_are_refused():
    with pytest.raises(ConfigError, match="has no ratings"):
        StreamConfig(files="x/*.parquet", min_relevance=2)


def test_every_sample_of_an_epoch_is_read_by_exactly_one_slot(tmp_path):
    keys = write_shards(tmp_path, tiny_records(45), files=3, rows_per_group=4)
    source = Source.open(StreamConfig(files=str(tmp_path / "*.parquet")))
    slots = 4  # 2 ranks x 2 workers
    read = [key for slot in range(slots) for key in _epoch(source, slot, slots, buffer=5)]
    assert sorted(read) == sorted(keys)  # the union is the dataset, and no sample comes twice


def test_the_seed_fixes_the_order(tmp_path):
    write_shards(tmp_path, tiny_records(30), files=2, rows_per_group=4)
    source = Source.open(StreamConfig(files=str(tmp_path / "*.parquet")))
    assert _epoch(source, seed=3, buffer=8) == _epoch(source, seed=3, buffer=8)
    assert _epoch(source, seed=3, buffer=8) != _epoch(source, seed=4, buffer=8)


def test_held_out_rows_are_never_streamed(tmp_path):
    keys = write_shards(tmp_path, tiny_records(20), files=2, rows_per_group=3)
    source = Source.open(StreamConfig(files=str(tmp_path / "*.parquet")), skip=12)
    assert sorted(_epoch(source)) == sorted(keys[12:])


def test_a_stream_resumed_from_its_state_continues_exactly(tmp_path):
    write_shards(tmp_path, tiny_records(23), files=2, rows_per_group=4)
    config = StreamConfig(files=str(tmp_path / "*.parquet"))
    sources = [Source.open(config), Source.open(config.replace({"weight": "3"}))]
    total = 3 * 23 * 2  # past epoch boundaries and the buffer's flushes
    uninterrupted = SlotReader(sources, slot=1, slots=2, seed=5, buffer_size=6)
    expected = [next(uninterrupted)[0] for _ in range(total)]
    for stop in range(0, total, 7):
        first = SlotReader(sources, slot=1, slots=2, seed=5, buffer_size=6)
        seen = [next(first)[0] for _ in range(stop)]
        resumed = SlotReader(sources, slot=1, slots=2, seed=5, buffer_size=6, state=first.state())
        assert seen + [next(resumed)[0] for _ in range(total - stop)] == expected


def test_too_few_row_groups_for_the_slots_is_a_clear_error(tmp_path):
    write_shards(tmp_path, tiny_records(4), files=1, rows_per_group=4)
    source = Source.open(StreamConfig(files=str(tmp_path / "*.parquet")))
    with pytest.raises(ConfigError, match="1 parquet row groups cannot feed 4 readers"):
        SourceStream(source, 0, 4, 0, 1)


def test_samples_are_read_back_by_their_keys(tmp_path):
    """`Source.read_keys` (a resumed packing window's samples): each key's row, as the files hold it in order,
    across files and row groups; a held-out row or one not there is a clear error."""
    keys = write_shards(tmp_path, tiny_records(20), files=2, rows_per_group=3)
    source = Source.open(StreamConfig(files=str(tmp_path / "*.parquet")), skip=2)
    rows = dict(source.rows())
    wanted = [keys[17], keys[2], keys[9], keys[10]]
    assert source.read_keys(wanted) == {key: rows[key] for key in wanted}
    for key in (keys[1], keys[0].replace("#0", "#99")):  # held out; past the file's end
        with pytest.raises(StreamError, match="no such sample"):
            source.read_keys([key])


def test_no_matching_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="no parquet file matches"):
        Source.open(StreamConfig(files=str(tmp_path / "*.parquet")))


def test_a_mixture_draws_its_sources_in_proportion_to_their_weights(tmp_path):
    for files, name in enumerate("ab", 1):  # b's files are named "-of-00002": its keys tell its samples
        write_shards(tmp_path / name, tiny_records(16), files=files, rows_per_group=4)
    sources = [Source.open(StreamConfig(files=str(tmp_path / name / "*.parquet"), weight=weight))
               for name, weight in (("a", 1), ("b", 3))]
    slots, draws = 4, 1000  # 2 ranks x 2 workers, each drawing for itself
    drawn_b = 0
    for slot in range(slots):
        reader = SlotReader(sources, slot, slots, seed=0, buffer_size=4)
        for _ in range(draws):
            drawn_b += "-of-00002" in next(reader)[0]
    n, p = slots * draws, 3 / 4
    # the share of b is binomial(n, p) / n: its standard deviation is sqrt(p (1 - p) / n) = 0.0068; 4.5 of
    # them leave a chance of ~7e-6 to fail for any seed
    assert abs(drawn_b / n - p) < 4.5 * (p * (1 - p) / n) ** 0.5


def test_a_file_that_is_not_parquet_is_a_clear_error(tmp_path):
    (tmp_path / "broken.parquet").write_bytes(b"not parquet")
    with pytest.raises(StreamError, match=r"broken.parquet could not be read \(ArrowInvalid"):
        Source.open(StreamConfig(files=str(tmp_path / "*.parquet")))


def test_a_file_without_its_layouts_columns_is_a_clear_error(tmp_path):
    write_shards(tmp_path, tiny_records(4), "cauldron")
    with pytest.raises(ConfigError, match="has no column 'source', which layout finevision needs"):
        Source.open(StreamConfig(files=str(tmp_path / "*.parquet"), layout="finevision"))
