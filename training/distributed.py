"""Running under torchrun: the process group, DDP or FSDP2 wrapping, reductions across ranks, and sharded
state.

One process per device; `torchrun` sets RANK, WORLD_SIZE and LOCAL_RANK. Without them everything here is a
no-op and train.py runs as a single process. NCCL on GPU, gloo on CPU; every collective times out after
`train.dist_timeout` seconds, so a rank that dies never leaves the others waiting forever.
FSDP2, DTensor and torch.distributed.checkpoint are imported where they are used: importing them takes ~1 s,
which every single-process start (train.py, generate.py's checkpoint loading) would pay.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from loading import pick_device
from typed_config import ConfigError


class ShardError(RuntimeError):
    """A sharded checkpoint could not be written or read (torch.distributed.checkpoint's
    CheckpointException)."""


@dataclasses.dataclass(frozen=True)
class Ranks:
    """Where this process stands in the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        """Rank 0 alone logs, shows progress and writes files."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init(device_name: str, timeout_s: float) -> tuple[Ranks, torch.device]:
    """Join the job torchrun started (if any); return this process's ranks and device (cuda:LOCAL_RANK on
    GPU)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    device = pick_device(device_name)
    if world_size == 1:
        return Ranks(), device
    ranks = Ranks(int(os.environ["RANK"]), world_size, int(os.environ["LOCAL_RANK"]))
    if device.type == "cuda":
        device = torch.device("cuda", ranks.local_rank)
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=timeout_s))
    return ranks, device


def main_rank_only(ranks: Ranks, function: Callable[..., None]) -> Callable[..., None]:
    """`function` on rank 0; a no-op on the other ranks (for what is printed once per job)."""
    return function if ranks.is_main else _silent


def _silent(*args, **kwargs) -> None:
    """Prints nothing (a module-level function: DataLoader workers may need to pickle it)."""


def shutdown() -> None:
    """Leave the job. A run's FSDP2 modules, device mesh and DTensors outlive it in reference cycles that hold
    the process group: collect them first, so they are not freed during interpreter teardown, after the group
    is gone."""
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def wrap(model: nn.Module, strategy: str, ranks: Ranks, device: torch.device) -> nn.Module:
    """DDP (a full replica per rank, gradients all-reduced) or FSDP2 (parameters, gradients and optimizer
    state sharded; each transformer block gathered just in time). FSDP2 shards `model` in place and returns
    it."""
    if not ranks.distributed:
        return model
    if strategy == "ddp":
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (ranks.world_size,))
    for block in [*model.vision.blocks, *model.language.blocks]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model


def is_sharded(model: nn.Module) -> bool:
    return _is_instance(model, "torch.distributed.fsdp", "FSDPModule")


def _is_instance(value: object, module: str, name: str) -> bool:
    """isinstance(value, module.name) without importing `module`: a class never imported has no instances."""
    loaded = sys.modules.get(module)
    return loaded is not None and isinstance(value, getattr(loaded, name))


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Skip the gradient all-reduce (DDP `no_sync`) or reduce-scatter (FSDP2) on all but the last
    micro-batch."""
    if isinstance(model, DistributedDataParallel) and not enabled:
        with model.no_sync():
            yield
        return
    if is_sharded(model):
        model.set_requires_gradient_sync(enabled)
    yield


def all_reduce(values: list[float], op: str = "sum", device: torch.device | None = None) -> list[float]:
    """Element-wise sum or max of `values` over all ranks (the values themselves when not distributed)."""
    if not dist.is_initialized():
        return values
    if dist.get_backend() == "nccl":  # NCCL reduces CUDA tensors only
        device = device or torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return tensor.tolist()


def any_rank(flag: bool, device: torch.device | None = None) -> bool:
    """Whether `flag` holds on any rank (a collective: every rank asks at the same point)."""
    return all_reduce([float(flag)], op="max", device=device)[0] > 0


def checked_on_main(check: Callable[[], None]) -> None:
    """`check()` on rank 0 alone (it looks at what rank 0 writes: the run directory), its ConfigError raised
    on every rank, so that the ranks decide once and alike."""
    refusal = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            check()
        except ConfigError as e:
            refusal = str(e)
    if dist.is_initialized():
        shared = [refusal]
        dist.broadcast_object_list(shared, src=0)
        refusal = shared[0]
    if refusal is not None:
        raise ConfigError(refusal)


def union(values: set[int]) -> set[int]:
    """The union of every rank's `values` (the values themselves when not distributed)."""
    if not dist.is_initialized():
        return values
    gathered: list[list[int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sorted(values))
    return set().union(*gathered)


def lost_contact(error: BaseException) -> bool:
    """Whether `error` means that this rank lost contact with the others: a torch.distributed error, or gloo's
    transport giving up (a timeout, a closed connection), which gloo raises as a plain RuntimeError naming its
    source file."""
    return isinstance(error, dist.DistError) or (
        isinstance(error, RuntimeError) and "gloo/transport/" in str(error)
    )


def broadcast_parameters(module: nn.Module) -> None:
    """Every rank takes rank 0's weights: for weights set before `wrap` on each rank, which FSDP2 does not
    sync."""
    if dist.is_initialized():
        for p in module.parameters():
            dist.broadcast(p.data, src=0)


def all_finite(model: nn.Module) -> bool:
    """True when no rank holds a NaN/inf weight (each checks its own shards)."""
    local = all(bool(torch.isfinite(_local(p)).all()) for p in model.parameters())
    return all_reduce([float(not local)], op="max")[0] == 0


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2's parameters); any other tensor itself."""
    return tensor.to_local() if _is_instance(tensor, "torch.distributed.tensor", "DTensor") else tensor


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


@contextlib.contextmanager
def _shard_errors() -> Iterator[None]:
    """torch.distributed.checkpoint's errors as ShardError, each failed rank's exception on one line (its own
    message holds every rank's whole traceback). Its warnings, which it logs with tracebacks to the root
    logger while it tries one metadata file after another, are dropped: the error names what each try met."""
    import torch.distributed.checkpoint as dcp

    root = logging.getLogger()
    root.addFilter(_not_from_distributed_checkpoint)
    try:
        yield
    except dcp.CheckpointException as e:
        causes = "; ".join(
            f"rank {rank}: {type(error).__name__}: {error}" for rank, (error, _) in e.failures.items()
        )
        raise ShardError(causes or str(e)) from e
    finally:
        root.removeFilter(_not_from_distributed_checkpoint)


def _not_from_distributed_checkpoint(record: logging.LogRecord) -> bool:
    return "torch/distributed/checkpoint/" not in Path(record.pathname).as_posix()


def save_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    """Every rank writes its shards of the model and optimizer state into `directory`
    (torch.distributed.checkpoint)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    with _shard_errors():
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=directory)


def load_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    """Read a `save_sharded` checkpoint into an FSDP2 model and its optimizer (same world size)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    with _shard_errors():
        dcp.load(state, checkpoint_id=directory)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights on rank 0's CPU (a collective under FSDP2: every rank must call it)."""
    if not is_sharded(model):
        return unwrap(model).state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def read_sharded_weights(directory: Path, model: nn.Module) -> None:
    """Load the model part of a sharded checkpoint into an ordinary, unsharded `model`, in one process."""
    import torch.distributed.checkpoint as dcp

    state = {"model": model.state_dict()}
    with _shard_errors(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")  # no_dist says so already
        dcp.load(state, checkpoint_id=directory, no_dist=True)
    model.load_state_dict(state["model"])
