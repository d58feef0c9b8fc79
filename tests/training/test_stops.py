"""A stop signal at any point of a run: during the start-up it ends the command at once with one line (nothing
to save yet); during the ViT's pre-training it saves the pre-training, and `--resume` then trains exactly the
run that was never stopped. A resume with nothing left to train says so in one line."""

import json
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from data import make_shapes_dataset
from tests.training.helpers import PRETRAINED_VIT, SMALL, small_config
from train import main
from training import answer_pretraining, run, vision_pretraining
from training.checkpoint import PRETRAINING
from training.run import train

STEPS = 4
PRETRAINING_STEPS = 6


def _argv(settings: dict[str, str]) -> list[str]:
    return [arg for key, value in {**SMALL, **settings}.items() for arg in (f"--{key}", value)]


def _jsonl(directory) -> dict[str, str]:
    """40 records of one's own (with question types) as JSONL, and the settings that train on them."""
    directory.mkdir()
    lines = []
    for i, row in enumerate(make_shapes_dataset("train", 40, seed=0, image_size=32)):
        row["images"][0].save(directory / f"{i}.png")
        lines.append(json.dumps({"images": [f"{i}.png"], "texts": row["texts"],
                                 "question_type": row["question_type"]}))
    (directory / "data.jsonl").write_text("\n".join(lines))
    return {"data.source": "jsonl", "data.path": str(directory / "data.jsonl"), "data.holdout": "4"}


def _objective(name: str, tmp_path) -> tuple[dict[str, str], object, str]:
    """The settings of a short run that pre-trains its ViT with objective `name` (data in `tmp_path`), the
    module and the name of the function that draws each pre-training batch."""
    common = {"train.max_steps": str(STEPS), "train.save_every": str(STEPS), "train.eval_every": str(STEPS),
              "train.eval_questions": "4", "train.vision_pretrain_batch_size": "8"}
    if name == "cells":
        return ({**PRETRAINED_VIT, **common, "train.vision_pretrain_steps": str(PRETRAINING_STEPS)},
                vision_pretraining, "scene_batch")
    # through the fixed projector (lr_projector 0), the types drawn by their running loss
    return ({**_jsonl(tmp_path / "data"), **common, "train.vision_pretrain_steps": "1",
             "train.answer_pretrain_steps": str(PRETRAINING_STEPS), "train.lr_projector": "0"},
            answer_pretraining, "_batch")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """For an objective: its settings, where its batches are drawn, and its run, never stopped (trained once
    for the module)."""
    runs = {}

    def get(objective: str) -> tuple[dict[str, str], object, str, object]:
        if objective not in runs:
            directory = tmp_path_factory.mktemp(objective)
            settings, module, draws = _objective(objective, directory)
            train(small_config(directory / "whole", **settings))
            runs[objective] = settings, module, draws, directory / "whole"
        return runs[objective]

    return get


def _signal_at_call(monkeypatch, module, name: str, call: int, signum=signal.SIGINT) -> None:
    """`module.name` sends this process `signum` at its `call`-th call (in that pre-training step)."""
    original, calls = getattr(module, name), []

    def drawing(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            signal.raise_signal(signum)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, drawing)


def _final(run_dir) -> tuple[list, dict[str, torch.Tensor]]:
    checkpoint = run_dir / f"step_{STEPS:06d}"
    return (json.loads((checkpoint / "training_state.json").read_text())["history"],
            load_file(checkpoint / "model.safetensors"))


# a stop in step 3 of 6 saves the pre-training there; one in its last step ends it, and the loop's first step
# saves step 1
@pytest.mark.parametrize("objective", ["cells", "answers"])
@pytest.mark.parametrize("stop_in_step", [3, PRETRAINING_STEPS])
def test_a_stop_during_vision_pretraining_saves_it_and_resume_equals_an_uninterrupted_run(
        uninterrupted, tmp_path, capsys, monkeypatch, objective, stop_in_step):
    settings, module, draws, whole = uninterrupted(objective)
    _signal_at_call(monkeypatch, module, draws, stop_in_step)
    split = tmp_path / "split"
    capsys.readouterr()
    assert main(_argv({**settings, "train.output_dir": str(split)})) == 0
    out = capsys.readouterr().out
    monkeypatch.undo()
    if stop_in_step < PRETRAINING_STEPS:
        saved = split / PRETRAINING
        assert (f"SIGINT: stopped the ViT's pre-training at step {stop_in_step}/{PRETRAINING_STEPS}, saved "
                f"{saved}; continue with: python train.py --resume {saved}") in out, out
        assert not list(split.glob("step_*"))
        assert json.loads((saved / "pretraining_state.json").read_text())["step"] == stop_in_step
    else:
        assert f"SIGINT: saved {split / 'step_000001'}" in out, out
        assert [p.name for p in split.glob("step_*")] == ["step_000001"]
        assert not (split / PRETRAINING).exists()

    assert main(["--resume", str(split)]) == 0
    assert not (split / PRETRAINING).exists()  # its first step checkpoint replaced it
    (whole_history, whole_weights), (split_history, split_weights) = _final(whole), _final(split)
    assert split_history == whole_history
    assert whole_weights.keys() == split_weights.keys()
    # the same code on the same CPU: bit for bit
    assert [name for name, w in whole_weights.items() if not torch.equal(split_weights[name], w)] == []


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stop_signal_during_the_start_up_ends_the_command_with_one_line(tmp_path, signum):
    """`python train.py` (run as __main__) gets the signal while it reads the data: exit code 130, one line
    saying that nothing was saved (a SIGTERM used to end it without a word, a SIGINT with a traceback)."""
    script = f"""
import os, runpy, signal, sys, time
from training import run

def build_datasets(config):
    signal.raise_signal({int(signum)})
    time.sleep(60)  # the signal ends the process first
    raise AssertionError("the signal did not end the process")

run.build_datasets = build_datasets
sys.argv = ["train.py", *{_argv({"train.output_dir": str(tmp_path)})!r}]
runpy.run_path("train.py", run_name="__main__")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 130, done.stderr
    assert done.stderr.strip().splitlines() == [f"{signum.name}: stopped before training started; nothing to "
                                                "save"], done.stderr
    assert "reading the data" in done.stdout and not any(tmp_path.iterdir())


def test_a_resume_with_nothing_left_to_train_says_so_in_one_line(tmp_path, capsys, monkeypatch):
    train(small_config(tmp_path, **{"train.max_steps": "2", "train.save_every": "2", "train.eval_every": "2",
                                    "train.eval_questions": "0"}))
    before = {path: path.stat().st_mtime_ns for path in tmp_path.rglob("*")}
    monkeypatch.setattr(run, "build_datasets", lambda config: pytest.fail("the data was read"))
    for max_steps in ("2", "1"):
        capsys.readouterr()
        assert main(["--resume", str(tmp_path), "--train.max_steps", max_steps]) == 2
        out, err = capsys.readouterr()
        assert err.strip().splitlines() == [
            f"error: {tmp_path / 'step_000002'} is at step 2 and train.max_steps is {max_steps}: nothing "
            "left to train (set a higher --train.max_steps to train on)"], err
        assert "resuming" not in out
    assert {path: path.stat().st_mtime_ns for path in tmp_path.rglob("*")} == before
