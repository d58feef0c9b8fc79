"""Train a vision-language model.

    python train.py                                       # the tiny default: synthetic shapes, from scratch, CPU
    python train.py --config configs/smollm2-shapes.yaml  # real SmolLM2-135M-Instruct + a small ViT (GPU)
    python train.py --config configs/tiny.yaml --train.max_steps 200 --train.output_dir runs/try1 --train.compile false
    python train.py --resume runs/tiny                    # continue from the newest complete checkpoint

Any config field can be set with `--section.field VALUE` (sections: model, data, train; and `--tokenizer`).
A run writes checkpoints (`step_NNNNNN/`: model, tokenizer, training state), `metrics.json`, `loss_curve.png`,
`predictions.png` and `heldout_example.png` into `train.output_dir`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import signal
import sys
import threading
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Sampler
from tqdm import tqdm

from data import (IMAGE_TOKEN, BadRecordError, CheckedRecords, DataSourceError, ImageLoadError, ImageProcessor, VQACollator,
                  build_datasets, build_shapes_tokenizer, conversation_texts, prepare_tokenizer, token_id)
from models import CheckpointError, ConfigError, GenerationError, VisionLanguageModel
from models.loading import resolve
from training.checkpoint import RUN_CONFIG, find_checkpoint, load_training_state, save_checkpoint
from training.config import RunConfig, load_run_config, parse_overrides, pick_device
from training.evaluate import answer, exact_match, save_loss_curve, save_prediction_grid, validation_loss
from training.optim import build_optimizer, build_scheduler

GRID_EXAMPLES = 16


class ResumableBatchSampler(Sampler[list[int]]):
    """Endless shuffled batches; batch k is a pure function of (seed, k), so a run resumes at any batch."""

    def __init__(self, num_samples: int, batch_size: int, seed: int, start: int = 0) -> None:
        self.num_samples, self.batch_size, self.seed, self.start = num_samples, batch_size, seed, start
        self.batches_per_epoch = max(1, num_samples // batch_size)

    def __iter__(self):
        position, epoch, order = self.start, None, None
        while True:
            if position // self.batches_per_epoch != epoch:
                epoch = position // self.batches_per_epoch
                order = torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(self.seed + epoch))
            offset = (position % self.batches_per_epoch) * self.batch_size
            yield order[offset : offset + self.batch_size].tolist()
            position += 1


class TrainingError(RuntimeError):
    """Training cannot go on (for example a non-finite loss with train.on_nonfinite=stop)."""


class GracefulStop:
    """SIGINT / SIGTERM ask the loop to finish its step, write a checkpoint and return; a second signal stops at once."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __enter__(self) -> GracefulStop:
        self.requested: str | None = None
        on_main_thread = threading.current_thread() is threading.main_thread()
        self.previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS} if on_main_thread else {}
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    def _handle(self, signum: int, frame) -> None:
        if self.requested:
            self.restore()
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name

    def restore(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        self.previous = {}


def train_step(forward, model, batches, optimizer, scheduler, tc, autocast, device) -> tuple[float, int, bool]:
    """One optimizer step over grad_accum_steps micro-batches; returns (loss, tokens, finite). A step whose loss or
    gradient is not finite changes no weight."""
    model.train()
    step_loss, tokens = 0.0, 0
    for _ in range(tc.grad_accum_steps):
        batch = {k: v.to(device) for k, v in next(batches).items()}
        if not batch["input_ids"].numel():  # every record of it was bad or too long
            continue
        with autocast:
            _, loss = forward(**batch)
        (loss / tc.grad_accum_steps).backward()
        step_loss += loss.item() / tc.grad_accum_steps
        tokens += int(batch["attention_mask"].sum())
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip or float("inf"))
    finite = math.isfinite(step_loss) and bool(torch.isfinite(grad_norm))
    if finite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return step_loss, tokens, finite


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
    settings = {"image_token_id": token_id(tokenizer, IMAGE_TOKEN), "language.eos_token_id": tokenizer.eos_token_id}
    if not config.model.language.pretrained:
        settings["language.vocab_size"] = len(tokenizer)
    model = VisionLanguageModel.from_backbones(config.model.replace(settings), config.train.allow_pickle)
    model.resize_token_embeddings(len(tokenizer), settings["image_token_id"])
    return model


