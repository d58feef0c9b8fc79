"""Train a config on several seeds (and thread counts) and print the distribution of its held-out scores: the
table the README shows for the tiny default. What a newcomer sees is one draw from it.

    python benchmarks/seeds.py                                     # configs/tiny.yaml, seeds 0-4, 2 threads
    python benchmarks/seeds.py --seeds 0 1 2 --threads 1 2          # 6 runs
    python benchmarks/seeds.py --set train.max_steps=100 --seeds 0  # a quick look at the script itself
    python benchmarks/seeds.py --config configs/tiny-stream.yaml --collect runs/s0 runs/s1  # finished runs

Each run is `python train.py --config CONFIG --train.seed S --train.num_threads T --train.output_dir
OUT/sS-tT`, one after another (runs side by side would slow each other); its metrics.json gives the row. The
table has one row per run, then min / median / max of each column, with the machine, torch version and minutes
per run. Writes benchmarks/results/seeds-<config>.{md,json}. `--collect RUN ...` trains nothing: the table of
runs already finished (their metrics.json, and seed and threads from their last checkpoint; no minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import run_training  # noqa: E402


def train(config: Path, seed: int, threads: int, out: Path, overrides: list[str]) -> dict:
    """One training run; its metrics.json plus the wall time in minutes."""
    metrics, _, minutes = run_training(
        ["--config", str(config), "--train.seed", str(seed), "--train.num_threads", str(threads)],
        overrides,
        out,
        f"seed {seed}, {threads} threads",
    )
    return {"seed": seed, "threads": threads, "minutes": minutes, **metrics}


def collected(run: Path) -> dict:
    """A finished run's row: its metrics.json, with the seed and threads of its last checkpoint's config."""
    metrics = json.loads((run / "metrics.json").read_text())
    config = json.loads((run / f"step_{metrics['step']:06d}" / "run_config.json").read_text())["train"]
    return {"seed": config["seed"], "threads": config["num_threads"], **metrics}


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else what platform knows."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.processor() or platform.machine()


def table(rows: list[dict], title: str) -> str:
    columns = ["accuracy", *sorted(k for k in rows[0] if k.startswith("accuracy/")), "validation_loss",
               "minutes"]
    columns = [c for c in columns if all(c in r for r in rows)]
    names = [c.removeprefix("accuracy/") for c in columns]
    lines = [f"**{title}**", "", "| run | " + " | ".join(names) + " |", "|---" * (len(columns) + 1) + "|"]
    for r in rows:
        lines.append(
            f"| seed {r['seed']}, {r['threads']} thr | " + " | ".join(f"{r[c]:.3f}" for c in columns) + " |"
        )
    for name, statistic in (("min", min), ("median", statistics.median), ("max", max)):
        lines.append(
            f"| **{name}** | " + " | ".join(f"{statistic(r[c] for r in rows):.3f}" for c in columns) + " |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=Path("configs/tiny.yaml"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--threads", type=int, nargs="+", default=[2])
    parser.add_argument("--set", nargs="*", default=[], metavar="SECTION.FIELD=VALUE",
                        help="config overrides for every run, e.g. train.max_steps=100")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once")
    parser.add_argument("--runs", type=Path, default=Path("runs/seeds"), help="where the runs go")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--collect", type=Path, nargs="+", metavar="RUN",
                        help="finished runs' directories: their table, nothing trained")
    args = parser.parse_args()
    import torch

    def run(threads: int, seed: int) -> dict:
        row = train(args.config, seed, threads, args.runs / f"s{seed}-t{threads}", args.set)
        print(f"seed {seed}, {threads} threads: accuracy {row.get('accuracy', float('nan')):.3f} "
              f"in {row['minutes']:.1f} min", flush=True)
        return row

    if args.collect:
        rows = [collected(run) for run in args.collect]
    else:
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            rows = list(pool.map(run, *zip(*[(t, s) for t in args.threads for s in args.seeds])))
    device = dict(o.partition("=")[::2] for o in args.set).get("train.device", "cpu")
    machine = (
        torch.cuda.get_device_name() if device.startswith("cuda") else f"{cpu_name()}, {os.cpu_count()} cores"
    )
    title = (f"{' '.join([str(args.config), *args.set])}: held-out exact match per seed; {machine}, "
             f"torch {torch.__version__}" + (f", {args.jobs} runs at once" if args.jobs > 1 else ""))
    text = table(rows, title)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / (
        f"seeds-{args.config.stem}" + ("" if device == "cpu" else f"-{device.replace(':', '')}")
    )
    stem.with_suffix(".md").write_text(text + "\n")
    stem.with_suffix(".json").write_text(json.dumps({"title": title, "rows": rows}, indent=2) + "\n")
    print(text)


if __name__ == "__main__":
    main()
