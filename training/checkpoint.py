"""Resumable checkpoints: the `save_pretrained` layout, the tokenizer (or a checkpoint's whole processor), the
run config and the training state.

Each checkpoint is written into a staging directory, fsynced, then renamed to `step_NNNNNN`; old ones are
renamed away before they are deleted. A crash at any moment leaves the previous checkpoints intact and no
half-written or half-deleted `step_*` directory. Optimizer tensors and RNG states go to
safetensors, everything else to JSON: nothing is ever unpickled.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from loading import SHARDED, STATE_JSON, checkpoints
from models.lora import has_adapters, save_adapter
from models.weights import CheckpointError, atomic_write
from training.distributed import Ranks, ShardError, barrier, is_sharded, load_sharded, save_sharded, unwrap
from typed_config import one_line

STATE_TENSORS = "training_state.safetensors"
RUN_CONFIG = "run_config.json"


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
                    keep: int, extra: dict[str, Any] | None = None, ranks: Ranks = Ranks()) -> Path:
    """Write `run_dir/step_NNNNNN` atomically; keep the newest `keep` checkpoints. Every rank calls it: under
    FSDP2 each rank writes its shards; rank 0 writes everything else and renames the checkpoint into place.
    `processor` is the tokenizer or the run's chat processor: whatever its `save_pretrained` writes is what
    inference needs besides the model (a SmolVLM / Idefics3 start: the processor files, so the checkpoint is
    asked with its chat template).

    A failed write (disk full, quota, permissions) removes the staging directory and raises CheckpointError;
    the checkpoints already there are untouched.
    """
    final, staging = run_dir / f"step_{step:06d}", run_dir / f".staging_step_{step:06d}"
    if ranks.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        # leftovers of a run killed mid-save
        for leftover in [*run_dir.glob(".staging_step_*"), *run_dir.glob(".retired_step_*")]:
            shutil.rmtree(leftover)
    barrier()
    try:
        if is_sharded(model):
            save_sharded(model, optimizer, staging / SHARDED)
            barrier()
        if ranks.is_main:
            _write(staging, step, unwrap(model), processor, optimizer, run_config,
                   {**(extra or {}), "sharded_world_size": ranks.world_size if is_sharded(model) else 0})
    except (OSError, SafetensorError, ShardError) as e:
        shutil.rmtree(staging, ignore_errors=True)
        previous = checkpoints(run_dir)
        kept = (f"the newest complete checkpoint, {previous[-1]}, is intact" if previous
                else "no earlier checkpoint exists")
        raise CheckpointError(f"could not write checkpoint {final} ({one_line(e)}); {kept}") from None
    if ranks.is_main:
        # Old checkpoints leave by rename before they are deleted, so a step_* directory is never half
        # deleted.
        retired = [_retire(final)] if final.exists() else []  # the same step written again (after a resume)
        os.replace(staging, final)
        retired += [_retire(old) for old in checkpoints(run_dir)[:-keep]]
        _fsync(run_dir)
        for path in retired:
            shutil.rmtree(path)
    barrier()
    return final


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
    tensors["rng.torch"] = torch.get_rng_state()
    if torch.cuda.is_available():
        tensors["rng.cuda"] = torch.cuda.get_rng_state()
    save_file(tensors, staging / STATE_TENSORS)
    state = {"step": step, "optimizer": optimizer_meta, **extra}
    (staging / STATE_JSON).write_text(json.dumps(state))
    for path in [*staging.rglob("*"), staging]:
        _fsync(path)


def load_training_state(directory: Path, model, optimizer: torch.optim.Optimizer,
                        ranks: Ranks = Ranks()) -> dict[str, Any]:
    """Restore optimizer and RNG from a checkpoint (and, for a sharded one, the model's shards); return its
    JSON state (step, samples seen, ...). Ordinary checkpoints resume at any world size, sharded ones at their
    own. The learning rate schedule is not restored: it follows the (possibly changed) config from the step
    (`build_scheduler`)."""
    state_file, tensor_file = directory / STATE_JSON, directory / STATE_TENSORS
    if not state_file.is_file() or not tensor_file.is_file():
        raise CheckpointError(f"{directory}: not a resumable checkpoint (missing {STATE_JSON} or "
                              f"{STATE_TENSORS})")
    try:
        state, tensors = json.loads(state_file.read_text()), load_file(tensor_file)
    except Exception as e:
        raise CheckpointError(f"{directory}: unreadable training state ({type(e).__name__}: {e})") from None
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
    torch.set_rng_state(tensors["rng.torch"])
    if "rng.cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng.cuda"])
    return state
