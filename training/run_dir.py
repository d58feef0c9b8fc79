"""A run's directory: a fresh run starts only where no other run is (unless told to write over it), and
`--resume` continues a run from its newest checkpoint, or from its ViT pre-training, with steps left to
train."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

from loading import STATE_JSON, STEP_DIR, checkpoints, find_checkpoint
from training.checkpoint import PRETRAINING, is_pretraining
from training.config import RunConfig
from typed_config import ConfigError, check

METRICS = "metrics.json"  # a finished run's results (training/results.py)
SHOWN = 3  # the most entries a refusal names


def new_run_id() -> str:
    """A fresh run's identity, recorded in each of its checkpoints: pruning deletes only the run's own."""
    return uuid.uuid4().hex


def check_output_dir(config: RunConfig) -> None:
    """A fresh run's train.output_dir holds no other run (a step_* checkpoint, a ViT pre-training checkpoint
    or metrics.json), unless train.overwrite is on; an empty or missing directory is fine."""
    output = Path(config.train.output_dir)
    entries = output.iterdir() if output.is_dir() else ()
    found = sorted(path.name for path in entries
                   if STEP_DIR.match(path.name) or path.name in (PRETRAINING, METRICS))
    if found and not config.train.overwrite:
        shown = ", ".join(found[:SHOWN]) + (f" and {len(found) - SHOWN} more" if len(found) > SHOWN else "")
        raise ConfigError(f"train.output_dir ({output}) holds another run ({shown}): continue it with "
                          f"--resume {output}, give this run a new --train.output_dir, or write into it "
                          "anyway with --train.overwrite true")


def resume_point(path: Path) -> Path:
    """What `--resume PATH` continues: PATH when it is a checkpoint, else the run's newest complete step
    checkpoint there, else its ViT pre-training checkpoint (a run stopped before its first step)."""
    if not checkpoints(path) and is_pretraining(path / PRETRAINING):
        return path / PRETRAINING
    return find_checkpoint(path)


def check_resumable(checkpoint: Path, max_steps: int) -> None:
    """A resumed run has steps left to train: train.max_steps above its checkpoint's step (a checkpoint
    without a readable step is refused later, when its training state is loaded)."""
    try:
        step = 0 if is_pretraining(checkpoint) else json.loads((checkpoint / STATE_JSON).read_text())["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return
    check(max_steps > step, f"{checkpoint} is at step {step} and train.max_steps is {max_steps}: nothing "
          "left to train (set a higher --train.max_steps to train on)")
