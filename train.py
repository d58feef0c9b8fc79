"""Train a vision-language model.

    python train.py                                       # the tiny default: synthetic shapes, from scratch, CPU
    python train.py --config configs/smollm2-shapes.yaml  # real SmolLM2-135M-Instruct + a small ViT (GPU)
    python train.py --config configs/tiny.yaml --train.max_steps 200 --train.output_dir runs/try1 --train.compile false
    python train.py --resume runs/tiny                    # continue from the newest complete checkpoint
    torchrun --nproc-per-node 8 train.py --config configs/nanovlm-222m.yaml    # DDP on 8 GPUs (see README for more)

Any config field can be set with `--section.field VALUE` (sections: model, data, train; and `--tokenizer`).
A run writes checkpoints (`step_NNNNNN/`: model, tokenizer, training state), `metrics.json`, `loss_curve.png`,
`predictions.png` and `heldout_example.png` into `train.output_dir`.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import random
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Sampler
from tqdm import tqdm

from data import (IMAGE_TOKEN, CheckedRecords, ImageProcessor, VQACollator, build_datasets, build_shapes_tokenizer,
                  conversation_texts, prepare_tokenizer, stop_token_ids, text_lengths, token_id)
from models import TinyVLMError, VisionLanguageModel, VLMConfig
from models.config import check, one_line
from models.loading import resolve
from training import distributed
from models.checkpoints import SHARDED, find_checkpoint
from training.checkpoint import RUN_CONFIG, load_training_state, save_checkpoint
from training.config import RunConfig, load_run_config, parse_overrides
from training.distributed import all_reduce, gradient_sync
from training.evaluate import answer, exact_match, save_loss_curve, save_prediction_grid, validation_loss
from training.loss import target_weights
from training.optim import build_optimizer, build_scheduler, check_same_parts, freeze_parts
from training.vision_pretraining import pretrain_vision

GRID_EXAMPLES = 16


class ResumableBatchSampler(Sampler[list[int]]):
    """Endless shuffled batches for one rank of `world_size`.

    The epochs' permutations (epoch e seeded by seed + e) form one stream of sample indices; global batch k is the
    stream's samples [start + k*G, start + (k+1)*G) with G = batch_size * world_size, and rank r takes the r-th
    slice of it. So a run resumes from any sample count at any world size, and 2 ranks x batch b see exactly the
    samples that 1 rank x batch 2b sees.

    With `lengths` (one per sample), batches are grouped by length to save padding: each window of `group` global
    batches of the stream is sorted by length in buckets of `bucket` (so that records of about the same length keep
    their random order and batches still mix kinds of record), cut into global batches again, and those are taken in
    a seeded shuffled order. The same samples are seen, in batches of similar lengths; a run then resumes exactly
    from any multiple of G (any step), at any world size that keeps G.
    """

    def __init__(self, num_samples: int, batch_size: int, seed: int, start: int = 0, rank: int = 0, world_size: int = 1,
                 lengths: list[int] | None = None, group: int = 16, bucket: int = 64):
        self.num_samples, self.batch_size, self.seed, self.start = num_samples, batch_size, seed, start
        self.rank, self.world_size, self.lengths, self.group, self.bucket = rank, world_size, lengths, group, bucket
        self._epoch, self._order = None, []

    def __iter__(self) -> Iterator[list[int]]:
        size = self.batch_size * self.world_size  # G: one global batch
        mine = slice(self.rank * self.batch_size, (self.rank + 1) * self.batch_size)
        global_batches = self._plain(size) if self.lengths is None else self._grouped(size)
        return (batch[mine] for batch in global_batches)

    def _plain(self, size: int) -> Iterator[list[int]]:
        for position in itertools.count(self.start, size):
            yield self._stream(position, size)

    def _grouped(self, size: int) -> Iterator[list[int]]:
        first_batch = self.start // size
        for window in itertools.count(first_batch // self.group):
            by_length = sorted(self._stream(window * size * self.group, size * self.group),
                               key=lambda i: self.lengths[i] // self.bucket)
            batches = [by_length[k * size : (k + 1) * size] for k in range(self.group)]
            random.Random(f"{self.seed}:{window}").shuffle(batches)
            yield from batches[max(0, first_batch - window * self.group):]

    def _stream(self, position: int, count: int) -> list[int]:
        """Sample indices at stream positions position .. position + count - 1."""
        indices = []
        for p in range(position, position + count):
            if p // self.num_samples != self._epoch:
                self._epoch = p // self.num_samples
                self._order = torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(self.seed + self._epoch)).tolist()
            indices.append(self._order[p % self.num_samples])
        return indices


class TrainingError(TinyVLMError, RuntimeError):
    """Training cannot go on (for example a non-finite loss with train.on_nonfinite=stop)."""


class GracefulStop:
    """SIGINT / SIGTERM ask the loop to finish its step, write a checkpoint and return; a second signal stops at once,
    unless `escalate` is off: under torchrun a worker often gets the same signal twice (from the scheduler and from
    torchrun), and stopping one rank at once would leave the others waiting in a collective."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, escalate: bool = True) -> None:
        self.escalate = escalate

    def __enter__(self) -> GracefulStop:
        self.requested: str | None = None
        on_main_thread = threading.current_thread() is threading.main_thread()
        self.previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS} if on_main_thread else {}
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    def _handle(self, signum: int, frame) -> None:
        if self.requested and self.escalate:
            self.restore()
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name

    def restore(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        self.previous = {}


def train_step(forward, model, batches, optimizer, scheduler, tc, autocast, device) -> tuple[float, int, bool]:
    """One optimizer step over grad_accum_steps micro-batches on every rank; returns (loss, tokens, finite), both
    summed over ranks. The loss is the weighted mean (`target_weights`) over every answer token of the step, whichever
    rank and micro-batch it fell in, so N ranks x batch b train exactly like 1 rank x batch N*b. A non-finite step
    changes no weight."""
    model.train()
    micro_batches = [next(batches) for _ in range(tc.grad_accum_steps)]
    # Weighed on the host-side batches, so the loop below never waits on the device.
    weights = [target_weights(batch["targets"], batch["attention_mask"], tc.loss_weight) for batch in micro_batches]
    tokens = sum(int((batch["attention_mask"] > 0).sum()) for batch in micro_batches)
    total_weight, world_size = all_reduce([float(sum(w.sum() for w in weights)), 1.0], device=device)
    loss_sum = torch.zeros((), device=device)
    for i, (batch, weight) in enumerate(zip(micro_batches, weights)):
        batch = {k: v.to(device) for k, v in batch.items()}
        with gradient_sync(model, enabled=i == len(micro_batches) - 1), autocast:
            _, losses = forward(**batch, reduction="none")
        loss = (losses * weight.to(device)).sum()
        # DDP and FSDP2 average gradients over ranks: scale by world_size so the step's gradient is the global mean.
        (loss * world_size / (total_weight or 1)).backward()
        loss_sum += loss.detach()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip or float("inf"))
    loss_sum, tokens = all_reduce([loss_sum.item(), tokens], device=device)
    step_loss = loss_sum / (total_weight or 1)
    finite = math.isfinite(step_loss) and bool(torch.isfinite(grad_norm))
    if finite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return step_loss, int(tokens), finite


