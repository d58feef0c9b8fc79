"""Training with and without packing, side by side in one run, on real batches of a run config's data.

    python benchmarks/packing.py                               # tiny default (shapes data) on CPU
    python benchmarks/packing.py --batches 40 --rounds 5 --threads 1

The same records are collated twice: one record per row (padded to the batch's longest), or packed several to
a row (`train.packing`, first-fit decreasing). Both run `training.loop.train_step` (forward, backward, AdamW)
from the same weights; the two modes alternate in rounds and each reports its median round, so drift in
machine speed hits both.
Random weights: the shapes of the batches are what matter. Writes
benchmarks/results/packing-<device>.{md,json}.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import hardware, seconds_per_call, write_result  # noqa: E402
from data import CheckedRecords, ImageProcessor, VQACollator, build_datasets  # noqa: E402
from training.config import RunConfig, load_run_config  # noqa: E402
from training.loop import Trainer, train_step  # noqa: E402
from training.optim import build_optimizer, build_scheduler, freeze_parts  # noqa: E402
from training.setup import build_model, build_tokenizer  # noqa: E402

MODES = {"one record per row": False, "packed": True}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny.yaml",
                        help="a YAML run config (its data, model and batch size)")
    parser.add_argument("--batches", type=int, default=30, help="distinct batches each round steps through")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    return parser.parse_args()


def build_runs(config: RunConfig, num_batches: int, device: torch.device) -> dict[str, dict]:
    """For each mode: its collated batches (the same records) and a Trainer over its own copy of one model."""
    train_config = config.train
    if config.data.source == "synthetic":  # generate only the records the benchmark reads
        config = config.replace({"data.shapes.num_train": str(num_batches * train_config.batch_size)})
    train_data, _ = build_datasets(config.data)
    tokenizer = build_tokenizer(config, train_data)
    model = build_model(config, tokenizer)
    freeze_parts(model, train_config)
    model.to(device)
    processor = ImageProcessor.from_config(model.config.vision)
    records = CheckedRecords(train_data, "skip", "train")
    size = train_config.batch_size
    batch_records = [[records[i] for i in range(k * size, (k + 1) * size)] for k in range(num_batches)]
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" and train_config.bf16
                else contextlib.nullcontext())
    runs = {}
    for mode, pack in MODES.items():
        collator = VQACollator(tokenizer, processor, model.config.tokens_per_image, train_config.max_length,
                               image_position=model.config.image_position, pack=pack)
        copied = copy.deepcopy(model)
        optimizer = build_optimizer(copied, train_config, device)
        trainer = Trainer(config, copied, copied, optimizer, build_scheduler(optimizer, train_config), device,
                          autocast)
        runs[mode] = {"batches": [collator(group) for group in batch_records], "trainer": trainer, "ms": []}
    return runs


def summary(runs: dict[str, dict]) -> list[dict]:
    """A row per mode: the batches' shapes, padding, and the median step time against the first mode's."""
    rows, baseline = [], None
    for mode, run in runs.items():
        batches = run["batches"]
        positions = statistics.mean(b["input_ids"].numel() for b in batches)
        real = statistics.mean(int((b["attention_mask"] > 0).sum()) for b in batches)
        ms = statistics.median(run["ms"])
        baseline = baseline or ms
        rows.append(dict(mode=mode, rows=statistics.mean(b["input_ids"].shape[0] for b in batches),
                         length=statistics.mean(b["input_ids"].shape[1] for b in batches),
                         positions=positions, real_tokens=real, padding=1 - real / positions, ms_per_step=ms,
                         real_tokens_per_s=1000 * real / ms, speedup=baseline / ms))
    return rows


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    config = load_run_config(args.config, {"train.vision_pretrain_steps": "0"})
    runs = build_runs(config, args.batches, device)

    def one_pass(run: dict) -> float:
        batches = iter(run["batches"])
        return seconds_per_call(lambda: train_step(run["trainer"], [next(batches)]), len(run["batches"]),
                                device)

    for run in runs.values():  # warm-up
        one_pass(run)
    for _ in range(args.rounds):
        for run in runs.values():
            run["ms"].append(1000 * one_pass(run))
    rows, machine = summary(runs), hardware(device)
    table = [f"{args.config}: {config.train.batch_size} records a step, {args.batches} batches x "
             f"{args.rounds} rounds, {machine}", "",
             "| mode | rows x length (mean) | positions | real tokens | padding | ms/step (median) | real "
             "tokens/s | speed-up |",
             "|---|---|---|---|---|---|---|---|"]
    table += [f"| {r['mode']} | {r['rows']:.1f} x {r['length']:.1f} | {r['positions']:,.0f} | "
              f"{r['real_tokens']:,.0f} | {100 * r['padding']:.0f}% | {r['ms_per_step']:.1f} | "
              f"{r['real_tokens_per_s']:,.0f} | {r['speedup']:.2f}x |" for r in rows]
    write_result(args.out, f"packing-{device.type}", table,
                 dict(config=args.config, hardware=machine, rounds=args.rounds, results=rows))


if __name__ == "__main__":
    main()
