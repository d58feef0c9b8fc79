"""Real-data sources: JSONL (texts and conversations formats), image folders, DataConfig and
build_datasets."""

import json

import datasets
import numpy as np
import pytest
from PIL import Image

from data import (
    CAPTION_PROMPT,
    DataConfig,
    DataSourceError,
    ImageLoadError,
    ImageProcessor,
    VQACollator,
    build_datasets,
    load_imagefolder,
    load_jsonl,
)
from data.bad_records import CheckedRecords
from training.evaluate import exact_match
from typed_config import ConfigError

RED, BLUE = (255, 0, 0), (0, 0, 255)


def colour(image) -> tuple[int, ...]:
    return tuple(int(v) for v in np.asarray(image)[0, 0])


def write_jsonl(path, rows) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


@pytest.fixture
def images(tmp_path):
    (tmp_path / "pics").mkdir()
    Image.new("RGB", (8, 8), RED).save(tmp_path / "pics" / "red.png")
    Image.new("RGBA", (8, 8), (0, 0, 255, 255)).save(tmp_path / "blue.png")
    return tmp_path


def test_jsonl_records_load_with_images(images):
    turns = [{"user": "What color?", "assistant": "red"}, {"user": "And this one?", "assistant": "blue"}]
    write_jsonl(images / "data.jsonl", [
        {"images": ["pics/red.png", str(images / "blue.png")], "texts": turns},
        {"texts": [{"user": "No image here.", "assistant": "ok", "source": "extra keys are dropped"}]},
    ])
    dataset = load_jsonl(images / "data.jsonl")
    assert len(dataset) == 2
    record = dataset[0]
    assert [colour(image) for image in record["images"]] == [RED, BLUE]
    assert all(i.mode == "RGB" for i in record["images"])
    assert record["texts"] == turns
    assert dataset[1] == {"images": [], "texts": [{"user": "No image here.", "assistant": "ok"}]}


def test_jsonl_conversations_are_mapped_to_turns(images):
    messages = [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "red"},
                {"role": "user", "content": "Sure?"}, {"role": "assistant", "content": "yes"}]
    write_jsonl(images / "chat.jsonl", [{"images": ["pics/red.png"], "conversations": messages}])
    expected = [{"user": "Hi?", "assistant": "red"}, {"user": "Sure?", "assistant": "yes"}]
    assert load_jsonl(images / "chat.jsonl")[0]["texts"] == expected


def test_jsonl_missing_image_names_the_path(images):
    write_jsonl(images / "data.jsonl",
                [{"images": ["pics/red.png"], "texts": [{"user": "a", "assistant": "b"}]},
                                       {"images": ["pics/gone.png"],
                                        "texts": [{"user": "a", "assistant": "b"}]}])
    with pytest.raises(ImageLoadError, match=r"pics/gone\.png: no such file \(listed at .*data\.jsonl:2\)"):
        load_jsonl(images / "data.jsonl")


def test_jsonl_corrupt_image_fails_when_read(images):
    (images / "broken.png").write_bytes(b"not a png")
    write_jsonl(images / "data.jsonl",
                [{"images": ["broken.png"], "texts": [{"user": "a", "assistant": "b"}]}])
    dataset = load_jsonl(images / "data.jsonl")
    with pytest.raises(ImageLoadError, match="broken.png: not an image"):
        dataset[0]