def build_tokenizer(config: RunConfig, train_dataset):
    if config.tokenizer is None:
        return build_shapes_tokenizer(conversation_texts(train_dataset))
    from transformers import AutoTokenizer

    path = resolve(config.tokenizer)
    if path.suffix == ".gguf":
        return prepare_tokenizer(AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name))
    return prepare_tokenizer(AutoTokenizer.from_pretrained(path))


def build_model(config: RunConfig, tokenizer) -> VisionLanguageModel:
    """The VLM with its backbones loaded (where configured) and its vocabulary sized to the tokenizer."""
    settings = {"image_token_id": token_id(tokenizer, IMAGE_TOKEN), "language.eos_token_id": tokenizer.eos_token_id,
                "stop_token_ids": stop_token_ids(tokenizer)}
    if not config.model.language.pretrained:
        settings["language.vocab_size"] = len(tokenizer)
    model = VisionLanguageModel.from_backbones(config.model.replace(settings), config.train.allow_pickle)
    model.resize_token_embeddings(len(tokenizer), settings["image_token_id"])
    return model


def train(config: RunConfig, resume: Path | None = None) -> dict:
    """Run training to `train.max_steps` (as one rank of the job when started by torchrun); return the final metrics."""
    tc = config.train
    ranks, device = distributed.init(tc.device, tc.dist_timeout)
    try:
        return _train(config, resume, ranks, device)
    finally:
        distributed.shutdown()


