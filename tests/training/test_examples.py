"""The training commands of the README, docs/training.md and `train.py --help` never train into another
run's directory: each fresh run names its own (only the demo itself trains the tiny default into runs/tiny),
and the own-data and fine-tuning commands run as written, scaled down, beside a trained runs/tiny that they
leave untouched."""

import json
import re
import shlex
from pathlib import Path

import pytest

import train
from data import make_shapes_dataset
from loading import find_checkpoint
from tests.training.helpers import SMALL, small_config
from training.config import FINE_TUNE_DIR, load_run_config
from training.run import train as train_run

ROOT = Path(__file__).resolve().parents[2]
DEMO = ("python train.py", "python train.py --config configs/tiny.yaml")
SHORT = ["--train.max_steps", "2", "--train.eval_every", "2", "--train.save_every", "2",
         "--train.eval_questions", "4", "--train.batch_size", "8"]


def _commands(text: str) -> list[str]:
    """Every `python train.py` or `torchrun ... train.py` command in `text`: the lines of its code blocks (all
    of it where it has none, as train.py's docstring) with their continuation lines, and its inline code;
    comments left out."""
    blocks = re.findall(r"```\w*\n(.*?)```", text, re.S) or [text]
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    lines = [line for block in blocks for line in re.sub(r"\\\n\s*", " ", block).splitlines()]
    spans = [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose)]
    return [line.split("#")[0].strip() for line in [*lines, *spans]
            if re.match(r"\s*(python train\.py|torchrun .*train\.py)", line)]


def _fresh_run_arguments(command: str) -> list[str] | None:
    """A command's arguments after train.py, for a command that starts a fresh training run (None: it resumes,
    checks data or asks for help)."""
    words = shlex.split(command)
    arguments = words[words.index("train.py") + 1:]
    return None if {"--resume", "--check-data", "--help", "-h"} & set(arguments) else arguments


def _output_dir(arguments: list[str]) -> str:
    """Where a fresh run with these arguments writes, as train.py resolves it."""
    config, overrides, i = None, {}, 0
    while i < len(arguments):
        key, value = arguments[i].removeprefix("--"), arguments[i + 1]
        config, i = (value if key == "config" else config), i + 2
        if key != "config":
            overrides[key] = value
    path = ROOT / (config or "configs/tiny.yaml")
    return load_run_config(path, overrides, keep_model=bool(config) or "init_from" not in overrides
                           ).train.output_dir


SOURCES = {"README.md": (ROOT / "README.md").read_text(),
           "docs/training.md": (ROOT / "docs/training.md").read_text(), "train.py --help": train.__doc__}


@pytest.mark.parametrize("source", SOURCES)
def test_every_fresh_run_example_names_a_directory_of_its_own(source):
    commands = [(command, arguments) for command in _commands(SOURCES[source])
                if (arguments := _fresh_run_arguments(command)) is not None]
    assert commands
    into_the_demo = [command for command, arguments in commands
                     if _output_dir(arguments) in ("runs/tiny", FINE_TUNE_DIR) and command not in DEMO]
    assert into_the_demo == [], f"{source}: these write into runs/tiny or runs/finetune"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """A directory holding a small trained run at runs/tiny (the demo's place) and 20 records of one's own as
    mine.jsonl."""
    directory = tmp_path_factory.mktemp("workspace")
    steps = {"train.max_steps": "1", "train.save_every": "1", "train.eval_every": "1"}
    train_run(small_config(directory / "runs" / "tiny", **steps, **{"train.eval_questions": "4"}))
    lines = []
    for i, row in enumerate(make_shapes_dataset("train", 20, seed=0, image_size=32)):
        row["images"][0].save(directory / f"{i}.png")
        lines.append(json.dumps({"images": [f"{i}.png"], "texts": row["texts"]}))
    (directory / "mine.jsonl").write_text("\n".join(lines))
    return directory


def _files(directory: Path) -> dict[Path, tuple[int, int]]:
    return {path: (path.stat().st_size, path.stat().st_mtime_ns) for path in directory.rglob("*")}


def _one_command(source: str, starts: str) -> str:
    (command,) = [command for command in _commands(SOURCES[source]) if command.startswith(starts)]
    return command


@pytest.mark.parametrize("source, starts, scale_down", [
    # the own-data command on the tiny default's recipe: a smaller model and no ViT pre-training
    ("docs/training.md", "python train.py --data.source jsonl --data.path mine.jsonl",
     [arg for key, value in SMALL.items() if not key.startswith("data.") for arg in (f"--{key}", value)]),
    ("train.py --help", "python train.py --init_from runs/tiny", []),  # the start brings its model
], ids=["docs-own-data", "help-fine-tune"])
def test_an_example_runs_as_written_into_its_own_directory(workspace, monkeypatch, source, starts,
                                                           scale_down):
    arguments = shlex.split(_one_command(source, starts))[2:]
    monkeypatch.chdir(workspace)
    demo = _files(workspace / "runs" / "tiny")
    assert train.main([*arguments, *scale_down, *SHORT]) == 0
    assert _files(workspace / "runs" / "tiny") == demo
    assert "--train.output_dir" in arguments, "the example trains into a default directory"
    output = arguments[arguments.index("--train.output_dir") + 1]
    assert find_checkpoint(workspace / output).name == "step_000002"
