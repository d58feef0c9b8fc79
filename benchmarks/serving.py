"""Serving throughput, side by side in one run on the same random weights (SmolLM2-135M shape), greedy, EOS ignored.

    python benchmarks/serving.py                                   # CPU: 64 requests, prompts and outputs 16-256
    python benchmarks/serving.py --requests 16 --max-len 64 --methods engine static   # a quick look
    python benchmarks/serving.py --device cuda --dtype bfloat16 --requests 1024

N requests all arrive at once, with prompt and output lengths drawn uniformly in [min-len, max-len]; a share of them
open with the same prefix (a shared system prompt), which the engine's prefix cache can reuse. Methods:
- engine: tinyvlm's serving engine (continuous batching, paged KV cache, prefix caching), gather + SDPA attention;
- engine-flex: the same with FlexAttention over the pool (compiled; its compile time is left out by a warm-up run);
- static: tinyvlm's `generate` on one left-padded batch of every request (the longest output sets the steps);
- hf-one: transformers `generate`, one request at a time; hf-batch: transformers `generate`, one padded batch;
- hf-cb: transformers' continuous batching `generate_batch` (transformers 5.x; one max_new_tokens for all, so it
  generates the longest output for every request: only each request's own tokens are counted).
Throughput counts each request's own output tokens. TTFT and inter-token latency come from per-token timestamps
(engine and static). KV waste is 1 - tokens held / slots reserved, averaged over the run's steps (engine) or at the end
(static: every row reserves prompt + longest output). Writes benchmarks/results/serving-<device>.{md,json,png}.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.decode import build_models, synchronize  # noqa: E402
from serving.engine import Engine, Request  # noqa: E402
from serving.sequence import RequestParams  # noqa: E402

METHODS = ("engine", "engine-flex", "static", "hf-one", "hf-batch", "hf-cb")


def workload(args) -> list[tuple[list[int], int]]:
    """(prompt ids, output length) per request; `shared` of them open with one 64-token prefix."""
    rng = random.Random(0)
    prefix = [rng.randrange(100, 49000) for _ in range(64)]
    requests = []
    for i in range(args.requests):
        length = rng.randint(args.min_len, args.max_len)
        prompt = [rng.randrange(100, 49000) for _ in range(length)]
        if i < args.shared * args.requests and length > len(prefix):
            prompt[: len(prefix)] = prefix
        requests.append((prompt, rng.randint(args.min_len, args.max_len)))
    return requests


def percentiles(values: list[float]) -> tuple[float, float]:
    if not values:
        return float("nan"), float("nan")
    ordered = sorted(values)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def run_engine(model, requests, args, device, attention: str = "gather") -> dict:
    if attention == "flex":  # compile the kernels of every query bucket first
        warm = Engine(model, num_blocks=args.kv_blocks, block_size=args.block_size, attention="flex",
                      max_num_seqs=args.max_num_seqs, max_batch_tokens=args.max_batch_tokens)
        warm.generate([Request(prompt, None, RequestParams(greedy=True, max_tokens=n, ignore_eos=True))
                       for prompt, n in requests])
    engine = Engine(model, num_blocks=args.kv_blocks, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                    max_batch_tokens=args.max_batch_tokens, attention=attention)
    for i, (prompt, out_len) in enumerate(requests):
        engine.add_request(Request(prompt, None, RequestParams(greedy=True, max_tokens=out_len, ignore_eos=True),
                                   request_id=str(i)))
    times: dict[str, list[float]] = {str(i): [] for i in range(len(requests))}
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(requests))}
    held = reserved = 0
    synchronize(device)
    start = time.perf_counter()
    while engine.has_unfinished():
        outputs = engine.step()
        synchronize(device)
        now = time.perf_counter() - start
        for output in outputs:
            times[output.request_id].append(now)
            tokens[output.request_id] += output.new_tokens[0]
        running = [s for g in engine.scheduler.running for s in g.live]
        held += sum(s.num_computed for s in running)
        reserved += sum(len(s.table) for s in running) * args.block_size
    wall = time.perf_counter() - start
    stats = engine.stats()
    return dict(wall=wall, times=list(times.values()), tokens=[tokens[str(i)] for i in range(len(requests))],
                kv_waste=1 - held / reserved if reserved else 0.0, preemptions=stats["preemptions"],
                prefix_hit_rate=stats["prefix_hit_rate"])


def left_pad(prompts: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    return ids.to(device), mask.to(device)


def run_static(model, requests, args, device) -> dict:
    ids, mask = left_pad([p for p, _ in requests], device)
    longest = max(n for _, n in requests)
    if args.compile_static:  # warm-up: compile the decode step at this batch and cache bucket
        list(model.stream(ids, None, mask, max_new_tokens=longest, greedy=True, compile=True))
    synchronize(device)
    start, stamps, rows = time.perf_counter(), [], []
    for token in model.stream(ids, None, mask, max_new_tokens=longest, greedy=True, compile=args.compile_static):
        rows.append(token)
        synchronize(device)
        stamps.append(time.perf_counter() - start)
    wall = time.perf_counter() - start
    out = torch.stack(rows, 1).tolist()
    slots = len(requests) * (ids.shape[1] + longest)
    return dict(wall=wall, times=[stamps[:n] for _, n in requests],
                tokens=[row[:n] for row, (_, n) in zip(out, requests)],
                kv_waste=1 - sum(len(p) + n for p, n in requests) / slots)


def run_hf_one(reference, requests, args, device) -> dict:
    start, tokens = time.perf_counter(), []
    for prompt, n in requests:
        ids = torch.tensor([prompt], device=device)
        out = reference.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        tokens.append(out[0, len(prompt):].tolist())
    synchronize(device)
    return dict(wall=time.perf_counter() - start, tokens=tokens)


def run_hf_batch(reference, requests, args, device) -> dict:
    ids, mask = left_pad([p for p, _ in requests], device)
    longest = max(n for _, n in requests)
    start = time.perf_counter()
    out = reference.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                             do_sample=False, pad_token_id=0)
    synchronize(device)
    rows = out[:, ids.shape[1]:].tolist()
    return dict(wall=time.perf_counter() - start, tokens=[row[:n] for row, (_, n) in zip(rows, requests)])


def run_hf_cb(reference, requests, args, device) -> dict:
    from transformers import GenerationConfig

    longest = max(n for _, n in requests)
    config = GenerationConfig(max_new_tokens=longest, do_sample=False, eos_token_id=None, pad_token_id=0)
    start = time.perf_counter()
    outputs = reference.generate_batch([p for p, _ in requests], generation_config=config)
    synchronize(device)
    wall = time.perf_counter() - start
    ordered = [outputs[key].generated_tokens for key in sorted(outputs, key=lambda k: int(k.rsplit("_", 1)[-1]))]
    return dict(wall=wall, tokens=[list(t)[:n] for t, (_, n) in zip(ordered, requests)])


RUNNERS = {"engine": run_engine, "engine-flex": lambda *args: run_engine(*args, attention="flex"),
           "static": run_static, "hf-one": run_hf_one, "hf-batch": run_hf_batch,
           "hf-cb": run_hf_cb}


def summarize(method: str, result: dict, requests, baseline_tokens) -> dict:
    output_tokens = sum(n for _, n in requests)
    row = dict(method=method, wall_s=result["wall"], requests_per_s=len(requests) / result["wall"],
               output_tokens_per_s=output_tokens / result["wall"])
    if "times" in result:
        row["ttft_p50_ms"], row["ttft_p99_ms"] = (1000 * v for v in percentiles([t[0] for t in result["times"] if t]))
        gaps = [b - a for t in result["times"] for a, b in zip(t, t[1:])]
        row["itl_p50_ms"], row["itl_p99_ms"] = (1000 * v for v in percentiles(gaps))
    for key in ("kv_waste", "preemptions", "prefix_hit_rate"):
        if key in result:
            row[key] = result[key]
    if baseline_tokens is not None:
        same = sum(a == b for a, b in zip(result["tokens"], baseline_tokens))
        row["same_tokens_as_engine"] = same / len(requests)
    return row


def write(rows: list[dict], args, device, title: str, out: Path) -> None:
    one = next((r for r in rows if r["method"] == "hf-one"), None)
    static = next((r for r in rows if r["method"] == "static"), None)
    lines = [f"**{title}**", "", "| method | req/s | out tok/s | x hf-one | x static | TTFT p50/p99 ms | "
             "ITL p50/p99 ms | KV waste | same tokens as engine |", "|---|---|---|---|---|---|---|---|---|"]

    def ratio(row, base):
        return f"{row['output_tokens_per_s'] / base['output_tokens_per_s']:.2f}x" if base else "–"

    for r in rows:
        ttft = f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f}" if "ttft_p50_ms" in r else "–"
        itl = f"{r['itl_p50_ms']:.0f} / {r['itl_p99_ms']:.0f}" if "itl_p50_ms" in r else "–"
        waste = f"{100 * r['kv_waste']:.1f}%" if "kv_waste" in r else "–"
        same = f"{r['same_tokens_as_engine']:.2f}" if "same_tokens_as_engine" in r else "–"
        lines.append(f"| {r['method']} | {r['requests_per_s']:.3f} | {r['output_tokens_per_s']:.1f} | "
                     f"{ratio(r, one)} | {ratio(r, static)} | {ttft} | {itl} | {waste} | {same} |")
    engine = next((r for r in rows if r["method"] == "engine"), None)
    if engine:
        lines += ["", f"Engine: {engine['preemptions']} preemptions, prefix-cache hit rate "
                      f"{100 * engine['prefix_hit_rate']:.0f}% of looked-up prompt blocks."]
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"serving-{device.type}"
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    stem.with_suffix(".json").write_text(json.dumps(dict(title=title, args=vars(args) | {"out": str(args.out)},
                                                         rows=rows), indent=2))
    plot(rows, stem.with_suffix(".png"), title)
    print("\n".join(lines))


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    axes.barh([r["method"] for r in rows], [r["output_tokens_per_s"] for r in rows])
    axes.set(xlabel="output tokens / s", title="serving throughput")
    figure.suptitle(title, fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--dtype", default="bfloat16" if cuda else "float32", choices=["float32", "bfloat16"])
    parser.add_argument("--requests", type=int, default=1024 if cuda else 64)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--shared", type=float, default=0.5, help="share of requests opening with a common prefix")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-blocks", type=int, default=4096)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-batch-tokens", type=int, default=512)
    parser.add_argument("--compile-static", action="store_true", help="static batch with the compiled decode step")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    reference, ours = build_models(device, dtype)
    requests = workload(args)
    hardware = (torch.cuda.get_device_name(device) if device.type == "cuda"
                else f"{platform.processor() or 'CPU'}, {torch.get_num_threads()} threads")
    title = (f"Serving {args.requests} requests, SmolLM2-135M shape, random weights, {args.dtype}, greedy, prompts and "
             f"outputs {args.min_len}-{args.max_len} tokens, {int(100 * args.shared)}% with a shared 64-token prefix; "
             f"{hardware}; torch {torch.__version__}")
    rows, baseline = [], None
    for method in args.methods:  # each method runs under its own no-grad / inference mode
        model = ours if not method.startswith("hf") else reference
        result = RUNNERS[method](model, requests, args, device)
        baseline = result["tokens"] if method == "engine" else baseline
        rows.append(summarize(method, result, requests, None if method == "engine" else baseline))
        print(f"{method}: {rows[-1]['wall_s']:.1f} s, {rows[-1]['output_tokens_per_s']:.1f} tok/s", flush=True)
    write(rows, args, device, title, args.out)


if __name__ == "__main__":
    main()
