"""A second synthetic set, disjoint from the default shapes: one object per image, exported as a user's own
JSONL data.

The default generator (data/synthetic.py) never draws these shapes, colours or backgrounds, nor asks these
questions, so a model that scores well on this set's held-out split learned it from the JSONL files alone.
Nothing in data/sources.py or configs/ uses it: it stands in for a user's data.

    python -m data.synthetic_objects /tmp/objects   # 20,000 train + 500 validation records, 64 px
    python train.py --data.source jsonl --data.path /tmp/objects/train.jsonl \\
        --data.validation_path /tmp/objects/validation.jsonl

A scene is one object (star, cross, hexagon, ring, heart or crescent), small or big, on the left, in the
middle or on the right (with jitter), in one of six colours on one of four backgrounds (two dark, two light,
one of each a vertical gradient) that contrasts with it. Each record asks one question of five types in turn
(colour, shape, size, position, background), each worded by one of a few templates, with a one-word lowercase
answer; lines carry its `question_type`.

Train/validation split as in data/synthetic.py: by a stable hash of the scene's content, so no validation
scene (same shape, colour, size, position and background) ever appears in training.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from PIL import Image, ImageDraw

from data.synthetic import Split, split_by_hash
from models.errors import TinyVLMError
from typed_config import check, one_line

# Built as data/synthetic.py is (sample a scene, split by its hash, render, ask), sharing none of its
# vocabulary.

SHAPES = ("star", "cross", "hexagon", "ring", "heart", "crescent")
COLOURS = {
    "pink": (255, 105, 180),
    "brown": (140, 80, 30),
    "cyan": (0, 210, 230),
    "black": (15, 15, 15),
    "white": (250, 250, 250),
    "grey": (128, 128, 128),
}
# name: (top colour, bottom colour, dark); the colour runs linearly from top to bottom
BACKGROUNDS = {
    "slate": ((45, 55, 70), (45, 55, 70), True),
    "night": ((15, 25, 60), (60, 50, 110), True),
    "cream": ((240, 225, 180), (240, 225, 180), False),
    "sky": ((130, 180, 235), (195, 220, 245), False),
}
SIZES = {"small": 0.12, "big": 0.19}  # the object's radius as a fraction of the image side
POSITIONS = {"left": 0.25, "middle": 0.5, "right": 0.75}  # the object's centre, as a fraction of the width
JITTER = 0.03  # the centre moves by up to this fraction of the width; the radius by up to 8%
VALIDATION_FRACTION = 0.1  # share of all possible scenes (there are 720) reserved for validation
MIN_CONTRAST = 100  # least RGB distance between an object's colour and any pixel of its background
QUESTION_TYPES = ("colour", "shape", "size", "position", "background")
TEMPLATES = {
    "colour": (
        "Which colour is the object?",
        "Name the colour of the thing in the picture.",
        "What is the colour of the object?",
    ),
    "shape": ("What kind of shape is this?", "Which shape is drawn here?", "Name the shape in the picture."),
    "size": (
        "Is the object big or small?",
        "How large is the object, big or small?",
        "Is the thing in the picture small or big?",
    ),
    "position": (
        "Where in the picture is the object: left, middle or right?",
        "Is the object on the left, in the middle or on the right?",
        "Which part of the picture holds the object?",
    ),
    "background": (
        "Is the background dark?",
        "Is the object on a dark background?",
        "Is it dark behind the object?",
    ),
}
ANSWERS = {"colour": tuple(COLOURS), "shape": SHAPES, "size": tuple(SIZES), "position": tuple(POSITIONS),
           "background": ("yes", "no")}


class Scene(NamedTuple):
    """One object on a background; the fields are also the answers to the first four question types."""

    shape: str
    colour: str
    size: str
    position: str
    background: str


def contrast(colour: tuple[int, int, int], background: str) -> float:
    """The least RGB distance between `colour` and any colour on the background's top-to-bottom gradient."""
    top, bottom, _ = BACKGROUNDS[background]
    run = [b - t for t, b in zip(top, bottom)]
    offset = [c - t for t, c in zip(top, colour)]
    length = sum(r * r for r in run)
    along = min(1.0, max(0.0, sum(r * o for r, o in zip(run, offset)) / length)) if length else 0.0
    return math.dist(colour, [t + along * r for t, r in zip(top, run)])


