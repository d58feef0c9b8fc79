"""Bad records: skipped and counted, or a BadRecordError naming the record; good records pass through unchanged."""

import json

import pytest
from PIL import Image

from data import BadRecordError, CheckedRecords, load_jsonl


@pytest.fixture
def dataset(tmp_path):
    """Six records; record 2's image is truncated, record 4's is not an image at all."""
    rows = []
    for i in range(6):
        Image.new("RGB", (16, 16), (40 * i, 0, 0)).save(tmp_path / f"{i}.png", compress_level=0)
        rows.append({"images": [f"{i}.png"], "texts": [{"user": "What color?", "assistant": f"red {i}"}]})
    (tmp_path / "2.png").write_bytes((tmp_path / "2.png").read_bytes()[:300])
    (tmp_path / "4.png").write_text("not an image")
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return load_jsonl(tmp_path / "data.jsonl")


def test_skip_counts_bad_records_and_keeps_good_ones(dataset):
    reports = []
    records = CheckedRecords(dataset, "skip", report=reports.append)
    batch = records.__getitems__([0, 1, 2, 3, 4, 5])  # the DataLoader's batched read
    assert [r is None for r in batch] == [False, False, True, False, True, False]
    assert [r["texts"][0]["assistant"] for r in batch if r] == ["red 0", "red 1", "red 3", "red 5"]
    assert batch[3]["images"][0].getpixel((0, 0)) == (120, 0, 0)
    assert records.num_bad == 2
    assert len(reports) == 2 and "train record 2 is bad" in reports[0] and "corrupt or truncated image" in reports[0]
    assert "train record 4 is bad" in reports[1] and "not an image file" in reports[1]


def test_fail_names_the_record_and_the_setting(dataset):
    records = CheckedRecords(dataset, "fail", name="validation")
    assert records[3]["texts"][0]["assistant"] == "red 3"
    with pytest.raises(BadRecordError, match=r"^validation record 4 is bad \(ImageLoadError: .*not an image file.*\); "
                                             r"set data.on_bad_record=skip"):
        records.__getitems__([3, 4])


def test_malformed_texts_are_bad_records():
    rows = [{"images": [], "texts": [{"user": "hi", "assistant": "ok"}]}, {"images": [], "texts": []},
            {"images": [], "texts": [{"user": "hi", "assistant": None}]}]
    records = CheckedRecords(rows, "skip", report=lambda message: None)
    assert [records[i] is None for i in range(3)] == [False, True, True]
    assert records.num_bad == 2


def test_reports_stop_after_ten_but_counting_goes_on():
    reports, good = [], {"images": [], "texts": [{"user": "hi", "assistant": "ok"}]}
    records = CheckedRecords([{"texts": None}] * 15 + [good] * 15, "skip", report=reports.append)
    assert records.__getitems__(list(range(30))) == [None] * 15 + [good] * 15
    assert records.num_bad == 15 and len(reports) == 10 and reports[-1].endswith("further bad records are only counted")


def test_text_that_is_not_valid_unicode_is_a_bad_record():
    records = CheckedRecords([{"images": [], "texts": [{"user": "caf\ud800", "assistant": "ok"}]}], "fail")
    with pytest.raises(BadRecordError, match="train record 0 is bad .*surrogates not allowed"):
        records[0]


def test_a_dataset_that_is_mostly_bad_stops_even_when_skipping():
    """Every record failing the same way is a wrong dataset or format, not a few corrupt samples: no silent run."""
    records = CheckedRecords([{"images": [], "texts": None}] * 30, "skip", report=lambda message: None)
    with pytest.raises(BadRecordError,
                       match=r"^20 of the 20 train records read so far are bad, the latest: train record 19 is bad"):
        [records[i] for i in range(30)]


def test_null_images_mean_a_text_only_record():
    """"images": null (as JSON and Arrow write a missing list) is a record without images, not a bad one."""
    text_only = {"images": None, "texts": [{"user": "hi", "assistant": "ok"}]}
    records = CheckedRecords([text_only], "fail")
    assert records[0] == {"images": [], "texts": [{"user": "hi", "assistant": "ok"}]} and records.num_bad == 0
