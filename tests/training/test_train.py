"""Training end to end on a very small config: the loss falls, and a resumed run equals an uninterrupted one."""

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.training.helpers import small_config
from training.config import RunConfig
from train import ResumableBatchSampler, train

def _history(run_dir):
    last = sorted(run_dir.glob("step_*"))[-1]
    return json.loads((last / "training_state.json").read_text())["history"], load_file(last / "model.safetensors")


def test_loss_falls_and_the_run_leaves_its_artifacts(tmp_path):
    metrics = train(small_config(tmp_path, **{"train.max_steps": "40", "train.eval_every": "40", "train.save_every": "40"}))
    history, _ = _history(tmp_path)
    losses = [loss for _, loss in history]
    assert len(losses) == 40
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5
    for name in ("metrics.json", "loss_curve.png", "predictions.png", "heldout_example.png", "step_000040/config.json",
                 "step_000040/model.safetensors", "step_000040/tokenizer.json", "step_000040/run_config.json"):
        assert (tmp_path / name).is_file(), name
    assert json.loads((tmp_path / "metrics.json").read_text())["validation_loss"] == metrics["validation_loss"]


def test_resume_equals_an_uninterrupted_run(tmp_path):
    steps = {"train.decay_steps": "12", "train.save_every": "6", "train.eval_every": "6"}
    train(small_config(tmp_path / "whole", **steps, **{"train.max_steps": "12"}))
    train(small_config(tmp_path / "split", **steps, **{"train.max_steps": "6"}))
    config = RunConfig.from_json(tmp_path / "split" / "step_000006" / "run_config.json").replace({"train.max_steps": "12"})
    train(config, resume=tmp_path / "split" / "step_000006")
    (whole, whole_weights), (split, split_weights) = _history(tmp_path / "whole"), _history(tmp_path / "split")
    assert [s for s, _ in split] == list(range(1, 13))
    torch.testing.assert_close(torch.tensor([l for _, l in split]), torch.tensor([l for _, l in whole]), atol=1e-6, rtol=0)
    for name, tensor in whole_weights.items():
        torch.testing.assert_close(split_weights[name], tensor, atol=1e-6, rtol=0)


def test_batches_are_a_function_of_their_position():
    stream = iter(ResumableBatchSampler(20, 4, seed=3))
    batches = [next(stream) for _ in range(12)]  # 48 samples: epochs of 20, each a fresh permutation
    flat = [i for batch in batches for i in batch]
    assert sorted(flat[:20]) == sorted(flat[20:40]) == list(range(20)) and flat[:20] != flat[20:40]
    resumed = iter(ResumableBatchSampler(20, 4, seed=3, start=28))  # from any sample count
    assert [next(resumed) for _ in range(5)] == batches[7:12]


def test_ranks_split_each_global_batch():
    """Rank r of N takes the r-th slice of the batch one rank with N times the batch size would see."""
    single = iter(ResumableBatchSampler(20, 6, seed=1, start=2))
    ranks = [iter(ResumableBatchSampler(20, 2, seed=1, start=2, rank=r, world_size=3)) for r in range(3)]
    for _ in range(10):
        assert next(single) == [i for rank in ranks for i in next(rank)]
