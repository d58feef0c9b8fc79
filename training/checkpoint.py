"""Resumable checkpoints: the `save_pretrained` layout, the tokenizer (or a checkpoint's whole processor), the
run config and the training state; and a run's ViT pre-training (`vision_pretraining/`, the same files with
the pre-training's state in place of the training state), until its first step checkpoint replaces it.

Each checkpoint is written into a staging directory, fsynced, then renamed to `step_NNNNNN` (or
`vision_pretraining`); old ones are renamed away before they are deleted. A crash at any moment leaves the
previous checkpoints intact and no half-written or half-deleted checkpoint directory. Optimizer tensors and
RNG states go to safetensors, everything else to JSON: nothing is ever unpickled. Each checkpoint records the
run that wrote it (`run_id`), and a run prunes only its own: a directory may also hold another run's.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from loading import SHARDED, STATE_JSON, checkpoints
from models.lora import has_adapters, save_adapter
from models.weights import CheckpointError, atomic_write
from training.distributed import Ranks, ShardError, barrier, is_sharded, load_sharded, save_sharded, unwrap
from training.vision_pretraining import Pretraining
from typed_config import one_line

STATE_TENSORS = "training_state.safetensors"
RUN_CONFIG = "run_config.json"
PRETRAINING = "vision_pretraining"  # a run's ViT pre-training, stopped or done, in its run directory
PRETRAINING_JSON = "pretraining_state.json"
PRETRAINING_TENSORS = "pretraining_state.safetensors"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    state = optimizer.state_dict()
    tensors, scalars = {}, {}
    for param_id, values in state["state"].items():
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optimizer.{param_id}.{name}"] = value.detach().contiguous()
            else:
                scalars.setdefault(str(param_id), {})[name] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def _optimizer_state(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        if key.startswith("optimizer."):
            _, param_id, name = key.split(".", 2)
            state.setdefault(int(param_id), {})[name] = value
    for param_id, values in meta["scalars"].items():
        state.setdefault(int(param_id), {}).update(values)
    return {"state": state, "param_groups": meta["param_groups"]}


def save_checkpoint(run_dir: Path, step: int, model, processor, optimizer: torch.optim.Optimizer, run_config,
                    keep: int, run_id: str, extra: dict[str, Any] | None = None,
                    ranks: Ranks = Ranks()) -> Path:
    """Write `run_dir/step_NNNNNN` atomically, recording `run_id`; keep the run's newest `keep` checkpoints
    (another run's, or one without a run id, are never deleted) and retire its ViT pre-training checkpoint.
    Every rank calls it: under FSDP2 each rank writes its shards; rank 0 writes everything else and renames
    the checkpoint into place. `processor` is the tokenizer or the run's chat processor: whatever its
    `save_pretrained` writes is what inference needs besides the model (a SmolVLM / Idefics3 start: the
    processor files, so the checkpoint is asked with its chat template).

    A failed write (disk full, quota, permissions) removes the staging directory and raises CheckpointError;
    the checkpoints already there are untouched.
    """
    final, staging = run_dir / f"step_{step:06d}", run_dir / f".staging_step_{step:06d}"
    _clear_leftovers(run_dir, ranks)
    with _staged(staging, final):
        if is_sharded(model):
            save_sharded(model, optimizer, staging / SHARDED)
            barrier()
        if ranks.is_main:
            _write(staging, step, unwrap(model), processor, optimizer, run_config,
                   {**(extra or {}), "run_id": run_id,
                    "sharded_world_size": ranks.world_size if is_sharded(model) else 0})
    if ranks.is_main:
        _publish(staging, final, lambda: _superseded(run_dir, run_id, keep))
    barrier()
    return final


def _superseded(run_dir: Path, run_id: str, keep: int) -> list[Path]:
    """What a run's newest checkpoint supersedes: its own checkpoints but the newest `keep`, and its ViT
    pre-training checkpoint."""
    ours = [checkpoint for checkpoint in checkpoints(run_dir) if run_id_of(checkpoint) == run_id]
    pretraining = [run_dir / PRETRAINING] if run_id_of(run_dir / PRETRAINING) == run_id else []
    return ours[:-keep] + pretraining


def save_pretraining(run_dir: Path, pretraining: Pretraining, model, processor, run_config, run_id: str,
                     ranks: Ranks = Ranks()) -> Path:
    """Write `run_dir/vision_pretraining` atomically (rank 0; every rank calls it): the model as it is (its
    ViT part-trained), the processor and run config as a step checkpoint has them, and `pretraining`'s state
    (step, losses, its head and optimizer, its draws) with the RNG, so that `load_pretraining` continues it
    exactly."""
    final, staging = run_dir / PRETRAINING, run_dir / f".staging_{PRETRAINING}"
    _clear_leftovers(run_dir, ranks)
    with _staged(staging, final):
        if ranks.is_main:
            model.save_pretrained(staging)
            processor.save_pretrained(staging)
            run_config.save_json(staging / RUN_CONFIG)
            head = {f"head.{name}": tensor.detach().contiguous()
                    for name, tensor in pretraining.head.state_dict().items()}
            optimizer_tensors, optimizer_meta = _optimizer_tensors(pretraining.optimizer)
            save_file({**head, **optimizer_tensors, **_rng_tensors()}, staging / PRETRAINING_TENSORS)
            state = {"run_id": run_id, "step": pretraining.step, "steps": pretraining.steps,
                     "losses": pretraining.loss_history(), "draws": pretraining.draws.state_dict(),
                     "optimizer": optimizer_meta}
            (staging / PRETRAINING_JSON).write_text(json.dumps(state))
            _fsync_tree(staging)
    if ranks.is_main:
        _publish(staging, final)
    barrier()
    return final


def load_pretraining(checkpoint: Path, pretraining: Pretraining) -> None:
    """Put a `save_pretraining` checkpoint's state into `pretraining` (built as the run built it: its head
    and optimizer over the checkpoint's ViT) and the RNG back, to continue where it stopped."""
    state, tensors = _read(checkpoint, PRETRAINING_JSON, PRETRAINING_TENSORS)
    pretraining.head.load_state_dict({name.removeprefix("head."): tensor for name, tensor in tensors.items()
                                      if name.startswith("head.")})
    pretraining.optimizer.load_state_dict(_optimizer_state(tensors, state["optimizer"]))
    pretraining.draws.load_state_dict(state["draws"])
    pretraining.step, pretraining.losses = state["step"], state["losses"]
    _restore_rng(tensors)


def is_pretraining(checkpoint: Path) -> bool:
    """Whether `checkpoint` is a ViT pre-training checkpoint (`save_pretraining`), not a step's."""
    return (checkpoint / PRETRAINING_JSON).is_file()


def run_id_of(checkpoint: Path) -> str | None:
    """The run that wrote `checkpoint` (None: none recorded, or no checkpoint there)."""
    for name in (STATE_JSON, PRETRAINING_JSON):
        try:
            return json.loads((checkpoint / name).read_text()).get("run_id")
        except (OSError, ValueError, AttributeError):
            continue
    return None


def _clear_leftovers(run_dir: Path, ranks: Ranks) -> None:
    """The run directory in place, without the staged or retired directories of a run killed mid-save."""
    if ranks.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        for leftover in [*run_dir.glob(".staging_*"), *run_dir.glob(".retired_*")]:
            shutil.rmtree(leftover)
    barrier()


@contextlib.contextmanager
def _staged(staging: Path, final: Path) -> Iterator[None]:
    """Writes into `staging`; a failed one removes it and raises CheckpointError naming what is intact."""
    try:
        yield
    except (OSError, SafetensorError, ShardError) as e:
        shutil.rmtree(staging, ignore_errors=True)
        previous = checkpoints(final.parent)
        kept = (f"the newest complete checkpoint, {previous[-1]}, is intact" if previous
                else "no earlier checkpoint exists")
        raise CheckpointError(f"could not write checkpoint {final} ({one_line(e)}); {kept}") from None


def _publish(staging: Path, final: Path, superseded: Callable[[], list[Path]] = list) -> None:
    """`staging` renamed to `final`, then what it supersedes deleted. Old checkpoints (and one at `final`: the
    same step written again after a resume) leave by rename before they are deleted, so a checkpoint
    directory is never half deleted."""
    retired = [_retire(final)] if final.exists() else []
    os.replace(staging, final)
    retired += [_retire(old) for old in superseded()]
    _fsync(final.parent)
    for path in retired:
        shutil.rmtree(path)


def _retire(checkpoint: Path) -> Path:
    return checkpoint.rename(checkpoint.with_name(f".retired_{checkpoint.name}"))


def _write(staging: Path, step: int, model, processor, optimizer, run_config, extra: dict[str, Any]) -> None:
    """Every file of a checkpoint into `staging`, each fsynced, and the directories themselves. A sharded
    model's weights and optimizer state are already in `staging/sharded`; here it gets just its config."""
    sharded = extra["sharded_world_size"] > 0
    if sharded:
        atomic_write(staging / "config.json", model.config.save_json)
    # the adapter alone, pointing at the model it adapts (found when the run started)
    elif has_adapters(model):
        save_adapter(model, staging, base=model.lora_base)
    else:
        model.save_pretrained(staging)
    processor.save_pretrained(staging)
    run_config.save_json(staging / RUN_CONFIG)
    tensors, optimizer_meta = ({}, None) if sharded else _optimizer_tensors(optimizer)
    save_file({**tensors, **_rng_tensors()}, staging / STATE_TENSORS)
    state = {"step": step, "optimizer": optimizer_meta, **extra}
    (staging / STATE_JSON).write_text(json.dumps(state))
    _fsync_tree(staging)


def _fsync_tree(directory: Path) -> None:
    """Every file under `directory`, and the directories themselves, to disk."""
    for path in [*directory.rglob("*"), directory]:
        _fsync(path)


def _rng_tensors() -> dict[str, torch.Tensor]:
    """The RNG states a resumed run continues from (torch's, and CUDA's where there is one)."""
    tensors = {"rng.torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors["rng.cuda"] = torch.cuda.get_rng_state()
    return tensors


def _restore_rng(tensors: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(tensors["rng.torch"])
    if "rng.cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng.cuda"])


def _read(directory: Path, json_name: str,
          tensors_name: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A checkpoint's JSON state and its tensors; CheckpointError when either is missing or unreadable."""
    state_file, tensor_file = directory / json_name, directory / tensors_name
    if not state_file.is_file() or not tensor_file.is_file():
        raise CheckpointError(f"{directory}: not a resumable checkpoint (missing {json_name} or "
                              f"{tensors_name})")
    try:
        return json.loads(state_file.read_text()), load_file(tensor_file)
    except Exception as e:
        raise CheckpointError(f"{directory}: unreadable training state ({type(e).__name__}: {e})") from None


def load_training_state(directory: Path, model, optimizer: torch.optim.Optimizer,
                        ranks: Ranks = Ranks()) -> dict[str, Any]:
    """Restore optimizer and RNG from a checkpoint (and, for a sharded one, the model's shards); return its
    JSON state (step, samples seen, ...). Ordinary checkpoints resume at any world size, sharded ones at their
    own. The learning rate schedule is not restored: it follows the (possibly changed) config from the step
    (`build_scheduler`)."""
    state, tensors = _read(directory, STATE_JSON, STATE_TENSORS)
    sharded_world_size = state.get("sharded_world_size", 0)
    if sharded_world_size != (ranks.world_size if is_sharded(model) else 0):
        raise CheckpointError(f"{directory}: " + (
            f"an FSDP2 checkpoint of {sharded_world_size} ranks resumes with train.parallel=fsdp on "
            f"{sharded_world_size} ranks (or export its weights: python -m training.export {directory})"
            if sharded_world_size else
            "an unsharded checkpoint resumes without FSDP2 (train.parallel=ddp), at any world size"))
    if sharded_world_size:
        try:
            load_sharded(model, optimizer, directory / SHARDED)
        except ShardError as e:
            raise CheckpointError(f"{directory}: unreadable shards ({one_line(e, 300)})") from None
    else:
        optimizer.load_state_dict(_optimizer_state(tensors, state["optimizer"]))
    _restore_rng(tensors)
    return state
