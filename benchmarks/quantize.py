"""Decode speed and weight bytes of weight-only int8 / int4 (models/quantize.py) against float, side by side
in one run on the same random weights (SmolLM2-135M shape, benchmarks/decode.py's models), greedy.

    python benchmarks/quantize.py                         # CPU: batch 1 and 8, float32 / int8 / int4
    python benchmarks/quantize.py --device cuda --dtype bfloat16 --batch-sizes 1

Each quantization runs through tinyvlm's compiled decode step ("fast") and eagerly, and through transformers'
`generate` (dynamic cache) with torchao's same config applied to its Llama's linears (its tied head kept, as
tinyvlm keeps it). "int8 dyn" is torchao's int8 dynamic-activation int8-weight config on the same layers: not
offered by --quantize; measured here to see whether it would be worth it. ms/step as in decode.py: (time(N new
tokens) - time(1)) / (N - 1). Each row's floor: its weights' bytes (what a decode step reads at least once)
at the rate this device reads a buffer of the float model's size; "x float" is its step against the float
model's in the same method and batch. Writes benchmarks/results/quantize-<device>.{md,json}.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import hardware, write_result  # noqa: E402
from benchmarks.decode import bandwidth_floor_ms, build_models, make_runner, timed  # noqa: E402
from models.quantize import quantize, quantize_linears, stored_bytes, torchao_quantizer  # noqa: E402

QUANTIZATIONS = ("float", "int8", "int4", "int8 dyn")
METHODS = ("tinyvlm fast", "tinyvlm eager", "transformers dynamic")


def weight_bytes(model: nn.Module) -> int:
    return sum(stored_bytes(p) for p in model.parameters())


def quantized_pair(reference: nn.Module, ours: nn.Module, name: str) -> tuple[nn.Module, nn.Module, float]:
    """Copies of transformers' model and ours with `name`'s quantization (ours fused first, as
    load_for_inference does), and the seconds quantizing ours took."""
    reference, ours = copy.deepcopy(reference), copy.deepcopy(ours).fuse_projections()
    if name == "float":
        return reference, ours, 0.0
    if name == "int8 dyn":
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig

        quantize_ = torchao_quantizer("int8")[0]
        config = Int8DynamicActivationInt8WeightConfig(set_inductor_config=False)
        start = time.perf_counter()
        quantize_(ours.language, config, filter_fn=lambda module, fqn: isinstance(module, nn.Linear)
                  and fqn != "head")
        seconds = time.perf_counter() - start
        quantize_(reference.model, config)
        return reference, ours, seconds
    start = time.perf_counter()
    quantize(ours, name)
    seconds = time.perf_counter() - start
    quantize_linears(reference.model, name)  # the decoder's linears: lm_head (tied) stays float
    return reference, ours, seconds


@torch.inference_mode()
def measure(reference, ours, args, device) -> list[dict]:
    gb_per_s, float_floor_ms = bandwidth_floor_ms(ours.language, device)
    print(f"reads at {gb_per_s:.1f} GB/s: float32 floor {float_floor_ms:.2f} ms/step", flush=True)
    rows = []
    for name in args.quantizations:
        ref_q, ours_q, seconds = quantized_pair(reference, ours, name)
        megabytes = weight_bytes(ours_q.language) / 1e6
        for batch in args.batch_sizes:
            ids = torch.randint(100, 49000, (batch, args.prompt_len),
                                generator=torch.Generator().manual_seed(batch)).to(device)
            for method in args.methods:
                run = make_runner(method, ref_q, ours_q)
                run(ids, args.new_tokens if "fast" in method else args.warmup_tokens)  # compile / warm up
                full, _ = timed(run, ids, args.new_tokens, args.repeats, device)
                first, _ = timed(run, ids, 1, args.repeats, device)
                step_ms = 1000 * (full - first) / (args.new_tokens - 1)
                rows.append(dict(quantization=name, batch=batch, method=method, ms_per_step=step_ms,
                                 weight_mb=megabytes, floor_ms=megabytes / 1e3 / gb_per_s * 1e3,
                                 quantize_s=seconds))
                print(f"{name:<9} batch {batch:>2}  {method:<22} {step_ms:8.2f} ms/step  {megabytes:7.1f} MB",
                      flush=True)
    for row in rows:
        base = next(r for r in rows if r["quantization"] == rows[0]["quantization"]
                    and (r["batch"], r["method"]) == (row["batch"], row["method"]))
        row["x_float"] = row["ms_per_step"] / base["ms_per_step"]
    return rows


def table(rows: list[dict], args, device: torch.device) -> list[str]:
    title = (f"Weight-only quantization, decode, SmolLM2-135M shape, random weights, {args.dtype}, greedy, "
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
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quantizations", nargs="+", default=list(QUANTIZATIONS), choices=QUANTIZATIONS)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    device = torch.device(args.device)
    reference, ours = build_models(device, getattr(torch, args.dtype))
    rows = measure(reference, ours, args, device)
    write_result(args.out, f"quantize-{device.type}", table(rows, args, device), dict(rows=rows))


if __name__ == "__main__":
    main()
