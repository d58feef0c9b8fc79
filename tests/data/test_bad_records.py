"""Bad records: skipped and counted, or a BadRecordError naming the record; good records pass through
unchanged."""

import io
import json

import datasets
import numpy
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
    assert (
        len(reports) == 2
        and "train record 2 is bad" in reports[0]
        and "corrupt or truncated image" in reports[0]
    )
    assert "train record 4 is bad" in reports[1] and "not an image file" in reports[1]


def test_fail_names_the_record_and_the_setting(dataset):
    records = CheckedRecords(dataset, "fail", name="validation")
    assert records[3]["texts"][0]["assistant"] == "red 3"
    with pytest.raises(BadRecordError,
                       match=r"^validation record 4 is bad \(ImageLoadError: .*not an image file.*\); "
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
    assert records.num_bad == 15 and len(reports) == 10 and reports[-1].endswith("further bad records are "
                                                                                 "only counted")


def test_text_that_is_not_valid_unicode_is_a_bad_record():
    records = CheckedRecords([{"images": [], "texts": [{"user": "caf\ud800", "assistant": "ok"}]}], "fail")
    with pytest.raises(BadRecordError, match="train record 0 is bad .*surrogates not allowed"):
        records[0]


def test_a_dataset_that_is_mostly_bad_stops_even_when_skipping():
    """Every record failing the same way is a wrong dataset or format, not a few corrupt samples: no silent
    run."""
    records = CheckedRecords([{"images": [], "texts": None}] * 30, "skip", report=lambda message: None)
    with pytest.raises(BadRecordError,
                       match=r"^20 of the 20 train records read so far are bad, the latest: train record 19 "
                             r"is bad"):
        [records[i] for i in range(30)]


def test_null_images_mean_a_text_only_record():
    """"images": null (as JSON and Arrow write a missing list) is a record without images, not a bad one."""
    text_only = {"images": None, "texts": [{"user": "hi", "assistant": "ok"}]}
    records = CheckedRecords([text_only], "fail")
    assert records[0] == {"images": [], "texts": [{"user": "hi", "assistant": "ok"}]} and records.num_bad == 0


def _png(image: Image.Image, **save) -> dict:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", **save)
    return {"bytes": buffer.getvalue(), "path": None}


@pytest.fixture
def stored(tmp_path):
    """the_cauldron's layout: "images" a list of datasets.Image, stored encoded. Record 1 holds two images,
    the first with an EXIF orientation (decoding turns it upright); record 2's image data is corrupt."""
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated 90 degrees: stored 16 x 8, upright 8 x 16
    tall = Image.new("RGB", (16, 8), (200, 0, 0))
    tall.putpixel((0, 0), (0, 0, 255))
    images = [[_png(Image.new("RGB", (8, 8), (0, 90, 0)))],
              [_png(tall, exif=exif), _png(Image.new("RGB", (4, 4)))],
              [{"bytes": b"\x89PNG broken", "path": None}], [_png(Image.new("RGB", (8, 8), (1, 2, 3)))]]
    texts = [[{"user": "What color?", "assistant": f"answer {i}"}] for i in range(4)]
    features = datasets.Features({"images": datasets.List(datasets.Image()),
                                  "texts": datasets.List({"user": datasets.Value("string"),
                                                          "assistant": datasets.Value("string")}),
                                  "question_type": datasets.Value("string")})
    return datasets.Dataset.from_dict({"images": images, "texts": texts, "question_type": ["color"] * 4},
                                      features=features)


def test_stored_images_are_decoded_once_each_and_read_as_datasets_reads_them(stored, monkeypatch):
    """`datasets` decodes the first image of each list twice; reading through CheckedRecords decodes it once,
    with the same pixels, orientation and texts as the dataset's own reading."""
    expected = [stored[i] for i in (0, 1, 3)]
    opened = []
    open_image = Image.open
    monkeypatch.setattr(Image, "open",
                        lambda *args, **kwargs: opened.append(1) or open_image(*args, **kwargs))
    records = CheckedRecords(stored, "skip", report=lambda message: None)
    batch = records.__getitems__([0, 1, 2, 3])
    assert len(opened) == 5  # one per image, the corrupt one included
    assert batch[2] is None and records.num_bad == 1
    for record, reference in zip([batch[0], batch[1], batch[3]], expected):
        assert list(record) == list(reference) and record["texts"] == reference["texts"]
        assert record["question_type"] == reference["question_type"]
        assert [image.size for image in record["images"]] == [image.size for image in reference["images"]]
        assert all(numpy.array_equal(numpy.asarray(image), numpy.asarray(image_ref.convert("RGB")))
                   for image, image_ref in zip(record["images"], reference["images"]))
    assert batch[1]["images"][0].size == (8, 16)  # upright


def test_a_dataset_showing_some_columns_reads_only_those(stored):
    records = CheckedRecords(stored.with_format(None, columns=["images", "texts"]), "fail")
    assert list(records.__getitems__([0])[0]) == list(records[0]) == ["images", "texts"]
