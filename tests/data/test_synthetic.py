"""The shapes dataset: every answer checked against the pixels, determinism, disjoint splits, balance."""

import colorsys
import random
import re
from collections import Counter

import numpy as np
import pytest

from data import QUESTION_TYPES, ShapesConfig, make_shapes_dataset, shapes_datasets
from data.synthetic import (
    BACKGROUND,
    CELL_CLASSES,
    CELLS,
    COLORS,
    cell_labels,
    render,
    sample_scene,
    sample_scene_of,
    split_of,
)
from typed_config import ConfigError

GRID = (("top left", "top", "top right"), ("left", "center", "right"),
        ("bottom left", "bottom", "bottom right"))
READING_ORDER = [cell for row in GRID for cell in row]


def blobs(mask: np.ndarray) -> list[np.ndarray]:
    """4-connected components of a boolean mask, each as an array of (row, col) pixels."""
    labels = np.where(mask, np.arange(1, mask.size + 1).reshape(mask.shape), 0)
    while True:
        p = np.pad(labels, 1)
        neighbours = [p[1:-1, 1:-1], p[:-2, 1:-1], p[2:, 1:-1], p[1:-1, :-2], p[1:-1, 2:]]
        spread = np.where(mask, np.max(neighbours, axis=0), 0)
        if (spread == labels).all():
            return [np.argwhere(labels == label) for label in np.unique(labels) if label]
        labels = spread