def train(config: RunConfig, resume: Path | None = None) -> dict:
    """Run training to `train.max_steps`; return the final metrics."""
    tc = config.train
    torch.manual_seed(tc.seed)
    if tc.num_threads:
        torch.set_num_threads(tc.num_threads)
    device, output_dir = pick_device(tc.device), Path(tc.output_dir)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" and tc.bf16 else contextlib.nullcontext()

    train_data, validation_data = build_datasets(config.data)
    if resume:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(resume)
        model = VisionLanguageModel.from_pretrained(resume)
    else:
        tokenizer = build_tokenizer(config, train_data)
        model = build_model(config, tokenizer)
    config = RunConfig(model.config, config.data, config.train, config.tokenizer)
    model.to(device)
    processor = ImageProcessor.from_config(model.config.vision)
    collator = VQACollator(tokenizer, processor, model.config.tokens_per_image, tc.max_length)
    optimizer = build_optimizer(model, tc, device)
    scheduler = build_scheduler(optimizer, tc)
    state = load_training_state(resume, optimizer, scheduler) if resume else {"step": 0, "data_position": 0, "history": []}
    step, history = state["step"], state["history"]

    train_records = CheckedRecords(train_data, config.data.on_bad_record, "train", report=tqdm.write)
    validation_records = CheckedRecords(validation_data, config.data.on_bad_record, "validation", report=tqdm.write)
    sampler = ResumableBatchSampler(len(train_records), tc.batch_size, tc.seed, start=state["data_position"])
    batches = iter(DataLoader(train_records, batch_sampler=sampler, collate_fn=collator))
    data_position, bad_before = state["data_position"], state.get("bad_records", 0)
    validation_batches = [collator([validation_records[i] for i in range(s, min(s + tc.batch_size, len(validation_records)))])
                          for s in range(0, min(len(validation_records), tc.eval_batches * tc.batch_size), tc.batch_size)]
    forward = torch.compile(model) if tc.compile else model
    run = None
    if tc.wandb:
        import wandb

        run = wandb.init(project=tc.wandb_project, config=config.to_dict(), dir=str(output_dir), resume="allow")
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, {model.config.tokens_per_image} "
          f"tokens per image, vocabulary {model.config.language.vocab_size}; data: {len(train_data)} train / "
          f"{len(validation_data)} validation samples; device {device}", flush=True)

    progress = tqdm(range(step, tc.max_steps), initial=step, total=tc.max_steps, desc="train", dynamic_ncols=True)
    started, tokens_seen, skipped = time.perf_counter(), 0, state.get("skipped_steps", 0)
    with GracefulStop() as stop:
        for step in progress:
            step_loss, tokens, finite = train_step(forward, model, batches, optimizer, scheduler, tc, autocast, device)
            data_position += tc.grad_accum_steps
            tokens_seen += tokens
            if not finite:
                skipped += 1
                if tc.on_nonfinite == "stop":
                    raise TrainingError(f"non-finite loss or gradient at step {step + 1}: stopped (train.on_nonfinite=stop); "
                                        f"the checkpoints in {output_dir} are intact")
                progress.write(f"step {step + 1}: non-finite loss or gradient, step skipped ({skipped} so far)")
            history.append([step + 1, step_loss])
            done = step + 1 == tc.max_steps
            if (step + 1) % tc.log_every == 0 or done:
                rate = tokens_seen / (time.perf_counter() - started)
                progress.set_postfix(loss=f"{step_loss:.4f}", tok_s=f"{rate:,.0f}")
                if run:
                    run.log({"train/loss": step_loss, "train/tokens_per_s": rate, "lr": scheduler.get_last_lr()[-1]}, step=step + 1)
            if (step + 1) % tc.eval_every == 0 or done:
                val_loss = validation_loss(model, validation_batches, device, autocast)
                state.setdefault("validation", []).append([step + 1, val_loss])
                progress.write(f"step {step + 1}: train loss {step_loss:.4f}, validation loss {val_loss:.4f}")
                if run:
                    run.log({"val/loss": val_loss}, step=step + 1)
            if (step + 1) % tc.save_every == 0 or done or stop.requested:
                if not all(torch.isfinite(p).all() for p in model.parameters()):
                    raise TrainingError(f"the weights hold NaN/inf at step {step + 1}: not saved; the checkpoints in {output_dir} are intact")
                path = save_checkpoint(output_dir, step + 1, model, tokenizer, optimizer, scheduler, config, tc.keep_checkpoints,
                                       extra={"data_position": data_position, "history": history, "skipped_steps": skipped,
                                              "bad_records": bad_before + train_records.num_bad,
                                              "validation": state.get("validation", [])})
                if stop.requested and not done:
                    progress.close()
                    print(f"{stop.requested}: saved {path}; continue with: python train.py --resume {output_dir}", flush=True)
                    return {"step": step + 1, "stopped_by": stop.requested}
    progress.close()
    metrics = {"step": tc.max_steps, "train_loss": history[-1][1] if history else None,
               "validation_loss": state["validation"][-1][1] if state.get("validation") else None,
               "skipped_steps": skipped, "bad_records": bad_before + train_records.num_bad}
    return finish(model, tokenizer, processor, validation_records, config, state.get("validation", []), history, metrics, device, run)


def finish(model, tokenizer, processor, validation_records: CheckedRecords, config: RunConfig, validation_losses, history,
           metrics: dict, device, run) -> dict:
    """Final exact-match scores, metrics.json, loss curve, prediction grid, and one held-out image for the demo."""
    tc, output_dir = config.train, Path(config.train.output_dir)
    records = [r for r in map(validation_records.__getitem__, range(min(tc.eval_questions, len(validation_records)))) if r]
    if records:
        predictions = answer(model, tokenizer, processor, records, device)
        metrics.update(exact_match(records, predictions))
        save_prediction_grid(records[:GRID_EXAMPLES], predictions[:GRID_EXAMPLES], output_dir / "predictions.png")
        example = next((r for r in records if "circle" in json.dumps(r["texts"])), records[0])
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
    except (BadRecordError, ConfigError, CheckpointError, DataSourceError, GenerationError, ImageLoadError, TrainingError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
