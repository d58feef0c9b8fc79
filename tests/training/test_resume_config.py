"""A resumed run follows its new config: changed learning rates, weight decay, betas and schedule apply from
the step it resumes at, exactly as in a fresh run of the new config; freezing or unfreezing a part on resume
is refused; a run goes on in the directory it is resumed from."""

import contextlib
import shutil

import pytest
from torch.optim.optimizer import register_optimizer_step_pre_hook

from tests.training.helpers import small_config
from train import main
from training.run import train
from typed_config import ConfigError

CHANGED = {"train.lr_language": "0.002", "train.lr_projector": "0.004", "train.max_steps": "10",
           "train.warmup_steps": "3", "train.min_lr_ratio": "0.2", "train.weight_decay": "0.1",
           "train.adam_beta2": "0.9"}


@contextlib.contextmanager
def optimizer_settings():
    """Each optimizer step's {param group: (lr, weight_decay, betas)}, as the step sees them."""
    seen = []
    handle = register_optimizer_step_pre_hook(lambda optimizer, args, kwargs: seen.append(
        {g["name"]: (g["lr"], g["weight_decay"], tuple(g["betas"])) for g in optimizer.param_groups}))
    try:
        yield seen
    finally:
        handle.remove()


def test_a_resumed_run_follows_its_new_optimizer_settings(tmp_path):
    steps = {"train.save_every": "4", "train.eval_every": "10"}
    train(small_config(tmp_path / "split", **steps, **{"train.max_steps": "4"}))
    with optimizer_settings() as resumed:
        train(small_config(tmp_path / "split", **steps, **CHANGED), resume=tmp_path / "split" / "step_000004")
    with optimizer_settings() as fresh:
        train(small_config(tmp_path / "fresh", **steps, **CHANGED))
    assert len(resumed) == 6 and len(fresh) == 10
    assert resumed == fresh[4:]  # steps 5..10: the new schedule at those steps, not the old one carried on


@pytest.mark.parametrize("before, after", [("0.01", "0"), ("0", "0.01")])
def test_freezing_or_unfreezing_a_part_on_resume_is_refused(tmp_path, before, after):
    steps = {"train.max_steps": "2", "train.save_every": "2", "train.eval_every": "2"}
    train(small_config(tmp_path, **steps, **{"train.lr_vision": before}))
    with pytest.raises(ConfigError,
                       match=rf"^train.lr_vision cannot change from {before} to {after} on resume"):
        train(small_config(tmp_path, **{**steps, "train.max_steps": "4", "train.lr_vision": after}),
              resume=tmp_path / "step_000002")


def test_a_copied_run_resumes_in_the_copy_and_leaves_the_original_alone(tmp_path):
    """The run_config.json of a copied run still names the original's output_dir: resuming the copy once wrote
    its new checkpoints there and pruned the original's (train.keep_checkpoints)."""
    train(small_config(tmp_path / "original", **{"train.max_steps": "2", "train.save_every": "1",
                                                   "train.eval_every": "10"}))
    before = sorted(p.name for p in (tmp_path / "original").iterdir())
    shutil.copytree(tmp_path / "original", tmp_path / "copy")
    assert main(["--resume", str(tmp_path / "copy"), "--train.max_steps", "4"]) == 0
    assert sorted(p.name for p in (tmp_path / "original").iterdir()) == before
    assert sorted(p.name for p in (tmp_path / "copy").glob("step_*")) == ["step_000003", "step_000004"]
    # an explicit output directory still wins
    assert main(["--resume", str(tmp_path / "copy" / "step_000004"), "--train.max_steps", "5",
                 "--train.output_dir", str(tmp_path / "elsewhere")]) == 0
    assert [p.name for p in (tmp_path / "elsewhere").glob("step_*")] == ["step_000005"]
