"""Synthetic shapes VQA + captioning data, generated in code: 1-4 coloured shapes on a 3x3 grid, deterministic
by seed.

A scene holds at most one shape of each kind (so "the circle" is unambiguous) and one shape per cell. Every
question has a short lowercase answer and a `question_type`: color, shape, count, presence, position or
caption; training records may also ask `verify` ("Is the circle red?"), which validation never asks.

Train/validation split: each scene goes to a split by a stable hash of its canonical content (the sorted
(cell, shape, colour, size) tuples), so a validation scene never appears in training, whatever the seeds or
sizes. `make_shapes_dataset` draws scenes from a seeded RNG and keeps those that hash into the requested
split.

Records are in the_cauldron format plus a `question_type` column. Validation records hold one question each
(types cycle, so each type gets an equal share and per-type accuracy is clean). Training records may bundle
several turns about one image (`turns` distinct types; the caption, which gives every answer away, always
last): the image costs the same, and the model learns from several answers per image instead of one. Their
`question_type` joins the turns' types with "+".
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import random
from typing import Literal, NamedTuple

import numpy as np
from datasets import Dataset, Features, List, Value
from datasets import Image as ImageFeature
from PIL import Image, ImageDraw

from data.prompts import CAPTION_PROMPT
from typed_config import Config, check

SHAPES = ("circle", "square", "triangle", "diamond")
COLORS = {
    "red": (220, 30, 30),
    "green": (30, 160, 50),
    "blue": (40, 80, 230),
    "yellow": (240, 210, 0),
    "purple": (140, 50, 190),
    "orange": (245, 120, 0),
}
SIZES = {"small": 0.22, "large": 0.38}  # shape radius as a fraction of the cell side
# row-major
CELLS = ("top left", "top", "top right", "left", "center", "right", "bottom left", "bottom", "bottom right")
BACKGROUND = (235, 235, 235)
QUESTION_TYPES = ("color", "shape", "count", "presence", "position", "caption")
# Training only (never asked in validation): "Is the circle red?", yes or no, about a shape of the scene; half
# the time its own colour. The colour comparison that presence needs ("Is there a red circle?" when the circle
# is blue), asked where no shortcut answers it: the shape named is always there.
TRAINING_ONLY_TYPES = ("verify",)
# a shape's centre moves by up to this fraction of the cell; radius + jitter < 1/2 keeps it in its cell
JITTER = 0.05
_PREPOSITIONS = {"left": "on", "right": "on", "center": "in"}  # every other cell takes "at"

Split = Literal["train", "validation"]


class Item(NamedTuple):
    """One shape in a scene; `cell` indexes CELLS."""

    cell: int
    shape: str
    color: str
    size: str


Scene = tuple[Item, ...]  # sorted by cell: reading order, and the canonical form


def where(cell: int) -> str:
    """The cell as a phrase: 'at the top left', 'on the left', 'in the center', ..."""
    return f"{_PREPOSITIONS.get(CELLS[cell], 'at')} the {CELLS[cell]}"


def sample_scene(rng: random.Random) -> Scene:
    """1-4 distinct shapes in distinct cells, each with a random colour and size."""
    count = rng.randint(1, len(SHAPES))
    shapes, cells = rng.sample(SHAPES, count), rng.sample(range(len(CELLS)), count)
    colors, sizes = tuple(COLORS), tuple(SIZES)
    return tuple(
        sorted(Item(cell, shape, rng.choice(colors), rng.choice(sizes)) for shape, cell in zip(shapes, cells))
    )


def split_by_hash(key: str, validation_fraction: float) -> Split:
    """The split of the scene whose canonical content is `key`, from a stable hash (not Python's per-process
    `hash`): the same key lands in the same split on every machine, and `validation_fraction` of all keys in
    validation."""
    bucket = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64
    return "validation" if bucket < validation_fraction else "train"


def split_of(scene: Scene, validation_fraction: float) -> Split:
    """The split a scene belongs to, from its content."""
    return split_by_hash(";".join(f"{item.cell},{item.shape},{item.color},{item.size}" for item in scene),
                         validation_fraction)


def sample_scene_of(split: Split, rng: random.Random, validation_fraction: float) -> Scene:
    """A scene of `split`: scenes are drawn until one hashes into it."""
    while split_of(scene := sample_scene(rng), validation_fraction) != split:
        pass
    return scene


def render(scene: Scene, image_size: int, rng: random.Random) -> Image.Image:
    """Draw the scene crisply (no anti-aliasing) on a light background; `rng` jitters the shapes within their
    cells."""
    image = Image.new("RGB", (image_size, image_size), BACKGROUND)
    draw = ImageDraw.Draw(image)
    side = image_size / 3
    for item in scene:
        row, col = divmod(item.cell, 3)
        x, y = ((k + 0.5 + rng.uniform(-JITTER, JITTER)) * side for k in (col, row))
        r = SIZES[item.size] * side
        if item.shape == "circle":
            draw.ellipse((x - r, y - r, x + r, y + r), fill=COLORS[item.color])
            continue
        h = 0.85 * r  # a square of half-side r would look bigger than the other shapes
        corners = {
            "square": [(x - h, y - h), (x + h, y - h), (x + h, y + h), (x - h, y + h)],
            "triangle": [(x, y - r), (x + r, y + r), (x - r, y + r)],
            "diamond": [(x, y - r), (x + r, y), (x, y + r), (x - r, y)],
        }[item.shape]
        draw.polygon(corners, fill=COLORS[item.color])
    return image


# class 0: an empty cell
CELL_CLASSES = {"shape": ("none", *SHAPES), "color": ("none", *COLORS), "size": ("none", *SIZES)}


def cell_labels(scene: Scene) -> list[tuple[int, int, int]]:
    """Per cell (row-major), the class indices of its shape, colour and size in CELL_CLASSES; (0, 0, 0) when
    empty."""
    labels = [(0, 0, 0)] * len(CELLS)
    for item in scene:
        labels[item.cell] = tuple(CELL_CLASSES[name].index(value) for name, value in
                                  (("shape", item.shape), ("color", item.color), ("size", item.size)))
    return labels


def add_noise(image: Image.Image, amplitude: int, generator: np.random.Generator) -> Image.Image:
    """Uniform per-pixel, per-channel noise in [-amplitude, amplitude]."""
    noise = generator.integers(-amplitude, amplitude + 1, (image.height, image.width, 3), dtype=np.int16)
    return Image.fromarray((np.asarray(image, dtype=np.int16) + noise).clip(0, 255).astype(np.uint8))


def describe(scene: Scene) -> str:
    """The caption: every shape in reading order, "a small red circle at the top left and a large blue square
    in the center"."""
    parts = [f"a {item.size} {item.color} {item.shape} {where(item.cell)}" for item in scene]
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def ask(scene: Scene, question_type: str, rng: random.Random) -> tuple[str, str]:
    """A (question, answer) pair of the given type about the scene."""
    item = rng.choice(scene)
    if question_type == "color":
        return f"What color is the {item.shape}?", item.color
    if question_type == "shape":
        return f"What shape is {where(item.cell)}?", item.shape
    if question_type == "count":
        return "How many shapes are there?", str(len(scene))
    if question_type == "position":
        return f"Where is the {item.shape}?", CELLS[item.cell]
    if question_type == "caption":
        return CAPTION_PROMPT, describe(scene)
    if question_type == "verify":
        color = item.color if rng.random() < 0.5 else rng.choice([c for c in COLORS if c != item.color])
        return f"Is the {item.shape} {color}?", "yes" if color == item.color else "no"
    if question_type != "presence":
        raise ValueError(f"unknown question type {question_type!r}; expected one of "
                         f"{', '.join(QUESTION_TYPES + TRAINING_ONLY_TYPES)}")
    color = item.color
    shape = item.shape
    answer = "yes"
    if rng.random() < 0.5:  # half the time, a colour/shape pair that is genuinely absent
        present = {(i.color, i.shape) for i in scene}
        color, shape = rng.choice([(c, s) for c in COLORS for s in SHAPES if (c, s) not in present])
        answer = "no"
    article = "an" if color[0] in "aeiou" else "a"
    return f"Is there {article} {color} {shape}?", answer


