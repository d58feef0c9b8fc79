"""LoRA vs full fine-tuning of a trained model onto new data, over seeds: held-out exact match, trainable
parameters, peak memory and training speed, min / median / max per method.

    python -m data.synthetic_objects /tmp/objects         # new data: the second synthetic set
    python benchmarks/finetune.py --init-from runs/tiny --data /tmp/objects --steps 1000 --seeds 0 1 2

Each run is `python train.py --init_from INIT --data.source jsonl --data.path DATA/train.jsonl
--data.validation_path DATA/validation.jsonl --train.seed S --train.max_steps N ...` (the default recipe's
training settings, as a user's fine-tune gets them), one after another, with `--train.lora.rank R` for LoRA;
its metrics.json (accuracy, trainable parameters, peak memory) and its log (tokens/s) give the row. Writes
benchmarks/results/finetune-<device>.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import run_training  # noqa: E402
from benchmarks.seeds import cpu_name  # noqa: E402

RATE = re.compile(r"step \d+/\d+: loss [\d.]+, ([\d,]+) tokens/s")


def train(method: str, seed: int, args: argparse.Namespace) -> dict:
    """One fine-tuning run: its metrics.json, median tokens/s, trainable parameters and wall time."""
    data = args.data.resolve()
    arguments = ["--init_from", str(args.init_from), "--data.source", "jsonl", "--data.path",
                 str(data / "train.jsonl"), "--data.validation_path", str(data / "validation.jsonl"),
                 "--train.seed", str(seed), "--train.max_steps", str(args.steps), "--train.eval_every",
                 str(args.steps), "--train.save_every", str(args.steps), "--train.device", args.device]
    if method == "lora":
        arguments += ["--train.lora.rank", str(args.rank), "--train.lora.alpha", str(2 * args.rank)]
    metrics, log, minutes = run_training(
        arguments, args.set, args.runs / f"{method}-s{seed}", f"{method}, seed {seed}"
    )
    rates = [float(m.group(1).replace(",", "")) for m in RATE.finditer(log)]
    return {"method": method, "seed": seed, **metrics,
            "tokens_per_s": statistics.median(rates) if rates else 0.0,
            "trainable": metrics["trainable_parameters"], "minutes": minutes}


def table(rows: list[dict], title: str) -> str:
    columns = ["accuracy", "validation_loss", "trainable", "peak_memory_mib", "tokens_per_s", "minutes"]
    lines = [f"**{title}**", "", "| method | run | " + " | ".join(columns) + " |",
             "|---" * (len(columns) + 2) + "|"]
    cell = {"trainable": "{:,.0f}", "peak_memory_mib": "{:,.0f}", "tokens_per_s": "{:,.0f}"}
    for method in dict.fromkeys(r["method"] for r in rows):
        group = [r for r in rows if r["method"] == method]
        for r in group:
            lines.append(f"| {method} | seed {r['seed']} | "
                         + " | ".join(cell.get(c, "{:.3f}").format(r[c]) for c in columns) + " |")
        for name, statistic in (("min", min), ("median", statistics.median), ("max", max)):
            lines.append(
                f"| {method} | **{name}** | "
                + " | ".join(cell.get(c, "{:.3f}").format(statistic(r[c] for r in group)) for c in columns)
                + " |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--init-from", type=Path, default=Path("runs/tiny"),
                        help="the trained run to fine-tune")
    parser.add_argument("--data", type=Path, required=True,
                        help="a directory with train.jsonl and validation.jsonl")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", default=["full", "lora"], choices=["full", "lora"])
    parser.add_argument("--rank", type=int, default=8, help="LoRA's rank (alpha = 2 x rank)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--set", nargs="*", default=[], metavar="SECTION.FIELD=VALUE",
                        help="config overrides for every run, e.g. train.lr_language=0.001")
    parser.add_argument("--runs", type=Path, default=Path("runs/finetune-bench"), help="where the runs go")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    args.runs = args.runs.resolve()
    import torch

    rows = []
    for method in args.methods:
        for seed in args.seeds:
            rows.append(train(method, seed, args))
            r = rows[-1]
            print(f"{method}, seed {seed}: accuracy {r.get('accuracy', float('nan')):.3f}, "
                  f"{r['trainable']:,} trainable, {r['minutes']:.1f} min", flush=True)
    machine = torch.cuda.get_device_name() if args.device.startswith("cuda") else \
        f"{cpu_name()}, {os.cpu_count()} cores"
    settings = " ".join(args.set) or "the default recipe"
    title = (f"fine-tuning {args.init_from} on {args.data} for {args.steps} steps ({settings}; LoRA rank "
             f"{args.rank}): held-out exact match per seed; {machine}, torch {torch.__version__}")
    text = table(rows, title)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"finetune-{args.device.replace(':', '')}"
    stem.with_suffix(".md").write_text(text + "\n")
    stem.with_suffix(".json").write_text(json.dumps({"title": title, "rows": rows}, indent=2) + "\n")
    print(text)


if __name__ == "__main__":
    main()