# per colour, the backgrounds it stands out on
BACKGROUNDS_FOR = {name: tuple(b for b in BACKGROUNDS if contrast(rgb, b) >= MIN_CONTRAST)
                   for name, rgb in COLOURS.items()}


def sample_scene(rng: random.Random) -> Scene:
    """A random object; its background is one of those that contrast with its colour."""
    colour = rng.choice(tuple(COLOURS))
    return Scene(rng.choice(SHAPES), colour, rng.choice(tuple(SIZES)), rng.choice(tuple(POSITIONS)),
                 rng.choice(BACKGROUNDS_FOR[colour]))


def split_of(scene: Scene) -> Split:
    """The split a scene belongs to, from its content."""
    return split_by_hash(",".join(scene), VALIDATION_FRACTION)


@functools.cache
def background(name: str, image_size: int) -> Image.Image:
    """The background alone (a vertical gradient, or one colour); cached, so copy it before drawing on it."""
    top, bottom, _ = BACKGROUNDS[name]
    column = Image.new("RGB", (1, image_size))
    column.putdata([tuple(round(t + (b - t) * y / max(1, image_size - 1)) for t, b in zip(top, bottom))
                    for y in range(image_size)])
    return column.resize((image_size, image_size), Image.Resampling.NEAREST)


def _polygon(x: float, y: float, radii: list[float],
             start: float = -math.pi / 2) -> list[tuple[float, float]]:
    """Vertices at the given radii around (x, y), evenly spaced clockwise from `start` (straight up)."""
    step = 2 * math.pi / len(radii)
    return [
        (x + r * math.cos(start + i * step), y + r * math.sin(start + i * step)) for i, r in enumerate(radii)
    ]


def _draw_mask(draw: ImageDraw.ImageDraw, shape: str, x: float, y: float, r: float) -> None:
    """The shape in 255 on an L-mode mask (holes cut back to 0), centred at (x, y), reaching about r from
    it."""
    if shape == "star":
        draw.polygon(_polygon(x, y, [r, 0.45 * r] * 5), fill=255)
    elif shape == "cross":
        w = 0.33 * r
        draw.rectangle((x - r, y - w, x + r, y + w), fill=255)
        draw.rectangle((x - w, y - r, x + w, y + r), fill=255)
    elif shape == "hexagon":
        draw.polygon(_polygon(x, y, [r] * 6), fill=255)
    elif shape == "ring":
        draw.ellipse((x - r, y - r, x + r, y + r), fill=255)
        draw.ellipse((x - 0.55 * r, y - 0.55 * r, x + 0.55 * r, y + 0.55 * r), fill=0)
    elif shape == "heart":
        lobe = 0.5 * r
        for cx in (x - lobe, x + lobe):
            draw.ellipse((cx - lobe, y - 0.3 * r - lobe, cx + lobe, y - 0.3 * r + lobe), fill=255)
        draw.polygon([(x - r, y - 0.3 * r), (x + r, y - 0.3 * r), (x, y + r)], fill=255)
    elif shape == "crescent":
        # the disc's centre shifted right: the crescent's own centre is near x
        disc, cut = x + 0.3 * r, x + 0.9 * r
        draw.ellipse((disc - r, y - r, disc + r, y + r), fill=255)
        draw.ellipse((cut - 0.8 * r, y - 0.8 * r, cut + 0.8 * r, y + 0.8 * r), fill=0)
    else:
        raise ValueError(f"unknown shape {shape!r}; expected one of {', '.join(SHAPES)}")