def test_malformed_lines_are_bad_records_under_skip(images):
    """data.on_bad_record=skip: a line that is not JSON, lacks an assistant, or lists a missing image loads as
    a record that reading raises on, so training skips and counts it (CheckedRecords) instead of stopping."""
    good = {"images": ["pics/red.png"], "texts": [{"user": "Color?", "assistant": "red"}]}
    lines = [json.dumps(good), "{not json", json.dumps({"texts": [{"user": "no answer"}]}),
             json.dumps({**good, "images": ["pics/gone.png"]}), json.dumps(good)]
    (images / "data.jsonl").write_text("\n".join(lines))
    with pytest.raises(DataSourceError, match=r"data.jsonl:2: not valid JSON"):
        load_jsonl(images / "data.jsonl")  # "fail", the default: the first one stops the load
    reports = []
    records = CheckedRecords(load_jsonl(images / "data.jsonl", "skip"), "skip", report=reports.append)
    read = [records[i] for i in range(len(records))]
    assert [record is not None for record in read] == [True, False, False, False, True]
    assert records.num_bad == 3 and colour(read[4]["images"][0]) == RED
    where = images / "data.jsonl"
    assert [r.split(" is bad (ValueError: ")[1] for r in reports] == [
        f"{where}:2: not valid JSON (Expecting property name enclosed in double quotes))",
        f"{where}:3: needs 'texts' (a list of user/assistant string pairs) or 'conversations')",
        f"{images / 'pics' / 'gone.png'}: no such file (listed at {where}:4))"]


def test_a_small_dataset_holds_out_a_tenth_by_default(images):
    rows = [{"images": ["pics/red.png"], "texts": [{"user": f"q{i}", "assistant": "red"}]} for i in range(50)]
    write_jsonl(images / "data.jsonl", rows)
    train, validation = build_datasets(DataConfig(source="jsonl", path=str(images / "data.jsonl")))
    assert (len(train), len(validation)) == (45, 5)


@pytest.mark.parametrize(
    "line,words",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "a JSON object"),
        ('{"images": "a.png", "texts": []}', "'images' must be a list"),
        ('{"texts": []}', "needs 'texts'"),
        ('{"texts": [{"user": "a"}]}', "needs 'texts'"),
        (
            '{"conversations": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]}',
            "alternate",
        ),
        ('{"conversations": [{"role": "user", "content": "a"}]}', "alternate"),
    ],
)
def test_jsonl_bad_lines_name_file_and_line(tmp_path, line, words):
    good = json.dumps({"texts": [{"user": "a", "assistant": "b"}]})
    (tmp_path / "bad.jsonl").write_text(f"{good}\n\n{line}\n")
    with pytest.raises(DataSourceError, match=f"bad.jsonl:3: .*{words}") as error:
        load_jsonl(tmp_path / "bad.jsonl")
    assert "\n" not in str(error.value)


def test_jsonl_missing_or_empty_file(tmp_path):
    with pytest.raises(DataSourceError, match="cannot read"):
        load_jsonl(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataSourceError, match="no records"):
        load_jsonl(tmp_path / "empty.jsonl")


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")


def image_folder(root, rows: list[dict]):
    root.mkdir()
    for i in range(len(rows)):
        Image.new("RGB", (8, 8), RED if i % 2 == 0 else BLUE).save(root / f"{i}.png")
    write_jsonl(root / "metadata.jsonl", [{"file_name": f"{i}.png", **row} for i, row in enumerate(rows)])
    return root


def test_imagefolder_questions_and_captions(tmp_path, offline_cache):
    qa = load_imagefolder(image_folder(tmp_path / "qa",
                                       [{"question": "Color?", "answer": a} for a in ("red", "blue")]))
    records = sorted((r["texts"][0]["assistant"], colour(r["images"][0])) for r in qa)
    assert records == [("blue", BLUE), ("red", RED)]
    captions = load_imagefolder(image_folder(tmp_path / "captions", [{"text": "a red square"}]))
    assert captions[0]["texts"] == [{"user": CAPTION_PROMPT, "assistant": "a red square"}]
    with pytest.raises(DataSourceError, match="question"):
        load_imagefolder(image_folder(tmp_path / "labels", [{"label_name": "x"}]))
    with pytest.raises(DataSourceError, match="no such directory"):
        load_imagefolder(tmp_path / "absent")


