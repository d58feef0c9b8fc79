"""The training loop: optimizer steps with progress, validation and checkpoints, until max_steps or a stop
signal."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import resource
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from data.batches import take_bookkeeping
from data.stream_batches import take_stream
from models import TinyVLMError
from training import distributed
from training.checkpoint import save_checkpoint
from training.config import RunConfig, TrainConfig
from training.distributed import Ranks, all_reduce, any_rank, gradient_sync
from training.evaluate import validation_loss
from training.loss import target_weights
from training.progress import Phase
from training.run_dir import new_run_id
from training.signals import GracefulStop


class TrainingError(TinyVLMError, RuntimeError):
    """Training cannot go on (for example a non-finite loss with train.on_nonfinite=stop)."""


@dataclasses.dataclass
class TrainState:
    """A run's progress: saved with each checkpoint (see `saved`), continued by a run that resumes from it."""

    run_id: str = dataclasses.field(default_factory=new_run_id)  # recorded in each checkpoint; see run_dir.py
    step: int = 0
    samples_seen: int = 0  # of the sampler's stream, over all ranks
    history: list[list[float]] = dataclasses.field(default_factory=list)  # [step, train loss] each step
    validation: list[list[float]] = dataclasses.field(default_factory=list)  # [step, validation loss]
    skipped_steps: int = 0  # non-finite steps
    # dataset indices (data.source=stream: sample keys) of the bad records met
    bad_records: set[int | str] = dataclasses.field(default_factory=set)
    too_long_records: set[int | str] = dataclasses.field(default_factory=set)  # and of those over max_length
    # data.source=stream: each reader's (slot's) position after the last batch trained on, with its counts
    stream: dict[str, Any] = dataclasses.field(default_factory=dict)
    # data.source=stream: per rank, a hash chained over the sample keys of every batch trained on, in order
    sample_digests: dict[str, str] = dataclasses.field(default_factory=dict)

    @classmethod
    def resumed(cls, saved: dict[str, Any], config: TrainConfig, run_id: str) -> TrainState:
        """The state a checkpoint saved, continued as run `run_id`; checkpoints from before multi-GPU training
        counted batches, not samples."""
        batches_to_samples = config.batch_size * config.grad_accum_steps
        samples_seen = saved.get("samples_seen", saved.get("data_position", 0) * batches_to_samples)
        return cls(run_id, saved["step"], samples_seen, saved["history"], saved.get("validation", []),
                   saved.get("skipped_steps", 0), set(saved.get("bad_record_indices", [])),
                   set(saved.get("too_long_record_indices", [])), saved.get("stream", {}),
                   saved.get("sample_digests", {}))

    def summary(self) -> dict[str, Any]:
        """The run's metrics so far: step, last train and validation losses, skipped steps, and how many
        distinct training records were bad or too long (each counted once, however often it was read)."""
        summary = {"step": self.step, "train_loss": self.history[-1][1] if self.history else None,
                   "validation_loss": self.validation[-1][1] if self.validation else None,
                   "skipped_steps": self.skipped_steps, "bad_records": len(self.bad_records),
                   "too_long_records": len(self.too_long_records)}
        return {**summary, **self.stream_summary()} if self.stream else summary

    def stream_summary(self) -> dict[str, Any]:
        """data.source=stream: each source's share of the tokens trained on, and the records the ratings
        filters dropped, over every reader."""
        tokens: dict[str, int] = {}
        for position in self.stream.values():
            for source, count in position["source_tokens"].items():
                tokens[source] = tokens.get(source, 0) + count
        total = sum(tokens.values()) or 1
        return {"source_token_shares": {source: count / total for source, count in sorted(tokens.items())},
                "filtered_records": sum(position["filtered"] for position in self.stream.values())}

    def saved(self) -> dict[str, Any]:
        """What a checkpoint keeps besides its step and run id (which `save_checkpoint` writes)."""
        saved = {"samples_seen": self.samples_seen, "history": self.history,
                 "skipped_steps": self.skipped_steps, "validation": self.validation,
                 "bad_records": len(self.bad_records), "bad_record_indices": sorted(self.bad_records),
                 "too_long_records": len(self.too_long_records),
                 "too_long_record_indices": sorted(self.too_long_records)}
        if self.stream:  # data.source=stream
            saved.update(stream=self.stream, sample_digests=self.sample_digests)
        return saved


