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
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Sampler
from tqdm import tqdm

from data import (IMAGE_TOKEN, ImageLoadError, ImageProcessor, VQACollator, build_datasets, build_shapes_tokenizer,
                  conversation_texts, prepare_tokenizer, token_id)
from models import CheckpointError, ConfigError, GenerationError, VisionLanguageModel
from models.loading import resolve
from training.checkpoint import RUN_CONFIG, find_checkpoint, load_training_state, save_checkpoint
from training.config import RunConfig, load_run_config, parse_overrides
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
    model = VisionLanguageModel.from_backbones(config.model.replace(settings))
    model.resize_token_embeddings(len(tokenizer), settings["image_token_id"])
    return model


def pick_device(name: str) -> torch.device:
    return torch.device("cuda" if name == "auto" and torch.cuda.is_available() else "cpu" if name == "auto" else name)


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

    sampler = ResumableBatchSampler(len(train_data), tc.batch_size, tc.seed, start=state["data_position"])
    batches = iter(DataLoader(train_data, batch_sampler=sampler, collate_fn=collator))
    data_position = state["data_position"]
    validation_batches = [collator([validation_data[i] for i in range(s, min(s + tc.batch_size, len(validation_data)))])
                          for s in range(0, min(len(validation_data), tc.eval_batches * tc.batch_size), tc.batch_size)]
    forward = torch.compile(model) if tc.compile else model
    run = None
    if tc.wandb:
        import wandb

        run = wandb.init(project=tc.wandb_project, config=config.to_dict(), dir=str(output_dir), resume="allow")
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, {model.config.tokens_per_image} "
          f"tokens per image, vocabulary {model.config.language.vocab_size}; data: {len(train_data)} train / "
          f"{len(validation_data)} validation samples; device {device}", flush=True)

    progress = tqdm(range(step, tc.max_steps), initial=step, total=tc.max_steps, desc="train", dynamic_ncols=True)
    started, tokens_seen = time.perf_counter(), 0
    for step in progress:
        model.train()
        step_loss = 0.0
        for _ in range(tc.grad_accum_steps):
            batch = {k: v.to(device) for k, v in next(batches).items()}
            data_position += 1
            with autocast:
                _, loss = forward(**batch)
            (loss / tc.grad_accum_steps).backward()
            step_loss += loss.item() / tc.grad_accum_steps
            tokens_seen += int(batch["attention_mask"].sum())
        if tc.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
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
        if (step + 1) % tc.save_every == 0 or done:
            save_checkpoint(output_dir, step + 1, model, tokenizer, optimizer, scheduler, config, tc.keep_checkpoints,
                            extra={"data_position": data_position, "history": history, "validation": state.get("validation", [])})
    progress.close()
    return finish(model, tokenizer, processor, validation_data, config, state.get("validation", []), history, device, run)


def finish(model, tokenizer, processor, validation_data, config: RunConfig, validation_losses, history, device, run) -> dict:
    """Final exact-match scores, metrics.json, loss curve, prediction grid, and one held-out image for the demo."""
    tc, output_dir = config.train, Path(config.train.output_dir)
    records = [validation_data[i] for i in range(min(tc.eval_questions, len(validation_data)))]
    metrics = {"step": tc.max_steps, "train_loss": history[-1][1] if history else None,
               "validation_loss": validation_losses[-1][1] if validation_losses else None}
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
    except (ConfigError, CheckpointError, GenerationError, ImageLoadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