def make_shapes_dataset(split: Split, num_samples: int, seed: int, image_size: int = 64, noise: int = 0,
                        turns: int = 1, validation_fraction: float = 0.1,
                        question_types: tuple[str, ...] = QUESTION_TYPES, labels: bool = False) -> Dataset:
    """`num_samples` records of `split`, each one image and `turns` question/answer turns; same arguments,
    same data. With `labels`, each record also carries its scene's `cell_labels` (per cell, the classes of
    its shape, colour and size: what the ViT's pre-training learns to name); the records are the same.

    Single-turn records cycle through `question_types`: a type listed twice is asked twice as often.

    With `noise`, images are stored clean and each record's fixed noise is added when it is read (noisy PNGs
    barely compress, and encoding them would triple the generation time).
    """
    check(split in ("train", "validation"), f"split must be 'train' or 'validation', got {split!r}")
    check(1 <= turns <= len(QUESTION_TYPES), f"turns must lie in [1, {len(QUESTION_TYPES)}], got {turns}")
    check(0 < validation_fraction < 1, f"validation_fraction must lie in (0, 1), got {validation_fraction}")
    check_question_types(question_types, known=QUESTION_TYPES if split == "validation" else
                         QUESTION_TYPES + TRAINING_ONLY_TYPES, name=f"{split} question_types")
    rng = random.Random(f"shapes:{split}:{seed}")
    rows: dict[str, list] = {"images": [], "texts": [], "question_type": [], "noise_seed": [],
                             **({"cell_labels": []} if labels else {})}
    while len(rows["texts"]) < num_samples:
        scene = sample_scene_of(split, rng, validation_fraction)
        if turns == 1:
            kinds = [question_types[len(rows["texts"]) % len(question_types)]]
        else:
            kinds = sorted(rng.sample(QUESTION_TYPES, turns), key=lambda kind: kind == "caption")
        rows["texts"].append([dict(zip(("user", "assistant"), ask(scene, kind, rng))) for kind in kinds])
        rows["question_type"].append("+".join(kinds))
        rows["images"].append([_png(render(scene, image_size, rng))])
        rows["noise_seed"].append(rng.getrandbits(63))  # drawn even without noise: same scenes either way
        if labels:
            rows["cell_labels"].append(cell_labels(scene))
    features = Features({
        "images": List(ImageFeature()),
        "texts": List({"user": Value("string"), "assistant": Value("string")}),
        "question_type": Value("string"),
        "noise_seed": Value("int64"),
        **({"cell_labels": List(List(Value("int64")))} if labels else {}),
    })
    dataset = Dataset.from_dict(rows, features=features)
    if not noise:
        return dataset.remove_columns("noise_seed")
    return dataset.with_transform(functools.partial(_add_noise_to_batch, amplitude=noise))


