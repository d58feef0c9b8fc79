"""Decode speed and weight bytes of int8 / int4 / int8-dynamic (models/quantize.py) against float, side by
side in one run on the same random weights (SmolLM2-135M shape, benchmarks/decode.py's models), greedy.

    python benchmarks/quantize.py                         # CPU: batch 1 and 8, float32 and each quantization
    python benchmarks/quantize.py --device cuda --dtype bfloat16 --batch-sizes 1

Each quantization runs through tinyvlm's compiled decode step ("fast") and eagerly, and through transformers'
`generate` (dynamic cache) with torchao's same config applied to its Llama's linears (its tied head kept, as
tinyvlm keeps it). ms/step as in decode.py: (time(N new
tokens) - time(1)) / (N - 1). Each row's floor: its weights' bytes (what a decode step reads at least once)
at the rate this device reads a buffer of the float model's size; "x float" is its step against the float
model's in the same method and batch, the quantizations timed in turn, round after round (the median of
--repeats rounds). Writes benchmarks/results/quantize-<device>.{md,json}.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import hardware, write_result  # noqa: E402
from benchmarks.decode import bandwidth_floor_ms, build_models, make_runner, timed  # noqa: E402
from models.quantize import QUANTIZATIONS as OFFERED  # noqa: E402
from models.quantize import QuantizationError, check_supported, quantize, quantize_linears, stored_bytes  # noqa: E402

QUANTIZATIONS = ("float", *OFFERED)
METHODS = ("tinyvlm fast", "tinyvlm eager", "transformers dynamic")


def weight_bytes(model: nn.Module) -> int:
    return sum(stored_bytes(p) for p in model.parameters())


def runnable(device: torch.device, dtype: torch.dtype) -> list[str]:
    """Float and each quantization that runs on `device` with `dtype` weights (models/quantize.py's check)."""
    names = ["float"]
    for name in OFFERED:
        try:
            check_supported(name, device, dtype)
        except QuantizationError:
            continue
        names.append(name)
    return names


def quantized_pair(reference: nn.Module, ours: nn.Module, name: str) -> tuple[nn.Module, nn.Module, float]:
    """Copies of transformers' model and ours with `name`'s quantization (ours fused first, as
    load_for_inference does), and the seconds quantizing ours took."""
    reference, ours = copy.deepcopy(reference), copy.deepcopy(ours).fuse_projections()
    if name == "float":
        return reference, ours, 0.0
    start = time.perf_counter()
    quantize(ours, name)
    seconds = time.perf_counter() - start
    quantize_linears(reference.model, name)  # the decoder's linears: lm_head (tied) stays float
    return reference, ours, seconds


@torch.inference_mode()
def measure(reference, ours, args, device) -> list[dict]:
    """Each batch size and method times every quantization in turn, `repeats` rounds, the median kept: a
    drift of the machine's memory speed during the run (this VM's buffer reads measured 33-52 GB/s from one
    run to the next) then falls on all of them alike instead of on whichever ran last."""
    gb_per_s, float_floor_ms = bandwidth_floor_ms(ours.language, device)
    print(f"reads at {gb_per_s:.1f} GB/s: float32 floor {float_floor_ms:.2f} ms/step", flush=True)
    pairs = {name: quantized_pair(reference, ours, name) for name in args.quantizations}
    rows = []
    for batch in args.batch_sizes:
        ids = torch.randint(100, 49000, (batch, args.prompt_len),
                            generator=torch.Generator().manual_seed(batch)).to(device)
        for method in args.methods:
            runs = {name: make_runner(method, ref_q, ours_q) for name, (ref_q, ours_q, _) in pairs.items()}
            for run in runs.values():
                run(ids, args.new_tokens if "fast" in method else args.warmup_tokens)  # compile / warm up
            steps: dict[str, list[float]] = {name: [] for name in runs}
            for _ in range(args.repeats):
                for name, run in runs.items():
                    full, _ = timed(run, ids, args.new_tokens, 1, device)
                    first, _ = timed(run, ids, 1, 1, device)
                    steps[name].append(1000 * (full - first) / (args.new_tokens - 1))
            base_ms = statistics.median(steps[args.quantizations[0]])
            for name, (_, ours_q, seconds) in pairs.items():
                megabytes, step_ms = weight_bytes(ours_q.language) / 1e6, statistics.median(steps[name])
                rows.append(dict(quantization=name, batch=batch, method=method, ms_per_step=step_ms,
                                 weight_mb=megabytes, floor_ms=megabytes / 1e3 / gb_per_s * 1e3,
                                 quantize_s=seconds, x_float=step_ms / base_ms))
                rounds = ", ".join(f"{t:.1f}" for t in steps[name])
                print(f"{name:<9} batch {batch:>2}  {method:<22} {step_ms:8.2f} ms/step  {megabytes:7.1f} MB"
                      f"  (rounds: {rounds})", flush=True)
    return rows


def table(rows: list[dict], args, device: torch.device) -> list[str]:
    title = (f"Quantization, decode, SmolLM2-135M shape, random weights, {args.dtype}, greedy, "
             f"{args.prompt_len}-token prompt, {args.new_tokens} new tokens; {hardware(device)}; "
             f"torch {torch.__version__}")
    lines = [f"**{title}**", "",
             "| quantization | batch | method | ms/step | x float | weights MB | floor ms/step | "
             "step / floor | quantize s |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['quantization']} | {r['batch']} | {r['method']} | {r['ms_per_step']:.2f} | "
              f"{r['x_float']:.2f} | {r['weight_mb']:.1f} | {r['floor_ms']:.2f} | "
              f"{r['ms_per_step'] / r['floor_ms']:.2f} | {r['quantize_s']:.1f} |" for r in rows]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-len", type=int, default=100)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--warmup-tokens", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quantizations", nargs="+", choices=QUANTIZATIONS,
                        help="default: float and every quantization that runs on --device in --dtype")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    device = torch.device(args.device)
    args.quantizations = args.quantizations or runnable(device, getattr(torch, args.dtype))
    reference, ours = build_models(device, getattr(torch, args.dtype))
    rows = measure(reference, ours, args, device)
    write_result(args.out, f"quantize-{device.type}", table(rows, args, device), dict(rows=rows))


if __name__ == "__main__":
    main()
