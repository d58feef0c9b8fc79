"""train.keep_checkpoints: after every save only the run's newest `keep` step_* directories remain, the
highest steps; a run never deletes another run's checkpoints (each records the run that wrote it), and a fresh
run refuses a directory that holds another run."""

import json

import pytest
import torch

from tests.models.helpers import base_tokenizer, tiny_vlm
from tests.training.helpers import SMALL, small_config
from train import main
from training import run
from training.checkpoint import save_checkpoint
from training.config import RunConfig
from training.run import train


def _steps(run_dir) -> list[int]:
    return sorted(int(path.name.removeprefix("step_")) for path in run_dir.glob("step_*"))


def _run_ids(run_dir) -> dict[int, str | None]:
    return {step: json.loads((run_dir / f"step_{step:06d}" / "training_state.json").read_text()).get("run_id")
            for step in _steps(run_dir)}


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_only_the_newest_checkpoints_are_kept(tmp_path, keep):
    model, tokenizer = tiny_vlm(), base_tokenizer()
    optimizer = torch.optim.AdamW(model.parameters())
    saved = []
    for step in (1, 2, 5, 10, 99, 100, 1000):
        save_checkpoint(tmp_path, step, model, tokenizer, optimizer, RunConfig(), keep, "run")
        saved.append(step)
        assert _steps(tmp_path) == saved[-keep:], step
    # nothing staged or retired
    assert not [p.name for p in tmp_path.iterdir() if not p.name.startswith("step_")]


def test_pruning_never_deletes_another_runs_checkpoints(tmp_path):
    """Two runs saving into one directory, and a checkpoint without a run id (written before run ids): each
    run keeps its own newest two; the others' checkpoints all stay."""
    model, tokenizer = tiny_vlm(), base_tokenizer()
    optimizer = torch.optim.AdamW(model.parameters())
    save_checkpoint(tmp_path, 1, model, tokenizer, optimizer, RunConfig(), 2, "old")
    state = tmp_path / "step_000001" / "training_state.json"
    state.write_text(json.dumps({k: v for k, v in json.loads(state.read_text()).items() if k != "run_id"}))
    for step in (10, 20, 30):
        save_checkpoint(tmp_path, step, model, tokenizer, optimizer, RunConfig(), 2, "first")
    for step in (2, 3, 4, 5):
        save_checkpoint(tmp_path, step, model, tokenizer, optimizer, RunConfig(), 2, "second")
    assert _run_ids(tmp_path) == {1: None, 4: "second", 5: "second", 20: "first", 30: "first"}


def test_a_run_keeps_train_keep_checkpoints(tmp_path):
    train(small_config(tmp_path, **{"train.max_steps": "5", "train.save_every": "1", "train.eval_every": "5",
                                    "train.keep_checkpoints": "3"}))
    assert _steps(tmp_path) == [3, 4, 5]
    assert len(set(_run_ids(tmp_path).values())) == 1


def test_a_fresh_run_into_another_runs_directory_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    """Before any data is read; --train.overwrite true writes into it anyway, and the other run's checkpoints
    stay while the new run prunes its own (train.keep_checkpoints)."""
    settings = {"train.save_every": "1", "train.eval_every": "100", "train.eval_questions": "0"}
    train(small_config(tmp_path, **settings, **{"train.max_steps": "4"}))  # keeps steps 3 and 4
    before = {path: path.stat().st_mtime_ns for path in tmp_path.rglob("*")}
    first = _run_ids(tmp_path)

    def no_data(config):
        raise AssertionError("the data was read")

    monkeypatch.setattr(run, "build_datasets", no_data)
    overrides = {**SMALL, **settings, "train.max_steps": "2", "train.output_dir": str(tmp_path)}
    argv = [arg for key, value in overrides.items() for arg in (f"--{key}", value)]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: train.output_dir ({tmp_path}) holds another run "
                                               "(metrics.json, step_000003, step_000004)"), err
    assert all(option in err[0] for option in (f"--resume {tmp_path}", "--train.output_dir",
                                               "--train.overwrite true"))
    assert {path: path.stat().st_mtime_ns for path in tmp_path.rglob("*")} == before

    monkeypatch.undo()
    train(small_config(tmp_path, **settings, **{"train.max_steps": "2", "train.keep_checkpoints": "1",
                                                "train.overwrite": "true"}))
    ids = _run_ids(tmp_path)
    assert ids.keys() == {2, 3, 4} and (ids[3], ids[4]) == (first[3], first[4])
    assert ids[2] not in first.values()
