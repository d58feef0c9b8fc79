"""The streamed data pipeline (read parquet, decode, check, encode, pack) against what a training step
consumes, side by side in one run: a run config's records written as parquet shards, then streamed with 0, 1
and 2 DataLoader workers (0: the producer thread of data/prefetch.py).

    python benchmarks/streaming.py                         # tiny default (shapes data) on CPU
    python benchmarks/streaming.py --batches 60 --threads 1

For each number of workers: the pipeline alone (samples/s and packed tokens/s, the batches drawn as fast as
they come), then the pipeline feeding `training.loop.train_step`, with the share of the time the loop waited
for batches. Random weights: the shapes of the batches are what matter. Writes
benchmarks/results/streaming-<device>.{md,json}.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import hardware, write_result  # noqa: E402
from data import VQACollator, build_datasets  # noqa: E402
from data.batches import take_bookkeeping  # noqa: E402
from data.chat_processors import ChatProcessor  # noqa: E402
from data.shards import write_shards  # noqa: E402
from data.stream_batches import StreamedBatches, take_stream  # noqa: E402
from data.streaming import Source, StreamConfig  # noqa: E402
from training.config import load_run_config  # noqa: E402
from training.loop import Trainer, train_step  # noqa: E402
from training.optim import build_optimizer, build_scheduler, freeze_parts  # noqa: E402
from training.run import _streamed  # noqa: E402
from training.setup import build_model, build_tokenizer  # noqa: E402

WORKERS = (0, 1, 2)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny.yaml", help="a YAML run config (model, batch size)")
    parser.add_argument("--batches", type=int, default=40, help="batches timed per measurement")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    return parser.parse_args()


def timed_batches(streamed: StreamedBatches, workers: int, count: int,
                  step=None) -> dict[str, float]:
    """`count` batches (after 2 warm-up ones) through `workers`: samples/s, packed tokens/s and, with `step`
    run on each, the seconds spent waiting for batches."""
    with _streamed(streamed, workers, prefetch_factor=2, pin_memory=False) as batches:
        for _ in range(2):
            next(batches)
        waited, tokens = 0.0, 0
        started = time.perf_counter()
        for _ in range(count):
            asked = time.perf_counter()
            batch = next(batches)
            waited += time.perf_counter() - asked
            take_bookkeeping(batch)
            take_stream(batch)
            tokens += int((batch["attention_mask"] > 0).sum())
            if step is not None:
                step(batch)
        elapsed = time.perf_counter() - started
    return {"samples_per_s": count * streamed.batch_size / elapsed, "tokens_per_s": tokens / elapsed,
            "waited_share": waited / elapsed}


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads or torch.get_num_threads())
    torch.manual_seed(0)
    device = torch.device(args.device)
    config = load_run_config(args.config, {"train.vision_pretrain_steps": "0"})
    train_config = config.train
    # the synthetic records the measurements read (2 warm-up batches each), written once as shards
    records_needed = (args.batches + 2) * train_config.batch_size * 2
    train_data, _ = build_datasets(config.replace({"data.shapes.num_train": str(records_needed)}).data)
    tokenizer = build_tokenizer(config, train_data)
    model = build_model(config, tokenizer)
    freeze_parts(model, train_config)
    model.to(device)
    collator = VQACollator.for_encoder(ChatProcessor.from_config(model.config, tokenizer),
                                       train_config.max_length, pack=train_config.packing)
    optimizer = build_optimizer(model, train_config, device)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" and train_config.bf16
                else contextlib.nullcontext())
    trainer = Trainer(config, model, model, optimizer, build_scheduler(optimizer, train_config), device,
                      autocast)
    rows = []
    with tempfile.TemporaryDirectory() as shards:
        write_shards(Path(shards), list(train_data), files=4, rows_per_group=64)
        sources = [Source.open(StreamConfig(files=f"{shards}/*.parquet"))]
        for workers in WORKERS:
            streamed = StreamedBatches(sources, collator, train_config.batch_size, seed=0, buffer_size=256,
                                       policy="skip", num_workers=workers)
            alone = timed_batches(streamed, workers, args.batches)
            training = timed_batches(streamed, workers, args.batches,
                                     step=lambda batch: train_step(trainer, [batch]))
            rows.append({"workers": workers, "pipeline": alone, "training": training})
    machine = hardware(device)
    table = [f"{args.config}: {train_config.batch_size} records a step, {args.batches} batches per "
             f"measurement, {machine}", "",
             "| workers | pipeline samples/s | pipeline packed tokens/s | training samples/s | training "
             "waited for data | pipeline / training |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        pipeline, training = row["pipeline"], row["training"]
        table.append(f"| {row['workers']} | {pipeline['samples_per_s']:,.0f} | "
                     f"{pipeline['tokens_per_s']:,.0f} | {training['samples_per_s']:,.0f} | "
                     f"{100 * training['waited_share']:.0f}% | "
                     f"{pipeline['samples_per_s'] / training['samples_per_s']:.2f}x |")
    write_result(args.out, f"streaming-{device.type}", table,
                 dict(config=args.config, hardware=machine, batches=args.batches, results=rows))


if __name__ == "__main__":
    main()
