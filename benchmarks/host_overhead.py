"""What the serving engine's host costs per decode step, apart from the model: a micro model whose forward
costs little, N running sequences (16-256) all decoding, each step split into schedule / prepare (pack and
send the inputs) / forward (the model) / sample (one batched call and the copy back started: device work,
which a CPU does itself) / wait (for the sampled ids: on a GPU, the device's time) / bookkeeping (append, stop
checks, prefix registration, outputs); least-squares lines over N give the fixed cost and the cost per
sequence of the host's own work (schedule + prepare + bookkeeping) and of everything outside the forward.

    python benchmarks/host_overhead.py                      # greedy and sampled requests, 1 thread
    python benchmarks/host_overhead.py --running 16 64 256 --steps 50
    # the real shape on a GPU (bf16, CUDA graphs); --profile adds the device's kernels
    python benchmarks/host_overhead.py --device cuda --model smollm2-135m
    python benchmarks/host_overhead.py --device cuda --model smollm2-135m --running 16 256 --profile
    python benchmarks/host_overhead.py --device cuda --model smollm2-135m --compile   # the decode compiled
    python benchmarks/host_overhead.py --device cuda --model smollm2-135m --overlap   # steps overlapped

On a GPU, forward is the launch of the step's CUDA graph and wait is the device's time: host work next to a
step's whole time shows whether the step is host-bound. Steps are read one at a time (the engine's overlap
off) unless --overlap: then a step launches the next before it reads its ids, the host's work runs while the
device computes (wait shrinks by as much), and step ms is what an overlapped step costs.

Target (issue 41): <= 10 us per sequence and <= 1 ms fixed, outside the forward. Writes
benchmarks/results/host_overhead-<device>[-compiled][-overlapped].{md,json}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import hardware, kernel_table  # noqa: E402
from benchmarks.decode import build_models  # noqa: E402
from models import LanguageConfig, VisionConfig, VisionLanguageModel, VLMConfig  # noqa: E402
from serving.config import ServingConfig  # noqa: E402
from serving.engine import Engine  # noqa: E402
from serving.requests import (
    Request,  # noqa: E402
    RequestParams,  # noqa: E402
)

PROMPT = 100
MAX_TOKENS = 1000
BLOCK_SIZE = 16
SETTINGS = {"greedy": RequestParams(greedy=True, max_tokens=MAX_TOKENS, ignore_eos=True),
            "sampled": RequestParams(temperature=0.8, top_k=50, top_p=0.9, max_tokens=MAX_TOKENS,
                                     ignore_eos=True)}
PHASES = ("schedule", "prepare", "forward", "sample", "wait", "bookkeeping")
HOST = ("schedule", "prepare", "bookkeeping")


def micro_model() -> VisionLanguageModel:
    """One layer of 32 dims and a 128-token vocabulary: the forward is a few hundred microseconds."""
    config = VLMConfig(
        vision=VisionConfig(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64, num_layers=1,
                            num_heads=4),
        language=LanguageConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=1,
                                num_heads=2, num_kv_heads=1, max_position_embeddings=2048, eos_token_id=2),
        image_token_id=127)
    return VisionLanguageModel(config).eval()


def timed(owner, name: str, totals: dict, key: str) -> None:
    """Wrap `owner.name` to add its time to totals[key]."""
    method = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        result = method(*args, **kwargs)
        totals[key] += time.perf_counter() - start
        return result

    setattr(owner, name, wrapper)


def measure(model, running: int, params: RequestParams, steps: int, kernels: list[str] | None = None,
            compile_decode: bool = False, overlap: bool = False) -> dict[str, float]:
    """Median over `steps` decode steps of each phase's time (ms), with `running` sequences decoding; the
    device's kernels appended to `kernels`, if given."""
    engine = Engine(model, config=ServingConfig(
        num_blocks=running * ((PROMPT + MAX_TOKENS) // BLOCK_SIZE + 2) + 1, block_size=BLOCK_SIZE,
        max_num_seqs=running, max_batch_tokens=max(2048, running), compile_decode=compile_decode,
        compile_prefill=False, overlap=overlap))  # decode steps alone are timed: no prefill compile
    for i in range(running):
        engine.add_request(Request([3 + (i * 7 + t) % 120 for t in range(PROMPT)], None, params))
    while engine.scheduler.waiting or not all(s.decoding for g in engine.scheduler.running for s in g.live):
        engine.step()
    totals: dict[str, float] = defaultdict(float)
    timed(engine.scheduler, "schedule", totals, "schedule")
    timed(engine.runner.inputs, "decode_inputs", totals, "prepare")
    timed(engine.runner, "forward", totals, "forward + prepare")
    timed(engine.runner, "sample", totals, "sample")
    timed(engine, "_read", totals, "read")  # the wait for the ids, then the bookkeeping of what they say
    timed(engine, "_update", totals, "update")
    samples = defaultdict(list)
    for _ in range(steps):
        totals.clear()
        start = time.perf_counter()
        engine.step()
        step = time.perf_counter() - start
        phases = {"schedule": totals["schedule"], "prepare": totals["prepare"],
                  "forward": totals["forward + prepare"] - totals["prepare"], "sample": totals["sample"],
                  "wait": totals["read"] - totals["update"]}
        phases["bookkeeping"] = step - sum(phases.values())
        extra = {"step": step, "host": sum(phases[p] for p in HOST),
                 "outside forward": step - phases["forward"]}
        for key, value in [*phases.items(), *extra.items()]:
            samples[key].append(1000 * value)
    if kernels is not None:
        kernels += ["", f"**{running} sequences decoding**", "",
                    *kernel_table(engine.step, 5, engine.runner.device)]
    return {key: statistics.median(values) for key, values in samples.items()}


def fit(xs: list[int], ys: list[float]) -> tuple[float, float]:
    """Least-squares line y = fixed + slope * x."""
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    return mean_y - slope * mean_x, slope


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--running", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model", choices=["micro", "smollm2-135m"], default="micro")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--compile", action="store_true", help="the engine's decode forward compiled")
    parser.add_argument("--overlap", action="store_true",
                        help="each step launched before the step before is read (the GPU engine's default)")
    parser.add_argument("--profile", action="store_true",
                        help="list the device kernels of greedy decode steps")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.model == "micro":
        model, shape = micro_model().to(device), "a micro model (1 layer, 32 dims)"
    else:  # random weights, bf16 on a GPU
        model = build_models(device, torch.bfloat16 if device.type == "cuda" else torch.float32)[1]
        shape = "SmolLM2-135M's shape"
    title = (f"Engine decode step on {shape}{', compiled' if args.compile else ''}"
             f"{', overlapped' if args.overlap else ''}, medians of {args.steps} "
             f"steps; {hardware(device)}; torch {torch.__version__}")
    lines = [f"**{title}**", "", "| requests | running | step ms | " + " | ".join(f"{p} ms" for p in PHASES)
             + " | host us / sequence |", "|---" * (len(PHASES) + 4) + "|"]
    results, kernels = {}, []
    for name, params in SETTINGS.items():
        watch = kernels if args.profile and name == "greedy" else None
        rows = [measure(model, running, params, args.steps, watch, args.compile, args.overlap)
                for running in args.running]
        results[name] = dict(zip(map(str, args.running), rows))
        for running, row in zip(args.running, rows):
            lines.append(
                f"| {name} | {running} | {row['step']:.2f} | "
                + " | ".join(f"{row[p]:.3f}" for p in PHASES)
                + f" | {1000 * row['host'] / running:.1f} |"
            )
        for part in ("host", "outside forward"):
            fixed, slope = fit(args.running, [row[part] for row in rows])
            results[name][f"{part} fit"] = {"fixed_ms": fixed, "per_sequence_us": 1000 * slope}
            lines.append(
                f"| {name} | {part} ({' + '.join(HOST) if part == 'host' else 'with sample'}): | "
                f"**{fixed:.3f} ms + {1000 * slope:.2f} us a sequence** |" + " |" * (len(PHASES) + 1)
            )
    args.out.mkdir(parents=True, exist_ok=True)
    lines += kernels
    stem = args.out / (f"host_overhead-{device.type}{'-compiled' if args.compile else ''}"
                       f"{'-overlapped' if args.overlap else ''}")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    stem.with_suffix(".json").write_text(json.dumps(dict(title=title, results=results), indent=2))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