def read_scene(image) -> dict[str, tuple[str, str, str]]:
    """What the pixels show: {cell name: (size, colour, shape)}, from blob geometry and colour alone."""
    pixels = np.asarray(image, dtype=int)
    side = image.width / 3
    palette = {name: np.array(rgb) for name, rgb in COLORS.items()}
    scene = {}
    for blob in blobs(np.abs(pixels - BACKGROUND).sum(-1) > 60):
        (top, left), (bottom, right) = blob.min(0), blob.max(0)
        row, col = int(top // side), int(left // side)
        assert (int(bottom // side), int(right // side)) == (row, col), "a shape crosses a cell border"
        cell = GRID[row][col]
        assert cell not in scene, f"two blobs in the {cell} cell"
        median = np.median(pixels[blob[:, 0], blob[:, 1]], axis=0)
        color = min(palette, key=lambda name: np.abs(palette[name] - median).sum())
        height, width = bottom - top + 1, right - left + 1
        fill = len(blob) / (height * width)
        row_widths = np.bincount(blob[:, 0] - top)
        if fill > 0.9:
            shape = "square"
        elif fill > 0.65:
            shape = "circle"
        else:  # a triangle is widest at its base, a diamond in its middle
            shape = "triangle" if row_widths.argmax() >= 0.75 * (height - 1) else "diamond"
        scene[cell] = ("large" if width > 0.56 * side else "small", color, shape)
    return scene


def parse_caption(caption: str) -> list[tuple[str, tuple[str, str, str]]]:
    parts = re.split(r", | and ", caption)
    matches = [re.fullmatch(r"a (small|large) (\w+) (\w+) (?:at|on|in) the ([a-z ]+)",
                            part) for part in parts]
    assert all(matches), caption
    return [(m[4], (m[1], m[2], m[3])) for m in matches]


def answer_from_pixels(question: str, scene: dict) -> tuple[str, str]:
    """(question type, answer) computed from the pixel reading alone."""
    by_shape = {shape: (cell, color) for cell, (_, color, shape) in scene.items()}
    if m := re.fullmatch(r"What color is the (\w+)\?", question):
        return "color", by_shape[m[1]][1]
    if m := re.fullmatch(r"What shape is (?:at|on|in) the ([a-z ]+)\?", question):
        return "shape", scene[m[1]][2]
    if question == "How many shapes are there?":
        return "count", str(len(scene))
    if m := re.fullmatch(r"Is there an? (\w+) (\w+)\?", question):
        return "presence", "yes" if by_shape.get(m[2], (None, None))[1] == m[1] else "no"
    if m := re.fullmatch(r"Where is the (\w+)\?", question):
        return "position", by_shape[m[1]][0]
    if m := re.fullmatch(r"Is the (\w+) (\w+)\?", question):
        return "verify", "yes" if by_shape[m[1]][1] == m[2] else "no"
    assert question == "Describe the image.", question
    return "caption", None


@pytest.mark.parametrize("image_size", [64, 96])
def test_pixel_reader_recovers_rendered_scenes(image_size):
    rng = random.Random(image_size)
    for _ in range(200):
        scene = sample_scene(rng)
        expected = {CELLS[item.cell]: (item.size, item.color, item.shape) for item in scene}
        assert read_scene(render(scene, image_size, rng)) == expected


def test_cell_labels_name_what_each_cell_shows():
    rng = random.Random(5)
    for _ in range(100):
        scene = sample_scene(rng)
        seen = read_scene(render(scene, 64, rng))
        for cell, labels in enumerate(cell_labels(scene)):
            shape, color, size = (
                CELL_CLASSES[name][i] for name, i in zip(("shape", "color", "size"), labels)
            )
            assert (size, color, shape) == seen.get(CELLS[cell], ("none", "none", "none"))


@pytest.mark.parametrize("split", ["train", "validation"])
def test_scenes_can_be_drawn_from_one_split(split):
    rng = random.Random(0)
    scenes = [sample_scene_of(split, rng, 0.3) for _ in range(50)]
    assert {split_of(scene, 0.3) for scene in scenes} == {split} and len(set(scenes)) > 40


@pytest.mark.parametrize("split,turns,noise", [("validation", 1, 12), ("train", 6, 0), ("train", 3, 0)])
def test_every_answer_is_true_of_the_image(split, turns, noise):
    dataset = make_shapes_dataset(split, 240, seed=3, noise=noise, turns=turns)
    for record in dataset:
        [image] = record["images"]
        assert image.mode == "RGB" and image.size == (64, 64)
        scene = read_scene(image)
        assert 1 <= len(scene) <= 4
        assert len({shape for _, _, shape in scene.values()}) == len(scene), "a shape kind appears twice"
        types = []
        for turn in record["texts"]:
            kind, expected = answer_from_pixels(turn["user"], scene)
            types.append(kind)
            if kind == "caption":  # every shape, in reading order
                ordered = sorted(scene.items(), key=lambda item: READING_ORDER.index(item[0]))
                assert parse_caption(turn["assistant"]) == ordered
            else:
                assert turn["assistant"] == expected, turn
        assert record["question_type"] == "+".join(types)
        assert len(set(types)) == turns and ("caption" not in types or types[-1] == "caption")


def test_same_seed_same_samples_other_seed_other_samples():
    def snapshot(seed):
        dataset = make_shapes_dataset("train", 40, seed=seed, noise=8, turns=2)
        return [(r["texts"], r["question_type"], np.asarray(r["images"][0]).tobytes()) for r in dataset]

    assert snapshot(0) == snapshot(0)
    first, other = snapshot(0), snapshot(1)
    assert sum(a == b for a, b in zip(first, other)) < 5


def test_noise_is_small_and_changes_nothing_else():
    clean, noisy = (make_shapes_dataset("validation", 30, seed=0, noise=amplitude) for amplitude in (0, 10))
    assert clean["texts"] == noisy["texts"]
    for a, b in zip(clean, noisy):
        difference = np.asarray(a["images"][0], dtype=int) - np.asarray(b["images"][0], dtype=int)
        assert np.abs(difference).max() == 10 and difference.std() > 3
    # fixed per record
    assert np.array_equal(np.asarray(noisy[0]["images"][0]), np.asarray(noisy[0]["images"][0]))


def scene_contents(dataset) -> set[frozenset]:
    contents = set()
    for record in dataset.select_columns(["texts"]):
        caption = record["texts"][-1]
        assert caption["user"] == "Describe the image."
        contents.add(frozenset(parse_caption(caption["assistant"])))
    return contents


def test_train_and_validation_scenes_never_overlap():
    train = scene_contents(make_shapes_dataset("train", 3000, seed=0, turns=6))
    validation = scene_contents(make_shapes_dataset("validation", 3000, seed=1, turns=6))
    assert not train & validation
    # Single-shape scenes are few (4 shapes x 6 colours x 2 sizes x 9 cells): a per-sample split would share
    # many.
    assert sum(len(c) == 1 for c in train) > 200 and sum(len(c) == 1 for c in validation) > 20


def test_validation_is_single_turn_and_balanced():
    _, validation = shapes_datasets(ShapesConfig(num_train=6, num_validation=1200))
    assert Counter(validation["question_type"]) == {kind: 200 for kind in QUESTION_TYPES}
    assert all(len(texts) == 1 for texts in validation["texts"])
    presence = [
        texts[0]["assistant"] for texts in validation["texts"] if texts[0]["user"].startswith("Is there")
    ]
    assert set(presence) == {"yes", "no"} and 0.4 < presence.count("yes") / len(presence) < 0.6


def test_verify_questions_name_a_shape_of_the_scene_and_are_answered_yes_half_the_time():
    train = make_shapes_dataset("train", 400, seed=1, question_types=("verify",))
    answers = []
    for record in train:
        [turn] = record["texts"]
        # KeyError: shape absent
        kind, expected = answer_from_pixels(turn["user"], read_scene(record["images"][0]))
        assert (kind, turn["assistant"]) == ("verify", expected)
        answers.append(expected)
    assert 0.4 < answers.count("yes") / len(answers) < 0.6


def test_validation_asks_no_training_only_question_type():
    with pytest.raises(ConfigError, match="validation"):
        make_shapes_dataset("validation", 10, seed=0, question_types=("color", "verify"))


def test_training_records_cycle_through_the_chosen_question_types():
    train = make_shapes_dataset("train", 30, seed=0, question_types=("color", "caption", "caption"))
    assert train["question_type"] == ["color", "caption", "caption"] * 10
    assert all(
        texts[0]["user"] == "Describe the image."
        for texts, kind in zip(train["texts"], train["question_type"])
        if kind == "caption"
    )


def test_answers_are_short_lowercase_strings():
    for texts in make_shapes_dataset("train", 300, seed=0, turns=5)["texts"]:
        for turn in texts:
            answer = turn["assistant"]
            assert answer == answer.lower() and answer.strip() == answer
            assert turn["user"] == "Describe the image." or len(answer.split()) <= 2


def test_colours_look_like_their_names():
    hues = {"red": (345, 15), "orange": (20, 40), "yellow": (45, 65), "green": (100, 150), "blue": (210, 240),
            "purple": (270, 300)}
    for name, rgb in COLORS.items():
        hue, _, value = colorsys.rgb_to_hsv(*(c / 255 for c in rgb))
        low, high = hues[name]
        assert (low <= hue * 360 <= high) if low < high else not (high < hue * 360 < low), name
        assert value > 0.5
    rgbs = np.array(list(COLORS.values()) + [BACKGROUND])
    distances = np.abs(rgbs[:, None] - rgbs[None]).sum(-1)
    assert distances[~np.eye(len(rgbs), dtype=bool)].min() > 80


def test_shapes_config_validates():
    assert ShapesConfig.from_dict(ShapesConfig().to_dict()) == ShapesConfig()
    for values, field in [({"noise": 99}, "noise"), ({"image_size": 16}, "image_size"),
                          ({"train_turns": 7}, "train_turns"),
                          ({"validation_fraction": 0.0}, "validation_fraction"),
                          ({"num_train": 0}, "num_train"),
                          ({"train_question_types": ["colour"]}, "train_question_types"),
                          ({"train_question_types": []}, "train_question_types"),
                          ({"train_turns": 3, "train_question_types": ["caption"]}, "train_question_types")]:
        with pytest.raises(ConfigError, match=field):
            ShapesConfig.from_dict(values)
    with pytest.raises(ConfigError, match="unknown key"):
        ShapesConfig.from_dict({"colours": 3})
