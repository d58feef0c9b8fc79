"""train.keep_checkpoints: after every save only the newest `keep` step_* directories remain, the highest
steps."""

import pytest
import torch

from tests.models.helpers import base_tokenizer, tiny_vlm
from tests.training.helpers import small_config
from training.checkpoint import save_checkpoint
from training.config import RunConfig
from training.run import train


def _steps(run_dir) -> list[int]:
    return sorted(int(path.name.removeprefix("step_")) for path in run_dir.glob("step_*"))


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_only_the_newest_checkpoints_are_kept(tmp_path, keep):
    model, tokenizer = tiny_vlm(), base_tokenizer()
    optimizer = torch.optim.AdamW(model.parameters())
    saved = []
    for step in (1, 2, 5, 10, 99, 100, 1000):
        save_checkpoint(tmp_path, step, model, tokenizer, optimizer, RunConfig(), keep)
        saved.append(step)
        assert _steps(tmp_path) == saved[-keep:], step
    # nothing staged or retired
    assert not [p.name for p in tmp_path.iterdir() if not p.name.startswith("step_")]


def test_a_run_keeps_train_keep_checkpoints(tmp_path):
    train(small_config(tmp_path, **{"train.max_steps": "5", "train.save_every": "1", "train.eval_every": "5",
                                    "train.keep_checkpoints": "3"}))
    assert _steps(tmp_path) == [3, 4, 5]