@dataclasses.dataclass
class Trainer:
    """What the loop trains with, fixed for the run (`TrainState` holds what changes). A step needs the first
    six fields; the loop the rest."""

    config: RunConfig
    model: nn.Module  # wrapped for DDP / FSDP2 when distributed
    forward: Callable[..., Any]  # the model, or its torch.compile'd form
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    device: torch.device
    autocast: contextlib.AbstractContextManager = contextlib.nullcontext()
    # the chat processor (data/chat_processors.py): its tokenizer and conversation format
    processor: Any = None
    batches: Iterator[dict[str, Any]] | None = None  # from `data.batches.training_batches`
    validation_batches: list[dict[str, torch.Tensor]] = dataclasses.field(default_factory=list)
    ranks: Ranks = dataclasses.field(default_factory=Ranks)
    wandb_run: Any = None
    stop: GracefulStop = dataclasses.field(default_factory=GracefulStop)  # the run's, in place while it runs

    @property
    def output_dir(self) -> Path:
        return Path(self.config.train.output_dir)


def forward_options(train_config: TrainConfig) -> dict[str, bool]:
    """The model's training options (VisionLanguageModel.forward) as the run's config sets them."""
    return {"checkpoint_activations": train_config.activation_checkpointing,
            "chunked_loss": train_config.chunked_loss, "flex_attention": train_config.flex_attention}


def train_step(trainer: Trainer, micro_batches: list[dict[str, torch.Tensor]]) -> tuple[float, int, bool]:
    """One optimizer step over `micro_batches` (train.grad_accum_steps of them) on every rank; returns (loss,
    tokens, finite), both summed over ranks. The loss is the weighted mean (`target_weights`) over every
    answer token of the step, whichever rank and micro-batch it fell in, so N ranks x batch b train exactly
    like 1 rank x batch N*b. A non-finite step changes no weight."""
    train_config = trainer.config.train
    model = trainer.model
    device = trainer.device
    model.train()
    # Weighed on the host-side batches, so the loop below never waits on the device.
    weights = [target_weights(batch["targets"], batch["attention_mask"], train_config.loss_weight)
               for batch in micro_batches]
    tokens = sum(int((batch["attention_mask"] > 0).sum()) for batch in micro_batches)
    total_weight, world_size = all_reduce([float(sum(w.sum() for w in weights)), 1.0], device=device)
    loss_sum = torch.zeros((), device=device)
    for i, (batch, weight) in enumerate(zip(micro_batches, weights)):
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}  # from pinned memory on GPU
        with gradient_sync(model, enabled=i == len(micro_batches) - 1), trainer.autocast:
            _, losses = trainer.forward(**batch, reduction="none", return_logits=False,
                                        **forward_options(train_config))
        loss = (losses * weight.to(device)).sum()
        # DDP and FSDP2 average gradients over ranks: scale by world_size so the step's gradient is the global
        # mean.
        (loss * world_size / (total_weight or 1)).backward()
        loss_sum += loss.detach()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), train_config.grad_clip or float("inf"))
    loss_sum, tokens = all_reduce([loss_sum.item(), tokens], device=device)
    step_loss = loss_sum / (total_weight or 1)
    finite = math.isfinite(step_loss) and bool(torch.isfinite(grad_norm))
    if finite:
        trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.scheduler.step()
    return step_loss, int(tokens), finite


