"""Faults during training lose nothing: a SIGTERM writes a resumable checkpoint; a NaN loss never reaches the weights."""

import json
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from models import VisionLanguageModel
from tests.training.helpers import SMALL, small_config
from train import TrainingError, train


def test_sigterm_writes_a_resumable_checkpoint_and_exits_0(tmp_path):
    overrides = [arg for key, value in {**SMALL, "train.max_steps": "100000", "train.save_every": "100000",
                                        "train.output_dir": str(tmp_path)}.items() for arg in (f"--{key}", value)]
    process = subprocess.Popen([sys.executable, "train.py", *overrides], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    while "model:" not in (line := process.stdout.readline()) and time.monotonic() < deadline:
        assert process.poll() is None, process.stderr.read()
    time.sleep(3)  # a few steps in
    sent = time.monotonic()
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=30)
    assert process.returncode == 0, err
    assert time.monotonic() - sent < 30
    checkpoints = sorted(tmp_path.glob("step_*"))
    assert len(checkpoints) == 1 and "SIGTERM: saved" in out
    state = json.loads((checkpoints[0] / "training_state.json").read_text())
    step = state["step"]
    config = small_config(tmp_path, **{"train.max_steps": str(step + 2)})
    train(config, resume=checkpoints[0])
    assert json.loads((tmp_path / f"step_{step + 2:06d}" / "training_state.json").read_text())["step"] == step + 2


def _nan_on_call(monkeypatch, bad_call: int):
    original, calls = VisionLanguageModel.forward, []

    def forward(self, *args, **kwargs):
        logits, loss = original(self, *args, **kwargs)
        calls.append(1)
        if self.training and len(calls) == bad_call:
            loss = loss * float("nan")
        return logits, loss

    monkeypatch.setattr(VisionLanguageModel, "forward", forward)


def test_a_nan_loss_is_skipped_and_never_saved(tmp_path, monkeypatch):
    _nan_on_call(monkeypatch, bad_call=3)
    train(small_config(tmp_path, **{"train.max_steps": "6", "train.save_every": "6", "train.eval_every": "6"}))
    state = json.loads((tmp_path / "step_000006" / "training_state.json").read_text())
    assert state["skipped_steps"] == 1
    weights = load_file(tmp_path / "step_000006" / "model.safetensors")
    assert all(torch.isfinite(t).all() for t in weights.values())


def test_a_nan_loss_stops_the_run_when_asked(tmp_path, monkeypatch):
    _nan_on_call(monkeypatch, bad_call=4)
    config = small_config(tmp_path, **{"train.max_steps": "6", "train.save_every": "2", "train.eval_every": "6",
                                       "train.on_nonfinite": "stop"})
    with pytest.raises(TrainingError, match="non-finite loss or gradient at step 4"):
        train(config)
    assert [p.name for p in sorted(tmp_path.glob("step_*"))] == ["step_000002"]