def check_question_types(question_types: tuple[str, ...], name: str = "question_types",
                         known: tuple[str, ...] = QUESTION_TYPES + TRAINING_ONLY_TYPES) -> None:
    """Fail with a clear message unless `question_types` is a non-empty list of `known` types."""
    unknown = sorted(set(question_types) - set(known))
    check(bool(question_types) and not unknown,
          f"{name} must list question types from {', '.join(known)}; got {list(question_types)}")


def _add_noise_to_batch(batch: dict[str, list], amplitude: int) -> dict[str, list]:
    seeds = batch.pop("noise_seed")
    batch["images"] = [[add_noise(image, amplitude, np.random.default_rng(seed)) for image in images]
                       for images, seed in zip(batch["images"], seeds)]
    return batch


def _png(image: Image.Image) -> dict:
    """Encoded for Arrow ourselves: fast zlib level 1 (lossless all the same) is ~3x quicker than the
    default."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=1)
    return {"bytes": buffer.getvalue(), "path": None}


@dataclasses.dataclass
class ShapesConfig(Config):
    """The synthetic shapes data: sizes of the two splits, image size, noise, turns per training record."""

    image_size: int = 64  # side of the square images in pixels
    num_train: int = 20000  # training records
    num_validation: int = 1200  # validation records (from scenes never used in training)
    seed: int = 0  # seed of the scene generator
    noise: int = 0  # uniform per-pixel noise amplitude on the 0-255 scale; 0 = clean images
    train_turns: int = 3  # question/answer turns per training record (validation records always hold one)
    # The cycle of single-turn training records' types, from QUESTION_TYPES and TRAINING_ONLY_TYPES.
    train_question_types: tuple[str, ...] = QUESTION_TYPES
    validation_fraction: float = 0.1  # share of all possible scenes reserved for validation

    def __post_init__(self) -> None:
        check(self.image_size >= 32, f"data.shapes.image_size must be at least 32, got {self.image_size}")
        check(self.num_train > 0 and self.num_validation > 0,
              f"data.shapes.num_train and num_validation must be positive, got {self.num_train} and "
              f"{self.num_validation}")
        check(0 <= self.noise <= 32,
              f"data.shapes.noise must lie in [0, 32] so colours stay recognisable, got {self.noise}")
        check(1 <= self.train_turns <= len(QUESTION_TYPES),
              f"data.shapes.train_turns must lie in [1, {len(QUESTION_TYPES)}], got {self.train_turns}")
        check_question_types(self.train_question_types, "data.shapes.train_question_types")
        check(self.train_turns == 1 or tuple(self.train_question_types) == QUESTION_TYPES,
              "data.shapes.train_question_types applies to single-turn records only: set "
              "data.shapes.train_turns to 1")
        check(0 < self.validation_fraction <= 0.5,
              f"data.shapes.validation_fraction must lie in (0, 0.5], got {self.validation_fraction}")


def shapes_datasets(config: ShapesConfig) -> tuple[Dataset, Dataset]:
    """(train, validation) as the config describes; validation records are single-turn."""
    common = dict(seed=config.seed, image_size=config.image_size, noise=config.noise,
                  validation_fraction=config.validation_fraction)
    return (make_shapes_dataset("train", config.num_train, turns=config.train_turns,
                                question_types=config.train_question_types, **common),
            make_shapes_dataset("validation", config.num_validation, turns=1, **common))