def _train(config: RunConfig, resume: Path | None, ranks: distributed.Ranks, device: torch.device) -> dict:
    tc, output_dir = config.train, Path(config.train.output_dir)
    torch.manual_seed(tc.seed)
    if tc.num_threads:
        torch.set_num_threads(tc.num_threads)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" and tc.bf16 else contextlib.nullcontext()
    say = print if ranks.is_main else lambda *args, **kwargs: None

    train_data, validation_data = build_datasets(config.data)
    model, tokenizer = load_for_resume(resume) if resume else (None, build_tokenizer(config, train_data))
    model = model or build_model(config, tokenizer)
    config = RunConfig(model.config, config.data, config.train, config.tokenizer)
    context = config.model.language.max_position_embeddings
    check(tc.max_length <= context, f"train.max_length ({tc.max_length}) exceeds the language model's context "
          f"(model.language.max_position_embeddings = {context})")
    if resume:
        check_same_parts(RunConfig.from_json(resume / RUN_CONFIG).train, tc)
    processor = ImageProcessor.from_config(config.model.vision)
    if tc.vision_pretrain_steps and not resume:
        say(f"vision pre-training: {tc.vision_pretrain_steps} steps of {tc.vision_pretrain_batch_size} scenes", flush=True)
        pretrain_vision(model.vision.to(device), processor, config.data.shapes, tc.vision_pretrain_steps,
                        tc.vision_pretrain_batch_size, tc.vision_pretrain_lr, tc.seed, device, report=say)
        distributed.broadcast_parameters(model.vision)  # GPU kernels need not be bit-exact across ranks
    freeze_parts(model, tc)
    model = distributed.wrap(model.to(device), tc.parallel, ranks, device)
    optimizer = build_optimizer(distributed.unwrap(model), tc, device)
    state = load_training_state(resume, model, optimizer, ranks) if resume else {"step": 0, "samples_seen": 0, "history": []}
    scheduler = build_scheduler(optimizer, tc, state["step"])
    # Checkpoints from before multi-GPU training counted batches (data_position), not samples.
    samples_seen = state.get("samples_seen", state.get("data_position", 0) * tc.batch_size * tc.grad_accum_steps)
    step, history = state["step"], state["history"]
    collator = VQACollator(tokenizer, processor, config.model.tokens_per_image, tc.max_length, ensure_image=ranks.distributed,
                           image_position=config.model.image_position, pack=tc.packing)

    report = tqdm.write if ranks.is_main else lambda message: None
    train_records = CheckedRecords(train_data, config.data.on_bad_record, "train", report=report)
    validation_records = CheckedRecords(validation_data, config.data.on_bad_record, "validation", report=report)
    lengths = text_lengths(train_data) if tc.group_by_length else None
    sampler = ResumableBatchSampler(len(train_records), tc.batch_size, tc.seed, samples_seen, ranks.rank, ranks.world_size, lengths)
    batches = iter(DataLoader(train_records, batch_sampler=sampler, collate_fn=collator))
    bad_before = bad_records = state.get("bad_records", 0)
    validation_batches = [collator([validation_records[i] for i in range(s, min(s + tc.batch_size, len(validation_records)))])
                          for s in range(0, min(len(validation_records), tc.eval_batches * tc.batch_size), tc.batch_size)]
    forward = torch.compile(model) if tc.compile else model
    run = None
    if tc.wandb and ranks.is_main:
        import wandb

        run = wandb.init(project=tc.wandb_project, config=config.to_dict(), dir=str(output_dir), resume="allow")
    say(f"model: {sum(p.numel() for p in distributed.unwrap(model).parameters()) / 1e6:.2f}M parameters, "
        f"{config.model.tokens_per_image} tokens per image, vocabulary {config.model.language.vocab_size}; data: "
        f"{len(train_data)} train / {len(validation_data)} validation samples; device {device}"
        + (f"; {ranks.world_size} ranks ({tc.parallel})" if ranks.distributed else ""), flush=True)

    # A progress bar on a terminal; plain lines where the output goes to a file (a bar would fill it with '\r').
    bar = ranks.is_main and sys.stdout.isatty() and sys.stderr.isatty()
    progress = tqdm(range(step, tc.max_steps), initial=step, total=tc.max_steps, desc="train", dynamic_ncols=True,
                    disable=not bar)
    started, tokens_seen, skipped = time.perf_counter(), 0, state.get("skipped_steps", 0)
    with GracefulStop(escalate=not ranks.distributed) as stop:
        for step in progress:
            step_loss, tokens, finite = train_step(forward, model, batches, optimizer, scheduler, tc, autocast, device)
            samples_seen += tc.batch_size * tc.grad_accum_steps * ranks.world_size
            tokens_seen += tokens
            if not finite:
                skipped += 1
                if tc.on_nonfinite == "stop":
                    raise TrainingError(f"non-finite loss or gradient at step {step + 1}: stopped (train.on_nonfinite=stop); "
                                        f"the checkpoints in {output_dir} are intact")
                report(f"step {step + 1}: non-finite loss or gradient, step skipped ({skipped} so far)")
            history.append([step + 1, step_loss])
            done = step + 1 == tc.max_steps
            if (step + 1) % tc.log_every == 0 or done:
                rate = tokens_seen / (time.perf_counter() - started)
                progress.set_postfix(loss=f"{step_loss:.4f}", tok_s=f"{rate:,.0f}")
                if not bar:
                    say(f"step {step + 1}/{tc.max_steps}: loss {step_loss:.4f}, {rate:,.0f} tokens/s", flush=True)
                if run:
                    run.log({"train/loss": step_loss, "train/tokens_per_s": rate, "lr": scheduler.get_last_lr()[-1]}, step=step + 1)
            if (step + 1) % tc.eval_every == 0 or done:
                val_loss = validation_loss(model, validation_batches, device, autocast, tc.loss_weight)
                state.setdefault("validation", []).append([step + 1, val_loss])
                report(f"step {step + 1}: train loss {step_loss:.4f}, validation loss {val_loss:.4f}")
                if run:
                    run.log({"val/loss": val_loss}, step=step + 1)
            stop_requested = all_reduce([float(stop.requested is not None)], op="max", device=device)[0] > 0
            if (step + 1) % tc.save_every == 0 or done or stop_requested:
                if not distributed.all_finite(model):
                    raise TrainingError(f"the weights hold NaN/inf at step {step + 1}: not saved; the checkpoints in {output_dir} are intact")
                bad_records = bad_before + int(all_reduce([train_records.num_bad], device=device)[0])
                path = save_checkpoint(output_dir, step + 1, model, tokenizer, optimizer, config, tc.keep_checkpoints,
                                       extra={"samples_seen": samples_seen, "history": history, "skipped_steps": skipped,
                                              "bad_records": bad_records,
                                              "validation": state.get("validation", [])}, ranks=ranks)
                if stop_requested and not done:
                    progress.close()
                    say(f"{stop.requested or 'stop signal'}: saved {path}; continue with: python train.py --resume {output_dir}", flush=True)
                    return {"step": step + 1, "stopped_by": stop.requested}
    progress.close()
    metrics = {"step": tc.max_steps, "train_loss": history[-1][1] if history else None,
               "validation_loss": state["validation"][-1][1] if state.get("validation") else None,
               "skipped_steps": skipped, "bad_records": bad_records}
    final_model = unsharded(model, config, output_dir / f"step_{tc.max_steps:06d}", ranks)
    if not ranks.is_main:
        return metrics
    return finish(final_model, tokenizer, processor, validation_records, config, state.get("validation", []), history,
                  metrics, device, run)


