"""Finding checkpoints in run directories: the highest step of a run, the newest run under runs/."""

import json
import os
import shutil

import pytest

from loading import STATE_JSON, find_checkpoint, newest_checkpoint
from models import CheckpointError


def _checkpoint(run, step: int, mtime: float):
    directory = run / f"step_{step:06d}"
    directory.mkdir(parents=True)
    (directory / STATE_JSON).write_text(json.dumps({"step": step}))
    os.utime(directory / STATE_JSON, (mtime, mtime))
    return directory


def test_a_copied_run_answers_from_its_highest_step(tmp_path):
    """Regression: the newest checkpoint was picked by file time alone, and `cp -r` gives a copied run's files
    times in copy order, so a copy could resume or answer from an older step."""
    old = tmp_path / "runs" / "old"
    _checkpoint(old, 100, mtime=1_000)
    _checkpoint(old, 200, mtime=2_000)
    copy = tmp_path / "runs" / "copy"
    shutil.copytree(old, copy)
    os.utime(copy / "step_000200" / STATE_JSON, (5_000, 5_000))  # copied first,
    os.utime(copy / "step_000100" / STATE_JSON, (6_000, 6_000))  # then this one
    assert newest_checkpoint(tmp_path / "runs") == copy / "step_000200"
    assert find_checkpoint(copy) == copy / "step_000200"


def test_the_newest_run_wins_and_incomplete_checkpoints_are_ignored(tmp_path):
    runs = tmp_path / "runs"
    _checkpoint(runs / "a", 900, mtime=1_000)
    _checkpoint(runs / "b", 10, mtime=3_000)
    (runs / "b" / "step_000020").mkdir()  # no training state yet: still being written
    assert newest_checkpoint(runs) == runs / "b" / "step_000010"


def test_no_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="train one"):
        newest_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="no checkpoint here"):
        find_checkpoint(tmp_path)


def test_a_missing_local_run_is_no_such_directory_not_a_hub_miss(tmp_path, monkeypatch):
    """Regression: `--checkpoint runs/nope` (a typo of a local run) said the hub could not provide it. A name
    whose first part is a local directory, or that has a path's form, is a local path; only "owner/name"
    goes to the hub."""
    import models.weights
    from loading import locate

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "tiny").mkdir(parents=True)
    (tmp_path / "runs" / "mine").mkdir()
    monkeypatch.setattr("huggingface_hub.snapshot_download",
                        lambda *args, **kwargs: pytest.fail("asked the hub for a local path"))
    for name in ("runs/nope", "./nope", "runs/tiny/step_000100", "a/b/c", "nope"):
        with pytest.raises(CheckpointError, match="no such file or directory") as raised:
            locate(name)
        assert "hub" not in str(raised.value)
    with pytest.raises(CheckpointError, match=r"^runs/nope: no such file or directory \(runs/ holds: mine, "
                                              r"tiny\)$"):
        locate("runs/nope")
    assert models.weights.looks_like_hub_id("HuggingFaceTB/SmolVLM-256M-Instruct")
    assert not models.weights.looks_like_hub_id("runs/anything")


def test_models_imports_nothing_from_the_rest_of_the_repo():
    """The README's promise: other projects can take models/ alone (every module of it, loaders included)."""
    import subprocess
    import sys

    code = ("import sys, pkgutil, importlib, models; "
            "[importlib.import_module(f'models.{m.name}') for m in pkgutil.iter_modules(models.__path__)]; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'data', 'training', 'serving', "
            "'generate'}))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
