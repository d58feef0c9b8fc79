"""The README is executable: every code block after the set-up commands carries a marker, and each block
marked to run does, as written, in a copy of the repository holding a tiny trained run at runs/tiny (offline,
bounded in time).

Markers, an HTML comment on the line before a block:
- `<!-- readme: run -->`: a bash block runs with `bash -euo pipefail`, a python block with `python`; exit code
  0. `| expect: "TEXT"` asks for TEXT in its output; `| train-args: ARGS` adds ARGS to each `python train.py`
     that starts
  a run (not a --resume), so that training stops after a few steps.
- `<!-- readme: hub -->`: commands that need the Hugging Face hub: offline, each stops with one `error:` line.
- `<!-- readme: not run (WHY) -->`: GPUs, many machines.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.training.helpers import SMALL
from training.config import load_run_config
from training.run import train

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(?:<!-- readme: (?P<marker>.*?) -->\n)?```(?P<language>\w*)\n(?P<code>.*?)```", re.S)
TIMEOUT = 300


def blocks() -> list[tuple[str | None, str, str]]:
    """(marker, language, code) of every fenced block of the README, in order."""
    text = (ROOT / "README.md").read_text()
    return [(m["marker"], m["language"], m["code"]) for m in BLOCK.finditer(text)]


def _options(marker: str) -> dict[str, str]:
    kind, *options = (part.strip() for part in marker.split("|"))
    values = {"kind": kind}
    for option in options:
        key, _, value = option.partition(":")
        values[key.strip()] = value.strip().strip('"')
    return values


RUN = [(i, _options(marker), language, code) for i, (marker, language, code) in enumerate(blocks())
       if marker and marker.startswith("run")]
HUB = [line for marker, _, code in blocks() if marker == "hub" for line in code.splitlines() if line.strip()]


def test_every_block_after_the_set_up_is_marked():
    first, *rest = blocks()
    assert "make demo" in first[2] and "make test" in first[2] and first[0] is None
    commands = [(marker, code) for marker, language, code in rest if language]  # a plain block is no command
    unmarked = [code.splitlines()[0] for marker, code in commands if marker is None]
    assert not unmarked, f"README blocks without a readme marker: {unmarked}"
    kinds = {_options(marker)["kind"].split(" ")[0] for marker, _ in commands}
    assert kinds <= {"run", "hub", "not"}, kinds
    assert RUN and HUB


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """A copy of the repository's tracked files with a tiny run trained into runs/tiny, and the environment to
    run commands in (this interpreter's `python` first on PATH, the hub offline)."""
    copy = tmp_path_factory.mktemp("readme") / "tinyvlm"
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, tracked.decode().split("\0")):
        target = copy / name
        if (ROOT / name).is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, target)
    train(load_run_config(copy / "configs" / "tiny.yaml", {
        **SMALL, "train.max_steps": "4", "train.save_every": "4", "train.eval_every": "4",
        "train.eval_questions": "4", "train.output_dir": str(copy / "runs" / "tiny")}))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline",
           "PYTHONPATH": str(copy)}
    return copy, env


def _with_train_args(code: str, args: str) -> str:
    return "\n".join(line.replace("python train.py", f"python train.py {args}", 1)
                     if line.startswith("python train.py") and "--resume" not in line else line
                     for line in code.splitlines())


@pytest.mark.parametrize("index, options, language, code", RUN, ids=[f"block{i}-{code.split()[0]}"
                                                                      for i, _, _, code in RUN])
def test_a_runnable_block_runs_as_written(workspace, index, options, language, code):
    directory, env = workspace
    if "train-args" in options:
        code = _with_train_args(code, options["train-args"])
    if language == "python":
        (directory / "readme_block.py").write_text(code)
        command = [sys.executable, "readme_block.py"]
    else:
        assert language == "bash", language
        command = ["bash", "-euo", "pipefail", "-c", code]
    done = subprocess.run(command, cwd=directory, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, (
        f"{code}\n--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}"
    )
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    if "expect" in options:
        assert options["expect"] in done.stdout, done.stdout[-3000:]


@pytest.mark.parametrize("command", HUB)
def test_a_hub_command_offline_stops_with_one_line(workspace, command):
    directory, env = workspace
    code = command.split("#")[0]
    done = subprocess.run(["bash", "-c", code], cwd=directory, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1].startswith("error: "), done.stderr[-3000:]