def peak_memory_mib(device: torch.device) -> float:
    """The most memory the run has held so far: the GPU's allocated tensors on CUDA, else the process's
    resident set (the CPU's figure includes the interpreter and the data)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def run(trainer: Trainer, state: TrainState) -> str | None:
    """Train from `state.step` to train.max_steps, updating `state`; log, validate and save on the way. A stop
    signal (`trainer.stop`) ends the run after its step and a checkpoint: returns the signal's name then, None
    at max_steps."""
    train_config, ranks = trainer.config.train, trainer.ranks
    say, report = distributed.main_rank_only(ranks, print), distributed.main_rank_only(ranks, tqdm.write)
    # A progress bar on a terminal; plain lines where the output goes to a file (a bar would fill it with
    # '\r').
    bar = ranks.is_main and sys.stdout.isatty() and sys.stderr.isatty()
    progress = tqdm(range(state.step, train_config.max_steps), initial=state.step,
                    total=train_config.max_steps, desc="train", dynamic_ncols=True, disable=not bar)
    started = time.perf_counter()
    tokens_seen = 0
    batches = _counted(trainer.batches, state, str(ranks.rank))
    stop = trainer.stop
    # the first step (its batches, a compilation) says it still runs until the step lines take over
    with Phase(f"training step {state.step + 1}/{train_config.max_steps}", report, announce=False) as first:
        for step in progress:
            micro_batches = [next(batches) for _ in range(train_config.grad_accum_steps)]
            step_loss, tokens, finite = train_step(trainer, micro_batches)
            first.end()
            state.step = step + 1
            state.samples_seen += train_config.batch_size * train_config.grad_accum_steps * ranks.world_size
            tokens_seen += tokens
            if not finite:
                _skipped(trainer, state, report)
            state.history.append([state.step, step_loss])
            done = state.step == train_config.max_steps
            if state.step % train_config.log_every == 0 or done:
                rate = tokens_seen / (time.perf_counter() - started)
                peak = peak_memory_mib(trainer.device)
                progress.set_postfix(loss=f"{step_loss:.4f}", tok_s=f"{rate:,.0f}", peak_mib=f"{peak:,.0f}")
                if not bar:
                    say(f"step {state.step}/{train_config.max_steps}: loss {step_loss:.4f}, {rate:,.0f} "
                        f"tokens/s, peak memory {peak:,.0f} MiB", flush=True)
                _log(trainer, state.step, {"train/loss": step_loss, "train/tokens_per_s": rate,
                                           "lr": trainer.scheduler.get_last_lr()[-1]})
            if state.step % train_config.eval_every == 0 or done:
                val_loss = validation_loss(trainer.model, trainer.validation_batches, trainer.device,
                                           trainer.autocast, train_config.loss_weight,
                                           train_config.chunked_loss)
                state.validation.append([state.step, val_loss])
                report(f"step {state.step}: train loss {step_loss:.4f}, validation loss {val_loss:.4f}")
                _log(trainer, state.step, {"val/loss": val_loss})
            stop_requested = any_rank(stop.requested is not None, trainer.device)
            if state.step % train_config.save_every == 0 or done or stop_requested:
                state.bad_records = distributed.union(state.bad_records)
                state.too_long_records = distributed.union(state.too_long_records)
                state.stream, state.sample_digests = _merged(state.stream), _merged(state.sample_digests)
                path = _save(trainer, state)
                if stop_requested and not done:
                    progress.close()
                    say(f"{stop.requested or 'stop signal'}: saved {path}; continue with: "
                        f"python train.py --resume {path}", flush=True)
                    return stop.requested or "stop signal"
    progress.close()
    return None


def _skipped(trainer: Trainer, state: TrainState, report: Callable[[str], None]) -> None:
    """A non-finite step (its weights were left as they were): counted and reported, or the run stopped
    (train.on_nonfinite=stop)."""
    state.skipped_steps += 1
    if trainer.config.train.on_nonfinite == "stop":
        raise TrainingError(f"non-finite loss or gradient at step {state.step}: stopped "
                            f"(train.on_nonfinite=stop); the checkpoints in {trainer.output_dir} are intact")
    report(f"step {state.step}: non-finite loss or gradient, step skipped ({state.skipped_steps} so far)")


def _counted(batches: Iterator[dict[str, Any]], state: TrainState,
             rank: str) -> Iterator[dict[str, torch.Tensor]]:
    """The loader's batches as the model takes them; which records were bad or too long goes into `state`,
    and for a stream, where it stands and the digest of the samples read."""
    for batch in batches:
        bad, too_long = take_bookkeeping(batch)
        state.bad_records.update(bad)
        state.too_long_records.update(too_long)
        stream = take_stream(batch)
        if stream is not None:
            state.stream[str(stream["slot"])] = stream["position"]
            chained = [state.sample_digests.get(rank, ""), *stream["keys"]]
            state.sample_digests[rank] = hashlib.sha256("\n".join(chained).encode()).hexdigest()
        yield batch


def _merged(entries: dict[str, Any]) -> dict[str, Any]:
    """Every rank's entries (each rank writes its own keys: its readers' positions, its digest), on every
    rank."""
    if not torch.distributed.is_initialized():
        return entries
    gathered: list[dict[str, Any]] = [{} for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather_object(gathered, entries)
    return {key: value for rank_entries in gathered for key, value in rank_entries.items()}


def _log(trainer: Trainer, step: int, values: dict[str, float]) -> None:
    if trainer.wandb_run:
        trainer.wandb_run.log(values, step=step)


def _save(trainer: Trainer, state: TrainState) -> Path:
    if not distributed.all_finite(trainer.model):
        raise TrainingError(f"the weights hold NaN/inf at step {state.step}: not saved; the checkpoints in "
                            f"{trainer.output_dir} are intact")
    return save_checkpoint(trainer.output_dir, state.step, trainer.model, trainer.processor,
                           trainer.optimizer, trainer.config, trainer.config.train.keep_checkpoints,
                           state.run_id, extra=state.saved(), ranks=trainer.ranks)
