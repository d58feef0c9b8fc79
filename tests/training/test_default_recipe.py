"""The default recipe (configs/tiny.yaml, unchanged but for its length) learns: a short run reads the images.

The full run's held-out scores over seeds are a benchmark (benchmarks/seeds.py), not a test; this checks in well under
a minute that the shipped settings train at all: the held-out loss falls far below a model that has not trained, and
the model counts shapes, which it can only do by reading the image (chance: 1 in 4).
"""

import json
import math

import pytest

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
