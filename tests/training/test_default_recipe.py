"""The default recipe (configs/tiny.yaml, unchanged but for its length) learns: a short run reads the images,
on the synthetic shapes and on a user's own JSONL records (data/synthetic_objects.py's set), with no other
flag.

The full run's held-out scores over seeds are a benchmark (benchmarks/seeds.py), not a test; this checks in
well under a minute that the shipped settings train at all: the held-out loss falls far below a model that has
not trained, and the model counts shapes, which it can only do by reading the image (chance: 1 in 4).
"""

import json
import math

import pytest

from data.synthetic_objects import export_jsonl
from training import run
from training.answer_pretraining import pretraining_on_answers
from training.config import load_run_config
from training.run import train

SHORT = {"train.max_steps": "300", "train.vision_pretrain_steps": "100", "train.warmup_steps": "30",
         "train.eval_every": "300", "train.save_every": "300", "train.eval_questions": "120",
         "data.shapes.num_train": "9600", "data.shapes.num_validation": "120"}


@pytest.mark.slow  # ~50 s on 2 cores
def test_the_default_recipe_learns_to_read_images_in_a_short_run(tmp_path):
    config = load_run_config("configs/tiny.yaml", {**SHORT, "train.output_dir": str(tmp_path)})
    metrics = train(config)
    start = math.log(config.model.language.vocab_size)  # an untrained model's loss, give or take (~6)
    assert metrics["validation_loss"] < 0.12 * start, metrics  # ~0.72
    assert metrics["accuracy/count"] >= 0.9, metrics
    assert json.loads((tmp_path / "metrics.json").read_text())["step"] == 300


@pytest.mark.slow  # ~100 s on a 2-core AMD EPYC (Zen 3)
def test_the_default_recipe_learns_from_a_users_own_jsonl(tmp_path, monkeypatch):
    """The ViT pre-trains on the records' own questions and answers (no labels; by their question type,
    through the fixed projector), then the LM learns to read it: the background and the colour, which only the
    image shows (chance: 1 in 2 and 1 in 6; 1.0 and 0.45 this short, on an AMD EPYC with LM lr 0.002: at 300
    steps colour was 0.35, on the bound)."""
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return pretraining_on_answers(*args, **kwargs)

    monkeypatch.setattr(run, "pretraining_on_answers", spy)
    paths = export_jsonl(tmp_path / "objects", num_train=1000, num_validation=100)
    steps = {"train.answer_pretrain_steps": "100", "train.max_steps": "400", "train.eval_every": "400",
             "train.save_every": "400"}
    config = load_run_config("configs/tiny.yaml", {
        **SHORT, **steps, "train.output_dir": str(tmp_path / "run"),
        "data.source": "jsonl", "data.path": str(paths["train"]),
        "data.validation_path": str(paths["validation"])})
    metrics = train(config)
    (call,) = calls
    assert call["steps"] == 100 and call["projector"] is not None and len(set(call["question_types"])) == 5
    # ~0.50 < 1.3
    assert metrics["validation_loss"] < 0.12 * math.log(config.model.language.vocab_size), metrics
    assert metrics["accuracy/background"] >= 0.9 and metrics["accuracy/colour"] >= 0.35, metrics
