"""The objects generator (data/synthetic_objects.py): deterministic, split by scene, disjoint from the default
shapes, answers true of the images, exported as JSONL that load_jsonl reads, and its command line."""

import itertools
import json
import random
from collections import Counter

import numpy as np
import pytest

from data import load_jsonl, synthetic
from data import synthetic_objects as objects
from training.evaluate import exact_match


def samples(split: str, count: int, seed: int = 0, image_size: int = 64) -> list[objects.Sample]:
    return list(objects.generate(split, count, seed, image_size))


def as_rows(items: list[objects.Sample]) -> list[tuple]:
    return [(s.question, s.answer, s.question_type, s.scene, s.image.tobytes()) for s in items]


def test_same_seed_same_samples_other_seed_other_samples():
    assert as_rows(samples("train", 30)) == as_rows(samples("train", 30))
    assert [s.scene for s in samples("train", 30)] != [s.scene for s in samples("train", 30, seed=1)]


def test_no_validation_scene_appears_in_training():
    validation = {s.scene for seed in (0, 1) for s in samples("validation", 100, seed, image_size=16)}
    train = {s.scene for seed in (0, 1) for s in samples("train", 600, seed, image_size=16)}
    assert validation and train and not validation & train
    assert {objects.split_of(scene) for scene in validation} == {"validation"}


def test_shapes_colours_backgrounds_and_wording_are_not_the_default_generators():
    assert not set(objects.SHAPES) & set(synthetic.SHAPES)
    assert not set(objects.COLOURS) & set(synthetic.COLORS)
    for ours, theirs in itertools.product(objects.COLOURS.values(), synthetic.COLORS.values()):
        assert np.linalg.norm(np.subtract(ours, theirs)) > 60
    for name in objects.BACKGROUNDS:
        pixels = np.asarray(objects.background(name, 64), dtype=float)
        assert np.linalg.norm(pixels - synthetic.BACKGROUND, axis=-1).min() > 40, name
    rng = random.Random(0)
    default_questions = {synthetic.ask(synthetic.sample_scene(rng), kind, rng)[0]
                         for _ in range(300) for kind in synthetic.QUESTION_TYPES}
    templates = {question for questions in objects.TEMPLATES.values() for question in questions}
    assert not templates & default_questions


def test_rendered_object_has_the_named_colour_size_and_place_on_a_contrasting_background():
    rng, areas = random.Random(0), {}
    for shape, (colour, backgrounds), size, position in itertools.product(
            objects.SHAPES, objects.BACKGROUNDS_FOR.items(), objects.SIZES, objects.POSITIONS):
        assert backgrounds
        for name in backgrounds:
            scene = objects.Scene(shape, colour, size, position, name)
            image = np.asarray(objects.render(scene, 64, rng), dtype=int)
            plain = np.asarray(objects.background(name, 64), dtype=int)
            drawn = (image != plain).any(axis=-1)
            assert drawn.any() and (image[drawn] == objects.COLOURS[colour]).all(), scene
            assert np.linalg.norm(plain - objects.COLOURS[colour], axis=-1).min() >= objects.MIN_CONTRAST, (
                scene
            )
            third = int(np.nonzero(drawn)[1].mean() * 3 // 64)
            assert third == list(objects.POSITIONS).index(position), scene
            dark = objects.answer_of(scene, "background") == "yes"
            assert (plain.mean() < 100) if dark else (plain.mean() > 150), scene
            areas.setdefault((shape, size), []).append(int(drawn.sum()))
    for shape in objects.SHAPES:
        assert min(areas[shape, "big"]) > max(areas[shape, "small"]), shape


def test_answers_lie_in_their_types_vocabulary_and_types_are_balanced():
    items = samples("train", 500, image_size=16)
    assert Counter(s.question_type for s in items) == {kind: 100 for kind in objects.QUESTION_TYPES}
    for kind in objects.QUESTION_TYPES:
        of_kind = [s for s in items if s.question_type == kind]
        assert {s.answer for s in of_kind} == set(objects.ANSWERS[kind]), kind
        assert {s.question for s in of_kind} == set(objects.TEMPLATES[kind]), kind
        assert all(s.answer == objects.answer_of(s.scene, kind) for s in of_kind)
    dark = [s.answer for s in items if s.question_type == "background"]
    assert 0.35 < dark.count("yes") / len(dark) < 0.65


def test_exported_jsonl_loads_as_the_generated_records(tmp_path):
    paths = objects.export_jsonl(tmp_path, num_train=20, num_validation=10, seed=3, image_size=32)
    assert paths == {"train": tmp_path / "train.jsonl", "validation": tmp_path / "validation.jsonl"}
    for split, count in (("train", 20), ("validation", 10)):
        line = json.loads(paths[split].read_text().splitlines()[0])
        assert line["images"] == [f"images/{split}_000000.png"]
        records, expected = load_jsonl(paths[split]), samples(split, count, seed=3, image_size=32)
        assert len(records) == count
        for record, sample in zip(records, expected):
            assert record["texts"] == [{"user": sample.question, "assistant": sample.answer}]
            assert record["question_type"] == sample.question_type
            assert (np.asarray(record["images"][0]) == np.asarray(sample.image)).all()
    validation = list(load_jsonl(paths["validation"]))
    scores = exact_match(validation, [r["texts"][0]["assistant"] for r in validation])
    assert scores == {**{f"accuracy/{kind}": 1.0 for kind in objects.QUESTION_TYPES}, "accuracy": 1.0,
                      "num_questions": 10}


def test_command_line_writes_the_files(tmp_path, capsys):
    out = tmp_path / "out"
    assert objects.main([str(out), "--train", "6", "--validation", "4", "--seed", "1", "--image-size",
                         "24"]) == 0
    printed = capsys.readouterr().out.strip()
    assert "\n" not in printed and "6 train" in printed and "4 validation" in printed
    assert [len(load_jsonl(out / f"{split}.jsonl")) for split in ("train", "validation")] == [6, 4]
    assert len(list((out / "images").glob("*.png"))) == 10


@pytest.mark.parametrize("arguments,words",
                         [(["--train", "0"], "positive"), (["--image-size", "8"], "at least 16")])
def test_command_line_bad_arguments_give_one_line_errors(tmp_path, capsys, arguments, words):
    assert objects.main([str(tmp_path / "out"), *arguments]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("error:") and words in error and "\n" not in error
    (tmp_path / "file").write_text("")
    assert objects.main([str(tmp_path / "file"), "--train", "1", "--validation", "1"]) == 2
    assert "\n" not in capsys.readouterr().err.strip()
