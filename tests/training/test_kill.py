"""SIGKILL while a checkpoint is being saved, over and over: every time, `--resume` finds a valid checkpoint,
and the run's final weights equal those of a run that was never interrupted.

Each of the ~22 runs is `train.main` in a process forked from a server that has already imported what a run
imports (train.py, torch._dynamo through torch.optim, matplotlib for the plots): ~6 s of imports paid once
instead of at each start. The kill, the checkpoint on disk and the resume are those of `python train.py`.
"""

import json
import multiprocessing
import os
import random
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from loading import STATE_JSON, checkpoints
from models import VisionLanguageModel
from tests.training.helpers import SMALL, small_config
from training.checkpoint import STATE_TENSORS
from training.run import train

STEPS = 60
KILLS_WHILE_SAVING = 20


def _assert_all_checkpoints_valid(run_dir) -> None:
    for checkpoint in checkpoints(run_dir):
        VisionLanguageModel.from_pretrained(checkpoint)
        load_file(checkpoint / STATE_TENSORS)
        assert json.loads((checkpoint / STATE_JSON).read_text())["step"] == int(
            checkpoint.name.removeprefix("step_")
        )


_FORKS = multiprocessing.get_context("forkserver")
_FORKS.set_forkserver_preload(["train", "torch._dynamo", "matplotlib.pyplot"])


def _train_main(argv: list[str], log_path: str) -> None:
    """`python train.py ARGV`, output appended to `log_path`; the exit code is train.py's."""
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.dup2(log, 1)
    os.dup2(log, 2)
    import train

    sys.exit(train.main(argv))


def _start(run_dir, log_path) -> multiprocessing.Process:
    if checkpoints(run_dir):
        argv = ["--resume", str(run_dir)]
    else:  # killed before its first checkpoint was complete: start afresh
        settings = {**SMALL, "train.max_steps": str(STEPS), "train.save_every": "1",
                    "train.eval_every": str(STEPS), "train.output_dir": str(run_dir)}
        argv = [arg for key, value in settings.items() for arg in (f"--{key}", value)]
    process = _FORKS.Process(target=_train_main, args=(argv, str(log_path)))
    process.start()
    return process


def _kill_during_a_save(process: multiprocessing.Process, run_dir, rng: random.Random) -> bool:
    """Wait for the process's n-th save (n random in 1..3), SIGKILL it a random moment later; True if a
    staging directory still existed right before the kill (the kill hit a save in progress)."""
    wanted, seen, last = rng.randint(1, 3), 0, None
    while process.is_alive():
        staging = next(run_dir.glob(".staging_step_*"), None)
        if staging is not None and staging.name != last:
            seen, last = seen + 1, staging.name
            if seen == wanted:
                time.sleep(rng.uniform(0, 0.02))
                saving = next(run_dir.glob(".staging_step_*"), None) is not None
                process.kill()
                process.join()
                return saving
        time.sleep(0.0005)
    return False


@pytest.mark.slow
def test_sigkill_while_saving_never_corrupts_and_resume_matches_an_uninterrupted_run(tmp_path):
    reference = tmp_path / "reference"
    train(small_config(reference, **{"train.max_steps": str(STEPS), "train.save_every": str(STEPS),
                                     "train.eval_every": str(STEPS)}))

    run_dir, rng, kills = tmp_path / "killed", random.Random(0), 0
    run_dir.mkdir()
    log = tmp_path / "log.txt"
    while kills < KILLS_WHILE_SAVING:
        process = _start(run_dir, log)
        kills += _kill_during_a_save(process, run_dir, rng)
        process.join()
        assert process.exitcode == -9, f"the run ended before {KILLS_WHILE_SAVING} kills; raise STEPS"
        _assert_all_checkpoints_valid(run_dir)
    process = _start(run_dir, log)
    process.join(timeout=300)
    if process.is_alive():  # hung: end it here, or pytest would wait for its child at exit
        process.kill()
        process.join()
    assert process.exitcode == 0, log.read_text()[-2000:]

    final, expected = (load_file(d / f"step_{STEPS:06d}" / "model.safetensors") for d in (run_dir, reference))
    assert final.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(final[name], expected[name], rtol=0, atol=1e-6, msg=name)
