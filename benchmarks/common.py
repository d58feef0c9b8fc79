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


# What a kernel (or, on a CPU, an operator) computes, from its name: the first pattern found names its kind.
KINDS = (("attention", ("flash", "fmha", "attention", "sdpa", "flex", "paged")),
         ("loss", ("cross_entropy", "log_softmax", "nll_loss", "logsumexp")),
         ("optimizer", ("adam", "multi_tensor", "foreach", "lerp")),
         ("matmul", ("gemm", "matmul", "cutlass", "addmm", "linear", "aten::mm", "aten::bmm", "sm90_",
                     "sm80_", "nvjet", "convolution")),
         ("norm", ("norm", "rsqrt")),
         ("copy / cast", ("copy", "cat", "index", "fill", "memset", "memcpy", "to_copy")))


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, patterns in KINDS if any(p in lowered for p in patterns)),
                "elementwise / other")


def kernel_table(call: Callable[[], object], calls: int, device: torch.device, top: int = 20) -> list[str]:
    """The kernels of `calls` calls of `call` (torch.profiler), per call: on a GPU each device kernel's
    launches and time, with the device's busy time against the wall time (the rest: the host keeping it
    waiting); on a CPU each operator's own time (a proxy). A markdown table of the `top` by time, each with
    its kind (`kernel_kind`), after a line of totals and one of time by kind."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
                 ) as trace:
        for _ in range(calls):
            call()
        if cuda:
            torch.cuda.synchronize()
    wall_us = 1e6 * (time.perf_counter() - start) / calls
    averages = trace.key_averages()
    if cuda:
        rows = [(e.key, e.count, e.device_time_total) for e in averages
                if e.device_type == torch.autograd.DeviceType.CUDA]
    else:
        rows = [(e.key, e.count, e.self_cpu_time_total) for e in averages if e.self_cpu_time_total > 0]
    rows = sorted(((name, count / calls, us / calls) for name, count, us in rows), key=lambda row: -row[2])
    total_us = sum(us for _, _, us in rows) or 1.0
    by_kind: dict[str, float] = {}
    for name, _, us in rows:
        kind = kernel_kind(name)
        by_kind[kind] = by_kind.get(kind, 0.0) + us
    what = "device kernels" if cuda else "operators (own CPU time)"
    kinds = sorted(by_kind.items(), key=lambda item: -item[1])
    lines = [f"{what} a call: {sum(count for _, count, _ in rows):.0f}, {total_us:.0f} us of "
             f"{wall_us:.0f} us wall ({100 * total_us / wall_us:.0f}% busy)",
             "", "time by kind: " + ", ".join(f"{kind} {100 * us / total_us:.1f}%" for kind, us in kinds),
             "", "| kernel | kind | launches a call | us a call | share |", "|---|---|---|---|---|"]
    for name, count, us in rows[:top]:
        lines.append(f"| {name[:90]} | {kernel_kind(name)} | {count:.0f} | {us:.0f} | "
                     f"{100 * us / total_us:.1f}% |")
    return lines


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