def render(scene: Scene, image_size: int, rng: random.Random) -> Image.Image:
    """Draw the scene crisply (no anti-aliasing: every object pixel has its exact colour); `rng` gives the
    jitter."""
    image = background(scene.background, image_size).copy()
    mask = Image.new("L", (image_size, image_size), 0)
    x = (POSITIONS[scene.position] + rng.uniform(-JITTER, JITTER)) * image_size
    y = rng.uniform(0.3, 0.7) * image_size
    _draw_mask(ImageDraw.Draw(mask), scene.shape, x, y,
               SIZES[scene.size] * image_size * rng.uniform(0.92, 1.08))
    image.paste(COLOURS[scene.colour], mask=mask)
    return image


def answer_of(scene: Scene, question_type: str) -> str:
    """The one-word answer to a question of `question_type` about the scene."""
    if question_type == "background":
        return "yes" if BACKGROUNDS[scene.background][2] else "no"
    if question_type not in QUESTION_TYPES:
        raise ValueError(f"unknown question type {question_type!r}; expected one of "
                         f"{', '.join(QUESTION_TYPES)}")
    return getattr(scene, question_type)


def ask(scene: Scene, question_type: str, rng: random.Random) -> tuple[str, str]:
    """A (question, answer) pair of the type, the question worded by a random template."""
    answer = answer_of(scene, question_type)
    return rng.choice(TEMPLATES[question_type]), answer


class Sample(NamedTuple):
    """One record: the image, one question about it and its answer, the question's type, and the scene
    drawn."""

    image: Image.Image
    question: str
    answer: str
    question_type: str
    scene: Scene


def generate(split: Split, num_samples: int, seed: int, image_size: int = 64) -> Iterator[Sample]:
    """`num_samples` single-question samples of `split`, their types in turn (equal shares); same arguments,
    same samples."""
    check(split in ("train", "validation"), f"split must be 'train' or 'validation', got {split!r}")
    rng = random.Random(f"objects:{split}:{seed}")
    for i in range(num_samples):
        while split_of(scene := sample_scene(rng)) != split:
            pass
        question_type = QUESTION_TYPES[i % len(QUESTION_TYPES)]
        question, answer = ask(scene, question_type, rng)
        yield Sample(render(scene, image_size, rng), question, answer, question_type, scene)


def export_jsonl(out_dir: str | Path, num_train: int = 20000, num_validation: int = 500, seed: int = 0,
                 image_size: int = 64) -> dict[str, Path]:
    """Write PNGs under `out_dir/images/` and `train.jsonl` / `validation.jsonl` in the JSONL format
    data/sources.py's `load_jsonl` reads, each line one image, one question and its `question_type`; return
    the JSONL paths by split."""
    check(num_train > 0 and num_validation > 0,
          f"the train and validation record counts must be positive, got {num_train} and {num_validation}")
    check(image_size >= 16, f"the image size must be at least 16 px, got {image_size}")
    out_dir = Path(out_dir)
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, count in (("train", num_train), ("validation", num_validation)):
        lines = []
        for i, sample in enumerate(generate(split, count, seed, image_size)):
            name = f"images/{split}_{i:06d}.png"
            sample.image.save(out_dir / name, compress_level=1)
            lines.append(json.dumps({"images": [name],
                                     "texts": [{"user": sample.question, "assistant": sample.answer}],
                                     "question_type": sample.question_type}))
        paths[split] = out_dir / f"{split}.jsonl"
        paths[split].write_text("\n".join(lines) + "\n")
    return paths


def main(argv: list[str] | None = None) -> int:
    """The command line; exit code 0, or 2 with a one-line error."""
    parser = argparse.ArgumentParser(prog="python -m data.synthetic_objects", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path, help="where images/, train.jsonl and validation.jsonl go")
    parser.add_argument("--train", type=int, default=20000, help="training records (default 20000)")
    parser.add_argument("--validation", type=int, default=500, help="validation records (default 500)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--image-size", type=int, default=64, help="image side in pixels (default 64)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        paths = export_jsonl(args.out_dir, args.train, args.validation, args.seed, args.image_size)
    except (TinyVLMError, OSError) as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 2
    print(f"wrote {args.train} train and {args.validation} validation records ({args.image_size} px) to "
          f"{paths['train']} and {paths['validation']} in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
