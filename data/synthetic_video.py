"""Synthetic clips of moving shapes, generated in code (the offline default's video task), deterministic by
seed: each frame a scene drawn as data/synthetic.py draws its scenes (shapes in a 3x3 grid), so the ViT's
pre-training on those scenes reads the frames too.

Four question types, one a clip:
- direction: "Which way does the circle move?" (left, right, up or down; chance 25%): the circle crosses its
  row or column, one cell at a time, between distractors that stay put;
- first_color: "Which color appears first?": two shapes appear one after the other and stay;
- blink: "How many times does the square blink?" (0, 1 or 2): the square, in the first and the last frame,
  vanishes for a frame or more, once or twice or never, between distractors that stay put;
- last_frame: "What is in the last frame?" ("a red circle"): one shape a frame, each frame another.

A clip is `frames` frames at `fps` frames a second, which the model's video settings sample whole (checked by
training/config.py), as they would sample the clip written to a file (`write_video`): a record carries the
`Clip` that `read_video` would give. Train/validation split by a stable hash of the clip's content (its type
and every frame's shapes), so a validation clip never appears in training.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import random

from datasets import Dataset, Features, List, Value
from datasets import Image as ImageFeature

from data.synthetic import (
    COLORS,
    SHAPES,
    SIZES,
    Item,
    Scene,
    Split,
    _png,
    check_question_types,
    render,
    split_by_hash,
)
from data.video import Clip
from typed_config import Config, check

QUESTION_TYPES = ("direction", "first_color", "blink", "last_frame")
DIRECTIONS = {"left": (0, -1), "right": (0, 1), "up": (-1, 0), "down": (1, 0)}  # (row, column) steps
MAX_BLINKS = 2
MAX_DISTRACTORS = 2


def _item(rng: random.Random, shape: str, cell: int) -> Item:
    return Item(cell, shape, rng.choice(tuple(COLORS)), rng.choice(tuple(SIZES)))


def _distractors(rng: random.Random, kept_out: str, cells: list[int]) -> list[Item]:
    """Up to MAX_DISTRACTORS shapes (never a `kept_out`) in some of `cells`."""
    count = rng.randint(0, min(MAX_DISTRACTORS, len(cells)))
    shapes = rng.sample([shape for shape in SHAPES if shape != kept_out], count)
    return [_item(rng, shape, cell) for shape, cell in zip(shapes, rng.sample(cells, count))]


def _direction(rng: random.Random, frames: int) -> tuple[list[Scene], str]:
    direction = rng.choice(tuple(DIRECTIONS))
    d_row, d_col = DIRECTIONS[direction]
    line = rng.randrange(3)
    moves = sorted(rng.sample(range(1, frames), 2))  # the frames where the circle enters its next cell
    steps = [sum(move <= t for move in moves) for t in range(frames)]  # 0, ..., 2
    along = [step if d_row + d_col > 0 else 2 - step for step in steps]
    cells = [line * 3 + a if d_col else a * 3 + line for a in along]
    circle = _item(rng, "circle", cells[0])
    others = _distractors(rng, "circle", [cell for cell in range(9) if cell not in cells])
    return [tuple(sorted([circle._replace(cell=cell), *others])) for cell in cells], direction


def _first_color(rng: random.Random, frames: int) -> tuple[list[Scene], str]:
    shapes, colors, cells = rng.sample(SHAPES, 2), rng.sample(tuple(COLORS), 2), rng.sample(range(9), 2)
    first = rng.randrange(frames - 1)
    appear = (first, rng.randrange(first + 1, frames))
    items = [Item(cell, shape, color, rng.choice(tuple(SIZES)))
             for cell, shape, color in zip(cells, shapes, colors)]
    scenes = [tuple(sorted(item for item, at in zip(items, appear) if at <= t)) for t in range(frames)]
    return scenes, colors[0]


def _blink(rng: random.Random, frames: int) -> tuple[list[Scene], str]:
    blinks = rng.randint(0, min(MAX_BLINKS, (frames - 1) // 2))
    middles = [shown for shown in itertools.product((True, False), repeat=frames - 2)
               if _runs_hidden(shown) == blinks]
    shown = (True, *rng.choice(middles), True)
    square = _item(rng, "square", rng.randrange(9))
    others = _distractors(rng, "square", [cell for cell in range(9) if cell != square.cell])
    return [tuple(sorted([*others, square] if visible else others)) for visible in shown], str(blinks)


def _runs_hidden(shown: tuple[bool, ...]) -> int:
    """How many separate stretches of frames the square is hidden in."""
    return sum(not visible and (i == 0 or shown[i - 1]) for i, visible in enumerate(shown))


def _last_frame(rng: random.Random, frames: int) -> tuple[list[Scene], str]:
    scenes = [(_item(rng, rng.choice(SHAPES), rng.randrange(9)),) for _ in range(frames)]
    last = scenes[-1][0]
    return scenes, f"a {last.color} {last.shape}"


QUESTIONS = {
    "direction": ("Which way does the circle move?", _direction),
    "first_color": ("Which color appears first?", _first_color),
    "blink": ("How many times does the square blink?", _blink),
    "last_frame": ("What is in the last frame?", _last_frame),
}


def sample_clip(question_type: str, frames: int, rng: random.Random) -> tuple[list[Scene], str]:
    """The scenes of one clip asking `question_type`, and the answer."""
    return QUESTIONS[question_type][1](rng, frames)


def split_of(question_type: str, scenes: list[Scene], validation_fraction: float) -> Split:
    """The split a clip belongs to, from its content."""
    key = "|".join(";".join(f"{i.cell},{i.shape},{i.color},{i.size}" for i in scene) for scene in scenes)
    return split_by_hash(f"{question_type}|{key}", validation_fraction)


def make_video_dataset(split: Split, num_samples: int, seed: int, image_size: int, frames: int, fps: float,
                       validation_fraction: float = 0.1,
                       question_types: tuple[str, ...] = QUESTION_TYPES) -> Dataset:
    """`num_samples` records of `split`, one clip and one question each, the types in turn (a type listed
    twice is asked twice as often); same arguments, same data. A record reads as {"images": [], "video":
    Clip, "texts", "question_type"}."""
    check(split in ("train", "validation"), f"split must be 'train' or 'validation', got {split!r}")
    check_question_types(question_types, f"{split} question_types", known=QUESTION_TYPES)
    rng = random.Random(f"video-shapes:{split}:{seed}")
    rows: dict[str, list] = {"video": [], "texts": [], "question_type": []}
    while len(rows["texts"]) < num_samples:
        kind = question_types[len(rows["texts"]) % len(question_types)]
        while split_of(kind, (clip := sample_clip(kind, frames, rng))[0], validation_fraction) != split:
            pass
        scenes, reply = clip
        rows["video"].append([_png(render(scene, image_size, rng)) for scene in scenes])
        rows["texts"].append([{"user": QUESTIONS[kind][0], "assistant": reply}])
        rows["question_type"].append(kind)
    features = Features({"video": List(ImageFeature()),
                         "texts": List({"user": Value("string"), "assistant": Value("string")}),
                         "question_type": Value("string")})
    return Dataset.from_dict(rows, features=features).with_transform(functools.partial(_as_clips, fps=fps))


def _as_clips(batch: dict[str, list], fps: float) -> dict[str, list]:
    """Each record's frames as the `Clip` that reading the clip from a file at `fps` gives."""
    clips = [Clip(frames, list(range(len(frames))), [i / fps for i in range(len(frames))], len(frames) / fps)
             for frames in batch["video"]]
    return {**batch, "video": clips, "images": [[] for _ in clips]}


