"""What the benchmarks share: the machine's name, a timed loop with the device synchronised, and a result
written as markdown (the table) + JSON (the numbers) under benchmarks/results."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def hardware(device: torch.device) -> str:
    """The GPU's name, or the CPU's with the threads torch uses."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or 'CPU'}, {torch.get_num_threads()} threads"


def seconds_per_call(function: Callable[[], object], calls: int, device: torch.device) -> float:
    """Wall time of `calls` calls of `function`, per call, with the GPU's queue drained before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        function()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls


def write_result(out: Path, stem: str, table: list[str], numbers: dict) -> Path:
    """`table` printed and written to OUT/STEM.md, `numbers` to OUT/STEM.json; returns OUT/STEM."""
    print("\n".join(table))
    out.mkdir(parents=True, exist_ok=True)
    path = out / stem
    path.with_suffix(".md").write_text("\n".join(table) + "\n")
    path.with_suffix(".json").write_text(json.dumps(numbers, indent=2) + "\n")
    return path


def run_training(arguments: Sequence[str], overrides: Sequence[str], out: Path,
                 what: str) -> tuple[dict, str, float]:
    """`python train.py ARGUMENTS --train.output_dir OUT` with each SECTION.FIELD=VALUE override: its
    metrics.json, its stdout (the log) and its wall time in minutes. A failed run ends the benchmark with
    train.py's last line."""
    # a re-run of a benchmark measures again into its own directory
    command = [sys.executable, "train.py", *arguments, "--train.output_dir", str(out),
               "--train.overwrite", "true"]
    for override in overrides:
        key, _, value = override.partition("=")
        command += [f"--{key}", value]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"error: {what}: train.py exited {done.returncode}: "
                         f"{(done.stderr.strip().splitlines() or ['(no output)'])[-1]}")
    return json.loads((out / "metrics.json").read_text()), done.stdout, (time.perf_counter() - start) / 60