def test_data_config_validates():
    config = DataConfig.from_dict({"source": "jsonl", "path": "train.jsonl", "shapes": {"num_train": "100"}})
    assert config.shapes.num_train == 100 and DataConfig.from_dict(config.to_dict()) == config
    for values, words in [({"source": "cauldron"}, "data.subsets"), ({"source": "jsonl"}, "data.path"),
                          ({"source": "web"}, "source"), ({"shapes": {"noise": 100}}, "data.shapes.noise"),
                          ({"validation_path": "v.jsonl"}, "data.validation_path"),
                          ({"holdout": 0}, "data.holdout")]:
        with pytest.raises(ConfigError, match=words):
            DataConfig.from_dict(values)
    with pytest.raises(ConfigError, match="unknown key shapes.colour"):
        DataConfig.from_dict({"shapes": {"colour": 1}})


def test_build_datasets_synthetic_and_jsonl(images, shapes_tokenizer):
    shapes = DataConfig().shapes.replace({"num_train": 12, "num_validation": 6})
    train, validation = build_datasets(DataConfig(shapes=shapes))
    assert (len(train), len(validation)) == (12, 6)
    rows = [{"images": ["pics/red.png"],
             "texts": [{"user": f"q{i}", "assistant": f"a{i}"}]} for i in range(10)]
    write_jsonl(images / "data.jsonl", rows)
    train, validation = build_datasets(DataConfig(source="jsonl", path=str(images / "data.jsonl"), holdout=3))
    users = sorted(r["texts"][0]["user"] for r in [*train, *validation])
    assert (len(train), len(validation)) == (7, 3) and users == sorted(f"q{i}" for i in range(10))
    # lazily opened images batch fine
    batch = VQACollator(shapes_tokenizer, ImageProcessor(16), 4, 256)(list(validation))
    assert batch["images"].shape == (3, 3, 16, 16)
    with pytest.raises(ConfigError, match="holdout"):
        build_datasets(DataConfig(source="jsonl", path=str(images / "data.jsonl"), holdout=10))


def test_jsonl_null_images_mean_no_images(images):
    write_jsonl(images / "data.jsonl",
                [{"images": None, "texts": [{"user": "No image.", "assistant": "ok"}]}])
    assert load_jsonl(images / "data.jsonl")[0] == {"images": [],
                                                    "texts": [{"user": "No image.", "assistant": "ok"}]}


def test_jsonl_question_types_are_kept_for_per_type_scores(images):
    rows = [{"images": ["pics/red.png"], "texts": [{"user": f"q{i}", "assistant": "red"}],
             "question_type": kind}
            for i, kind in enumerate(["colour", "shape", "colour"])]
    write_jsonl(images / "typed.jsonl", rows)
    dataset = load_jsonl(images / "typed.jsonl")
    assert [r["question_type"] for r in dataset] == ["colour", "shape", "colour"]
    assert colour(dataset[0]["images"][0]) == RED
    train, validation = build_datasets(
        DataConfig(source="jsonl", path=str(images / "typed.jsonl"), holdout=1)
    )
    assert sorted(r["question_type"] for r in [*train, *validation]) == ["colour", "colour", "shape"]
    # optional per line
    write_jsonl(images / "mixed.jsonl", [*rows, {"texts": [{"user": "q", "assistant": "a"}]}])
    assert [r["question_type"] for r in load_jsonl(images / "mixed.jsonl")] == [
        "colour",
        "shape",
        "colour",
        None,
    ]
    scores = exact_match(list(load_jsonl(images / "mixed.jsonl")), ["red", "blue", "red", "a"])
    assert (scores["accuracy/colour"], scores["accuracy/shape"],
            scores["accuracy/question"]) == (1.0, 0.0, 1.0)
    write_jsonl(images / "number.jsonl", [{**rows[0], "question_type": 3}])
    with pytest.raises(DataSourceError, match="number.jsonl:1: 'question_type' must be a string"):
        load_jsonl(images / "number.jsonl")
