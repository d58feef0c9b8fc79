"""The local lmms-eval task's data: held-out questions of the synthetic shapes (never a training scene),
written as JSONL + PNG files where evaluation/tasks/tinyvlm_shapes/*.yaml reads them (relative to the working
directory).

    python -m evaluation.shapes_task      # runs/lmms_eval/shapes, as configs/tiny.yaml draws them
    python -m lmms_eval --model tinyvlm --model_args checkpoint=runs/tiny --include_path evaluation/tasks \\
        --tasks tinyvlm_shapes,tinyvlm_shapes_choice --batch_size 32

`tinyvlm_shapes` scores generated answers by exact match (training/evaluate.py's); `tinyvlm_shapes_choice`
asks the same questions as multiple choice over every answer of the question's type, scored by log-likelihood.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from data.synthetic import CELLS, COLORS, QUESTION_TYPES, SHAPES, ShapesConfig, make_shapes_dataset
from training.config import load_run_config

DEFAULT_DIRECTORY = Path("runs/lmms_eval/shapes")  # where the task's YAML looks, from the repository's root
CHOICES = {"color": tuple(COLORS), "shape": SHAPES, "count": ("1", "2", "3", "4"), "presence": ("yes", "no"),
           "position": CELLS}  # every answer a question of each type can have (captions are not asked)


def write_shapes_task(directory: Path, num_questions: int, shapes: ShapesConfig) -> list[dict]:
    """`num_questions` held-out questions (types cycling, no captions) of the shapes set `shapes` draws (its
    image size, seed and split), as `directory`/test.jsonl with one PNG per question; returns the rows."""
    questions = tuple(kind for kind in QUESTION_TYPES if kind != "caption")
    records = make_shapes_dataset("validation", num_questions, shapes.seed, shapes.image_size, shapes.noise,
                                  validation_fraction=shapes.validation_fraction, question_types=questions)
    directory.mkdir(parents=True, exist_ok=True)
    rows = []
    for index, record in enumerate(records):
        image = directory / f"{index:05d}.png"
        record["images"][0].save(image)
        turn, kind = record["texts"][0], record["question_type"]
        rows.append({"question_id": index, "question": turn["user"], "answer": turn["assistant"],
                     "question_type": kind, "choices": list(CHOICES[kind]),
                     "answer_index": CHOICES[kind].index(turn["assistant"]), "image": str(image.resolve())})
    (directory / "test.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny.yaml", help="the run config whose shapes to draw")
    parser.add_argument("--num-questions", type=int, default=500)
    parser.add_argument("--out", type=Path, default=DEFAULT_DIRECTORY)
    args = parser.parse_args()
    rows = write_shapes_task(args.out, args.num_questions, load_run_config(args.config, {}).data.shapes)
    print(f"{len(rows)} questions written to {args.out / 'test.jsonl'}")


if __name__ == "__main__":
    main()
