"""Serving throughput, side by side in one run on the same random weights (SmolLM2-135M shape), greedy, EOS
ignored.

    python benchmarks/serving.py                          # CPU: 64 requests, prompts and outputs 16-256
    python benchmarks/serving.py --workloads 16 --max-len 64 --methods engine static      # a quick look
    python benchmarks/serving.py --methods engine --quantize int8    # the engine on float32 and int8 weights
    python benchmarks/serving.py --methods engine engine-compiled --quantize int8 int8-dynamic
    python benchmarks/serving.py --device cuda --workloads 256 1024 nanovllm --max-num-seqs 256 \\
        --compile-static

Workloads (all requests arrive at once): a number N is N requests with prompt and output lengths drawn
uniformly in [min-len, max-len], a share of them opening with one 64-token prefix (a shared system prompt,
which the engine's prefix cache can reuse); "nanovllm" is nano-vllm's benchmark (256 requests, prompt and
output lengths 100-1,024, no shared
prefix). Methods:
- engine: tinyvlm's serving engine (continuous batching, paged KV cache, prefix caching; on a GPU the Triton
  paged attention kernel and a CUDA graph per batch bucket, captured when the engine starts, before the
  clock; on a CPU sparse decode attention in place and prepacked linears);
- engine-eager: the same without CUDA graphs (GPU only);
- engine-serial: the same with each step's sampled ids read before the next step is scheduled (no overlap; on
  a CPU, where the engine does not overlap, the same as engine);
- engine-compiled: the same with its decode forward (before the graphs' capture on a GPU) and its prompt
  chunks through torch.compile (compiled when the engine starts, before the clock; on a CPU gathered
  attention and unpacked linears, the compiled forward's);
- static: tinyvlm's `generate` on left-padded batches of up to max-num-seqs requests, one after the other (the
  longest output sets a batch's steps); --compile-static uses the compiled, CUDA-graph decode step (compiled
  first);
- hf-one: transformers `generate`, one request at a time (on the first --hf-one-requests requests, if given);
- hf-batch: transformers `generate` on left-padded batches of up to max-num-seqs requests;
- hf-cb: transformers' continuous batching `generate_batch` (one max_new_tokens for all, so it generates the
  longest output for every request: only each request's own tokens are counted), on the first --hf-cb-requests
  requests.
Throughput counts each request's own output tokens over the requests the method served. TTFT and inter-token
latency come from per-token timestamps (engine and static). KV waste is 1 - tokens held / slots reserved,
averaged over every 16th step of the run (engine) or at the end of each batch (static: every row reserves
prompt + longest output). Writes benchmarks/results/serving-<device>.{md,json,png}.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import hardware  # noqa: E402
from benchmarks.decode import build_models, synchronize  # noqa: E402
from benchmarks.quantize import quantized_pair  # noqa: E402
from models.quantize import QUANTIZATIONS  # noqa: E402
from serving.config import ServingConfig  # noqa: E402
from serving.engine import Engine  # noqa: E402
from serving.requests import (
    Request,  # noqa: E402
    RequestParams,  # noqa: E402
)

METHODS = ("engine", "engine-eager", "engine-serial", "engine-compiled", "static", "hf-one", "hf-batch",
           "hf-cb")
HF_METHODS = ("hf-one", "hf-batch", "hf-cb")
SLOW = (*HF_METHODS, "engine-eager")
PREFIX = 64
KV_EVERY = 16  # the engine's KV waste is averaged over every 16th step


def workload(name: str, args) -> list[tuple[list[int], int]]:
    """(prompt ids, output length) per request."""
    rng = random.Random(0)
    count, low, high, shared = (256, 100, 1024, 0.0) if name == "nanovllm" else (int(name), args.min_len,
                                                                                 args.max_len, args.shared)
    prefix = [rng.randrange(100, 49000) for _ in range(PREFIX)]
    requests = []
    for i in range(count):
        length = rng.randint(low, high)
        prompt = [rng.randrange(100, 49000) for _ in range(length)]
        if i < shared * count and length > PREFIX:
            prompt[:PREFIX] = prefix
        requests.append((prompt, rng.randint(low, high)))
    return requests


def describe(name: str, args) -> str:
    if name == "nanovllm":
        return "nano-vllm's workload: 256 requests, prompts and outputs 100-1,024 tokens"
    return (f"{name} requests, prompts and outputs {args.min_len}-{args.max_len} tokens, "
            f"{int(100 * args.shared)}% with a shared {PREFIX}-token prefix")


def percentiles(values: list[float]) -> tuple[float, float]:
    if not values:
        return float("nan"), float("nan")
    ordered = sorted(values)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def greedy(n: int) -> RequestParams:
    return RequestParams(greedy=True, max_tokens=n, ignore_eos=True)


def run_engine(model, requests, args, device, cuda_graphs: bool | None = None,
               compile_decode: bool = False, overlap: bool | None = None) -> dict:
    context = model.config.language.max_position_embeddings
    started = time.perf_counter()
    config = ServingConfig(num_blocks=args.kv_blocks, block_size=args.block_size,
                           max_num_seqs=args.max_num_seqs, max_batch_tokens=args.max_batch_tokens,
                           cuda_graphs=cuda_graphs, compile_decode=compile_decode, overlap=overlap)
    engine = Engine(model, config=config)
    print(f"engine start-up ({engine.settings.summary()}): {time.perf_counter() - started:.1f} s", flush=True)
    # warm-up on other prompts (kernels compiled, nothing shared with the workload's prefix)
    rng = random.Random(1)
    engine.generate([Request([rng.randrange(100, 49000) for _ in range(min(300, context - 20))], None,
                             greedy(8))
                     for _ in range(4)])
    for i, (prompt, out_len) in enumerate(requests):
        engine.add_request(Request(prompt, None, greedy(out_len), request_id=str(i)))
    hits, lookups = engine.blocks.hits, engine.blocks.lookups
    steps, read_first = engine.steps, engine.steps_read_first
    times: dict[str, list[float]] = {str(i): [] for i in range(len(requests))}
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(requests))}
    held = reserved = 0
    synchronize(device)
    start = time.perf_counter()
    for step in itertools.count():
        if not engine.has_unfinished():
            break
        outputs = engine.step()
        now = time.perf_counter() - start  # the step's sampled ids are on the host: its work is done
        for output in outputs:
            times[output.request_id].append(now)
            tokens[output.request_id] += output.new_tokens[0]
        if step % KV_EVERY == 0:  # a sample of the steps: the sums cost the host as much as a step's work
            running = [s for g in engine.scheduler.running for s in g.live]
            held += sum(s.num_computed for s in running)
            reserved += sum(len(s.table) for s in running) * args.block_size
    wall = time.perf_counter() - start
    lookups = engine.blocks.lookups - lookups
    steps, read_first = engine.steps - steps, engine.steps_read_first - read_first
    if engine.settings.overlap:  # how many steps could not overlap (a cache that might preempt)
        print(f"engine steps: {steps}, {read_first} of them read the step before first", flush=True)
    return dict(wall=wall, served=len(requests), times=list(times.values()), steps=steps,
                steps_read_first=read_first,
                tokens=[tokens[str(i)] for i in range(len(requests))],
                kv_waste=1 - held / reserved if reserved else 0.0, preemptions=engine.stats()["preemptions"],
                prefix_hit_rate=(engine.blocks.hits - hits) / lookups if lookups else 0.0)


def batches(requests, size: int):
    return [requests[i : i + size] for i in range(0, len(requests), size)]


def left_pad(prompts: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return ids.to(device), mask.to(device)


def run_static(model, requests, args, device) -> dict:
    groups = [(*left_pad([p for p, _ in group], device), max(n for _, n in group)) for group in batches(
        requests, args.max_num_seqs)]
    if args.compile_static:  # compile the decode step for every batch's shape first
        for ids, mask, longest in groups:
            list(model.stream(ids, None, mask, max_new_tokens=longest, greedy=True, compile=True))
    synchronize(device)
    start = time.perf_counter()
    times = []
    tokens = []
    held = 0
    reserved = 0
    for (ids, mask, longest), group in zip(groups, batches(requests, args.max_num_seqs)):
        stamps, rows = [], []
        for token in model.stream(ids, None, mask, max_new_tokens=longest, greedy=True,
                                  compile=args.compile_static):
            rows.append(token)
            synchronize(device)
            stamps.append(time.perf_counter() - start)
        out = torch.stack(rows, 1).tolist()
        times += [stamps[:n] for _, n in group]
        tokens += [row[:n] for row, (_, n) in zip(out, group)]
        held += sum(len(p) + n for p, n in group)
        reserved += len(group) * (ids.shape[1] + longest)
    return dict(wall=time.perf_counter() - start, served=len(requests), times=times, tokens=tokens,
                kv_waste=1 - held / reserved)


def run_hf_one(reference, requests, args, device) -> dict:
    requests = requests[: args.hf_one_requests]
    start, tokens = time.perf_counter(), []
    for prompt, n in requests:
        ids = torch.tensor([prompt], device=device)
        out = reference.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        tokens.append(out[0, len(prompt) :].tolist())
    synchronize(device)
    return dict(wall=time.perf_counter() - start, served=len(requests), tokens=tokens)


def run_hf_batch(reference, requests, args, device) -> dict:
    start, tokens = time.perf_counter(), []
    for group in batches(requests, args.max_num_seqs):
        ids, mask = left_pad([p for p, _ in group], device)
        longest = max(n for _, n in group)
        out = reference.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                                 do_sample=False, pad_token_id=0)
        tokens += [row[:n] for row, (_, n) in zip(out[:, ids.shape[1] :].tolist(), group)]
    synchronize(device)
    return dict(wall=time.perf_counter() - start, served=len(requests), tokens=tokens)


def run_hf_cb(reference, requests, args, device) -> dict:
    from transformers import GenerationConfig

    requests = requests[: args.hf_cb_requests]
    longest = max(n for _, n in requests)
    config = GenerationConfig(max_new_tokens=longest, do_sample=False, eos_token_id=None, pad_token_id=0)
    start = time.perf_counter()
    outputs = reference.generate_batch([p for p, _ in requests], generation_config=config)
    synchronize(device)
    wall = time.perf_counter() - start
    ordered = [
        outputs[key].generated_tokens for key in sorted(outputs, key=lambda k: int(k.rsplit("_", 1)[-1]))
    ]
    return dict(wall=wall, served=len(requests), tokens=[list(t)[:n] for t, (_, n) in zip(ordered, requests)])


RUNNERS = {"engine": run_engine, "engine-eager": lambda *args: run_engine(*args, cuda_graphs=False),
           "engine-serial": lambda *args: run_engine(*args, overlap=False),
           "engine-compiled": lambda *args: run_engine(*args, compile_decode=True),
           "static": run_static, "hf-one": run_hf_one, "hf-batch": run_hf_batch, "hf-cb": run_hf_cb}


def summarize(method: str, result: dict, requests, baseline_tokens) -> dict:
    served = requests[: result["served"]]
    output_tokens = sum(n for _, n in served)
    row = dict(method=method, requests=len(served), wall_s=result["wall"],
               output_tokens_per_s=output_tokens / result["wall"])
    if "times" in result:
        row["ttft_p50_ms"], row["ttft_p99_ms"] = (
            1000 * v for v in percentiles([t[0] for t in result["times"] if t])
        )
        gaps = [b - a for t in result["times"] for a, b in zip(t, t[1:])]
        row["itl_p50_ms"], row["itl_p99_ms"] = (1000 * v for v in percentiles(gaps))
    for key in ("kv_waste", "preemptions", "prefix_hit_rate", "steps", "steps_read_first"):
        if key in result:
            row[key] = result[key]
    if baseline_tokens is not None:
        same = sum(a == b for a, b in zip(result["tokens"], baseline_tokens))
        row["same_tokens_as_engine"] = same / len(served)
    return row


def table(rows: list[dict], title: str) -> list[str]:
    base = {m: next((r for r in rows if r["method"] == m), None) for m in ("hf-one", "static", "hf-cb")}
    lines = [f"**{title}**", "",
             "| method | requests | out tok/s | x hf-one | x static | x hf-cb | TTFT p50/p99 ms | "
             "ITL p50/p99 ms | KV waste | prefix hits | same tokens as engine |", "|---" * 11 + "|"]

    def ratio(row, name):
        return f"{row['output_tokens_per_s'] / base[name]['output_tokens_per_s']:.2f}x" if base[name] else "–"

    def pair(row, key, scale="{:.0f}"):
        if key + "_p50_ms" not in row:
            return "–"
        return f"{scale.format(row[key + '_p50_ms'])} / {scale.format(row[key + '_p99_ms'])}"

    for r in rows:
        waste = f"{100 * r['kv_waste']:.1f}%" if "kv_waste" in r else "–"
        hits = f"{100 * r['prefix_hit_rate']:.0f}%" if "prefix_hit_rate" in r else "–"
        same = f"{r['same_tokens_as_engine']:.2f}" if "same_tokens_as_engine" in r else "–"
        lines.append(f"| {r['method']} | {r['requests']} | {r['output_tokens_per_s']:,.1f} | "
                     f"{ratio(r, 'hf-one')} | {ratio(r, 'static')} | {ratio(r, 'hf-cb')} | {pair(r, 'ttft')} "
                     f"| {pair(r, 'itl', '{:.1f}')} | {waste} | {hits} | {same} |")
    return lines


def write(results: dict[str, list[dict]], failures: list[str], args, device, title: str) -> None:
    lines = [f"**{title}**"]
    for name, rows in results.items():
        if rows:
            lines += ["", *table(rows, describe(name, args))]
    lines += ["", *(f"- failed: {failure}" for failure in failures)] if failures else []
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / result_stem(args, device)
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    stem.with_suffix(".json").write_text(
        json.dumps(dict(title=title, args=vars(args) | {"out": str(args.out)}, results=results), indent=2)
    )
    plot(results, stem.with_suffix(".png"), title)

def result_stem(args, device: torch.device) -> str:
    return "-".join([f"serving-{device.type}", *args.quantize])


def plot(results: dict[str, list[dict]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{name}: {r['method']}" for name, rows in results.items() for r in rows]
    values = [r["output_tokens_per_s"] for rows in results.values() for r in rows]
    figure, axes = plt.subplots(figsize=(7, 1 + 0.3 * len(labels)))
    axes.barh(labels[::-1], values[::-1])
    axes.set(xlabel="output tokens / s", title="serving throughput")
    figure.suptitle(title, fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def parse_args() -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--dtype", default="bfloat16" if cuda else "float32", choices=["float32", "bfloat16"])
    parser.add_argument("--workloads", nargs="+", default=["64"], help="numbers of requests, or nanovllm")
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--shared", type=float, default=0.5,
                        help="share of requests opening with a common prefix")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-blocks", type=int, default=4096)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-batch-tokens", type=int, default=512)
    parser.add_argument("--compile-static", action="store_true",
                        help="static batches with the compiled decode step")
    parser.add_argument("--methods", nargs="+",
                        default=[m for m in METHODS if m not in ("engine-eager", "engine-serial")],
                        choices=METHODS)
    parser.add_argument("--baseline-workloads", nargs="+",
                        help="the workloads the slow baselines (transformers' methods, engine-eager) run on "
                             "(default: all)")
    parser.add_argument("--hf-one-requests", type=int,
                        help="hf-one serves this many of the requests (default: all)")
    parser.add_argument("--hf-cb-requests", type=int, help="hf-cb serves this many of them (default: all)")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--quantize", nargs="+", choices=QUANTIZATIONS, default=[],
                        help="each method also on copies quantized so (benchmarks/quantize.py's: ours fused, "
                             "transformers' with the same torchao config): rows 'METHOD int8', written to "
                             "serving-DEVICE-int8.* (serving-DEVICE-int8-int4.* for two)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    reference, ours = build_models(device, dtype)
    ours.fuse_projections()  # as load_for_inference gives it to generate.py and the server
    # each method on the float models, and with --quantize on quantized copies too ("engine int8")
    variants = {"": (reference, ours)}
    for method in args.quantize:
        variants[f" {method}"] = quantized_pair(reference, ours, method)[:2]
    title = (f"SmolLM2-135M shape, random weights, {args.dtype}, greedy, EOS ignored; engine: max_num_seqs "
             f"{args.max_num_seqs}, max_batch_tokens {args.max_batch_tokens}, {args.kv_blocks} blocks of "
             f"{args.block_size}; {hardware(device)}; torch {torch.__version__}")
    results: dict[str, list[dict]] = {}
    failures: list[str] = []
    for name in args.workloads:
        requests = workload(name, args)
        rows = results[name] = []
        baseline = None
        for method in args.methods:  # each method runs under its own no-grad / inference mode
            if method in SLOW and args.baseline_workloads is not None and name not in args.baseline_workloads:
                continue
            if method == "engine-eager" and device.type != "cuda":
                continue  # on a CPU the engine runs eagerly anyway
            for suffix, (theirs, mine) in variants.items():
                label = method + suffix
                try:
                    result = RUNNERS[method](theirs if method in HF_METHODS else mine, requests, args, device)
                except Exception as error:  # reported in the table; the other methods still run
                    traceback.print_exc()
                    failures.append(f"{name} {label}: {type(error).__name__}: {error}".splitlines()[0])
                    write(results, failures, args, device, title)
                    continue
                baseline = result["tokens"] if label == "engine" else baseline
                rows.append(summarize(label, result, requests, None if label == "engine" else baseline))
                print(f"{name} {label}: {rows[-1]['wall_s']:.1f} s, "
                      f"{rows[-1]['output_tokens_per_s']:,.1f} tok/s", flush=True)
                # after every method: a run cut short keeps what it measured
                write(results, failures, args, device, title)
    print((args.out / f"{result_stem(args, device)}.md").read_text())
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