@dataclasses.dataclass
class VideoShapesConfig(Config):
    """The synthetic clips (data.source=synthetic_video): sizes of the two splits, frames per clip and their
    rate; each frame data.shapes.image_size pixels square."""

    num_train: int = 20000  # training records
    num_validation: int = 600  # validation records (from clips never used in training)
    seed: int = 0  # seed of the clip generator
    frames: int = 5  # frames per clip
    fps: float = 1.0  # the clips' frame rate: model.video must sample every frame
    train_question_types: tuple[str, ...] = QUESTION_TYPES  # the cycle of training records' types
    validation_fraction: float = 0.1  # share of all possible clips reserved for validation

    def __post_init__(self) -> None:
        check(self.num_train > 0 and self.num_validation > 0,
              f"data.video_shapes.num_train and num_validation must be positive, got {self.num_train} and "
              f"{self.num_validation}")
        check(self.frames >= 3, f"data.video_shapes.frames must be at least 3, got {self.frames}")
        check(self.fps > 0, f"data.video_shapes.fps must be positive, got {self.fps}")
        check_question_types(self.train_question_types, "data.video_shapes.train_question_types",
                             known=QUESTION_TYPES)
        check(0 < self.validation_fraction <= 0.5,
              f"data.video_shapes.validation_fraction must lie in (0, 0.5], got {self.validation_fraction}")


def video_shapes_datasets(config: VideoShapesConfig, image_size: int) -> tuple[Dataset, Dataset]:
    """(train, validation) as the config describes, frames `image_size` pixels square."""
    common = dict(seed=config.seed, image_size=image_size, frames=config.frames, fps=config.fps,
                  validation_fraction=config.validation_fraction)
    return (make_video_dataset("train", config.num_train, question_types=config.train_question_types,
                               **common),
            make_video_dataset("validation", config.num_validation, **common))