def load_for_resume(checkpoint: Path) -> tuple[VisionLanguageModel, object]:
    """The model and tokenizer of a checkpoint to resume; a sharded (FSDP2) one gets its weights from its shards later."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    if (checkpoint / SHARDED).is_dir():
        return VisionLanguageModel(VLMConfig.from_json(checkpoint / "config.json")), tokenizer
    return VisionLanguageModel.from_pretrained(checkpoint), tokenizer


def unsharded(model, config: RunConfig, checkpoint: Path, ranks: distributed.Ranks) -> VisionLanguageModel | None:
    """The trained model as one ordinary module on rank 0 (None elsewhere). An FSDP2 model is gathered from its
    shards (every rank takes part) and also saved in the `save_pretrained` layout into the final checkpoint."""
    if not distributed.is_sharded(model):
        return distributed.unwrap(model) if ranks.is_main else None
    weights = distributed.full_state_dict(model)
    if not ranks.is_main:
        return None
    plain = VisionLanguageModel(config.model)
    plain.load_state_dict(weights)
    plain.save_pretrained(checkpoint)
    return plain


def finish(model, tokenizer, processor, validation_records: CheckedRecords, config: RunConfig, validation_losses, history,
           metrics: dict, device, run) -> dict:
    """Final exact-match scores, metrics.json, loss curve, prediction grid, and one held-out image for the demo."""
    tc, output_dir = config.train, Path(config.train.output_dir)
    model.to(device)
    records = [r for r in map(validation_records.__getitem__, range(min(tc.eval_questions, len(validation_records)))) if r]
    if records:
        predictions = answer(model, tokenizer, processor, records, device)
        metrics.update(exact_match(records, predictions))
        save_prediction_grid(records[:GRID_EXAMPLES], predictions[:GRID_EXAMPLES], output_dir / "predictions.png")
        with_image = [r for r in records if r["images"]]
        example = next((r for r in with_image if "circle" in json.dumps(r["texts"])), with_image[0] if with_image else None)
        if example:
            example["images"][0].save(output_dir / "heldout_example.png")
    save_loss_curve(history, validation_losses, output_dir / "loss_curve.png")
    (output_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    if run:
        run.log({f"final/{k}": v for k, v in metrics.items() if isinstance(v, (int, float))})
        run.finish()
    print(json.dumps(metrics, indent=2))
    return metrics


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML run config (default: configs/tiny.yaml)")
    parser.add_argument("--resume", type=Path, help="a run directory or checkpoint to continue from")
    args, rest = parser.parse_known_args(argv)
    try:
        overrides = parse_overrides(rest)
        if args.resume:
            checkpoint = find_checkpoint(args.resume)
            config = RunConfig.from_json(checkpoint / RUN_CONFIG).replace(overrides)
            print(f"resuming from {checkpoint}", flush=True)
            train(config, resume=checkpoint)
        else:
            config_path = args.config or (Path(__file__).parent / "configs" / "tiny.yaml")
            train(load_run_config(config_path, overrides))
    except TinyVLMError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except torch.distributed.DistError as e:  # another rank died or hung: torchrun reports which
        print(f"error: lost contact with the other ranks ({type(e).__name__}: {one_line(e, 300)})", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
