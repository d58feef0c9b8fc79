"""Faults during training lose nothing: a SIGTERM writes a resumable checkpoint; a NaN loss never reaches the
weights; bad records are skipped and counted, or stop the run with a message naming them."""

import errno
import json
import os
import resource
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from data import build_datasets, make_shapes_dataset
from data.bad_records import checked_record
from loading import find_checkpoint
from models import CheckpointError, VisionLanguageModel
from tests.training.helpers import SMALL, small_config
from train import main
from training import checkpoint
from training.loop import TrainingError
from training.run import train


# `kill` signals the training process alone; Ctrl-C signals its whole process group, DataLoader workers
# included.
@pytest.mark.parametrize("signum, group", [(signal.SIGTERM, False), (signal.SIGINT, True)],
                         ids=["kill", "ctrl-c"])
def test_a_stop_signal_writes_a_resumable_checkpoint_and_exits_0(tmp_path, signum, group):
    overrides = [arg for key, value in {**SMALL, "train.max_steps": "100000", "train.save_every": "100000",
                                        "train.num_workers": "2", "train.output_dir": str(tmp_path)}.items()
                 for arg in (f"--{key}", value)]
    process = subprocess.Popen([sys.executable, "train.py", *overrides], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 180
    while "model:" not in process.stdout.readline() and time.monotonic() < deadline:
        assert process.poll() is None, process.stderr.read()
    time.sleep(3)  # a few steps in
    sent = time.monotonic()
    if group:
        os.killpg(process.pid, signum)
    else:
        process.send_signal(signum)
    out, err = process.communicate(timeout=30)
    assert process.returncode == 0, err
    assert time.monotonic() - sent < 30
    checkpoints = sorted(tmp_path.glob("step_*"))
    assert len(checkpoints) == 1 and f"{signum.name}: saved" in out
    state = json.loads((checkpoints[0] / "training_state.json").read_text())
    step = state["step"]
    config = small_config(tmp_path, **{"train.max_steps": str(step + 2)})
    train(config, resume=checkpoints[0])
    assert (
        json.loads((tmp_path / f"step_{step + 2:06d}" / "training_state.json").read_text())["step"]
        == step + 2
    )


def test_a_stop_signal_during_the_final_evaluation_writes_metrics_and_exits_0(tmp_path):
    """SIGTERM while the held-out questions are asked (sent from inside generate): the run ends with its
    checkpoint, a metrics.json that says it was stopped and holds no scores, a line on stderr, exit code 0 (it
    exited 143 with neither). In a process of its own: before the fix the signal killed whatever received
    it."""
    overrides = {**SMALL, "train.max_steps": "2", "train.save_every": "2", "train.eval_every": "2",
                 "train.output_dir": str(tmp_path)}
    argv = [arg for key, value in overrides.items() for arg in (f"--{key}", value)]
    script = f"""
import os, signal, sys
from models import VisionLanguageModel
from train import main

original = VisionLanguageModel.generate
def generate(self, *args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)
    return original(self, *args, **kwargs)
VisionLanguageModel.generate = generate
sys.exit(main({argv!r}))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "SIGTERM: stopped during the final evaluation" in done.stderr and "Traceback" not in done.stderr
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["stopped_by"] == "SIGTERM during the final evaluation" and metrics["step"] == 2
    assert "accuracy" not in metrics and (tmp_path / "step_000002" / "model.safetensors").is_file()


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
    train(small_config(tmp_path,
                       **{"train.max_steps": "6", "train.save_every": "6", "train.eval_every": "6"}))
    state = json.loads((tmp_path / "step_000006" / "training_state.json").read_text())
    assert state["skipped_steps"] == 1
    weights = load_file(tmp_path / "step_000006" / "model.safetensors")
    assert all(torch.isfinite(t).all() for t in weights.values())


def test_a_nan_loss_stops_the_run_when_asked(tmp_path, monkeypatch):
    _nan_on_call(monkeypatch, bad_call=4)
    config = small_config(tmp_path,
                          **{"train.max_steps": "6", "train.save_every": "2", "train.eval_every": "6",
                             "train.on_nonfinite": "stop"})
    with pytest.raises(TrainingError, match="non-finite loss or gradient at step 4"):
        train(config)
    assert [p.name for p in sorted(tmp_path.glob("step_*"))] == ["step_000002"]


def _jsonl_with_bad_images(tmp_path, bad: dict[int, bytes], malformed: dict[int, str] | None = None):
    """A JSONL dataset of 40 synthetic records whose images at the `bad` indices are overwritten with those
    bytes, and whose lines at the `malformed` indices are replaced by those."""
    rows = make_shapes_dataset("train", 40, seed=0, image_size=32)
    lines = []
    for i, row in enumerate(rows):
        row["images"][0].save(tmp_path / f"{i}.png")
        if i in bad:
            (tmp_path / f"{i}.png").write_bytes(bad[i])
        lines.append((malformed or {}).get(i, json.dumps({"images": [f"{i}.png"], "texts": row["texts"]})))
    (tmp_path / "data.jsonl").write_text("\n".join(lines))
    return {"data.source": "jsonl", "data.path": str(tmp_path / "data.jsonl"), "data.holdout": "4"}


@pytest.mark.parametrize("workers", ["0", "2"])
def test_bad_records_are_skipped_and_counted_once(tmp_path, workers):
    """Each step reads every record: a bad one is read 3 times and counted once, in the workers as in this
    process."""
    malformed = {
        5: "{not json",
        9: json.dumps({"images": ["gone.png"], "texts": [{"user": "q", "assistant": "a"}]}),
        13: json.dumps({"texts": [{"user": "no answer"}]}),
    }  # data.on_bad_record=skip skips these too
    data = _jsonl_with_bad_images(tmp_path, {3: b"", 7: b"\x89PNG\r\n\x1a\n truncated", 11: b"plain text"},
                                  malformed)
    config = small_config(tmp_path / "run", **data, **{"train.max_steps": "3", "train.save_every": "3",
                                                       "train.eval_every": "3", "train.num_workers": workers,
                                                       # one batch = every training record
                                                       "train.batch_size": "36"})
    train_data, _ = build_datasets(config.data)
    assert len(train_data) == 36
    bad_in_train = sum(1 for i in range(36) if _unreadable(train_data, i))
    metrics = train(config)
    assert metrics["bad_records"] == bad_in_train > 0
    state = json.loads((tmp_path / "run" / "step_000003" / "training_state.json").read_text())
    assert state["bad_records"] == metrics["bad_records"]
    weights = load_file(tmp_path / "run" / "step_000003" / "model.safetensors")
    assert all(torch.isfinite(t).all() for t in weights.values())


def _unreadable(dataset, index: int) -> bool:
    try:
        checked_record(dataset[index])
    except ValueError:  # ImageLoadError, or a malformed line's problem
        return True
    return False


@pytest.mark.parametrize("workers", ["0", "2"])
def test_a_bad_record_stops_the_run_when_asked(tmp_path, capsys, workers):
    """Met in a DataLoader worker, the error reaches the command line as the same one line."""
    data = _jsonl_with_bad_images(tmp_path, {i: b"plain text" for i in range(40) if i % 5 == 0})
    overrides = {**SMALL, **data, "train.max_steps": "8", "train.output_dir": str(tmp_path / "run"),
                 "data.on_bad_record": "fail", "train.num_workers": workers}
    assert main([arg for key, value in overrides.items() for arg in (f"--{key}", value)]) == 2
    err = capsys.readouterr().err
    error = err.strip().splitlines()[-1]
    assert (
        "Traceback" not in err and error.startswith("error: train record ") and "not an image file" in error
    )
    assert error.endswith("set data.on_bad_record=skip to skip and count such records")


def _two_steps(tmp_path):
    """A run directory holding a complete checkpoint at step 2, and the config that continues it to step 4."""
    train(small_config(tmp_path,
                       **{"train.max_steps": "2", "train.save_every": "2", "train.eval_every": "2"}))
    return small_config(tmp_path,
                        **{"train.max_steps": "4", "train.save_every": "2", "train.eval_every": "4"})


def _assert_step_2_intact(run_dir):
    assert find_checkpoint(run_dir).name == "step_000002"
    assert not list(run_dir.glob(".staging*")) and not list(run_dir.glob("step_000004"))
    VisionLanguageModel.from_pretrained(run_dir / "step_000002")  # loads, complete


def test_disk_full_while_saving_is_a_clear_error_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    config = _two_steps(tmp_path)

    def full_disk(tensors, path, **kwargs):
        path.write_bytes(b"\0" * 1000)  # part of the file got out before the disk filled up
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, "save_file", full_disk)
    with pytest.raises(CheckpointError,
                       match=r"could not write checkpoint .*step_000004 \(\[Errno 28\] No space left "
                                              r"on device\); the newest complete checkpoint, .*step_000002, "
                                              r"is intact"):
        train(config, resume=tmp_path / "step_000002")
    _assert_step_2_intact(tmp_path)


def test_a_real_write_failure_exits_with_one_line_and_resume_still_works(tmp_path):
    """The OS refuses the write (RLIMIT_FSIZE: files may not grow past the model's size, so the optimizer
    state fails)."""
    _two_steps(tmp_path)
    limit = (tmp_path / "step_000002" / "model.safetensors").stat().st_size + 4096
    overrides = ["--train.max_steps", "4", "--train.eval_every", "4"]
    result = subprocess.run([sys.executable, "train.py", "--resume", str(tmp_path), *overrides],
                            capture_output=True, text=True, timeout=300,
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("error: could not write checkpoint") and "step_000002, is intact" in error, error
    _assert_step_2_intact(tmp_path)
    assert main(["--resume", str(tmp_path), *overrides]) == 0
    assert find_checkpoint(tmp_path).name == "step_000004"


def test_workers_and_resume_change_nothing_and_count_each_record_once(tmp_path):
    """Two epochs over records of which some are bad and some too long: a run with DataLoader workers, stopped
    and resumed, trains bit for bit as one run without workers, and both count each bad or too-long record
    once (the second epoch reads them all again, after the resume)."""
    from transformers import AutoTokenizer

    from data import encode_conversation

    data = _jsonl_with_bad_images(tmp_path, {3: b"", 7: b"plain text", 30: b"plain text"})
    settings = {**data, "train.batch_size": "12", "train.max_length": "60", "train.save_every": "3",
                "train.eval_every": "6"}  # 36 records: an epoch is 3 steps
    whole = train(small_config(tmp_path / "whole", **settings,
                               **{"train.max_steps": "6", "train.num_workers": "0"}))
    train(small_config(tmp_path / "split", **settings, **{"train.max_steps": "3", "train.num_workers": "2"}))
    split = train(
        small_config(tmp_path / "split", **settings, **{"train.max_steps": "6", "train.num_workers": "2"}),
        resume=tmp_path / "split" / "step_000003",
    )

    train_data, _ = build_datasets(small_config(tmp_path, **settings).data)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "whole" / "step_000006")
    readable = [i for i in range(len(train_data)) if not _unreadable(train_data, i)]
    tokens = [len(encode_conversation(tokenizer, train_data[i]["texts"], 1, 16)[0]) for i in readable]
    assert whole["bad_records"] == split["bad_records"] == len(train_data) - len(readable) > 0
    assert whole["too_long_records"] == split["too_long_records"] == sum(n > 60 for n in tokens) > 0
    for run in ("whole", "split"):
        state = json.loads((tmp_path / run / "step_000006" / "training_state.json").read_text())
        assert state["bad_record_indices"] == [i for i in range(len(train_data)) if i not in readable]
    (whole_state, whole_weights), (split_state, split_weights) = (
        (json.loads((tmp_path / run / "step_000006" / "training_state.json").read_text()),
         load_file(tmp_path / run / "step_000006" / "model.safetensors")) for run in ("whole", "split"))
    assert split_state["history"] == whole_state["history"]
    assert all(torch.equal(split_weights[name], tensor) for name, tensor in whole_weights.items())
