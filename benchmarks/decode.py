"""Decode speed, side by side in one run, on the same random weights (SmolLM2-135M shape), greedy.

    python benchmarks/decode.py       # CPU defaults: batch 1, 100-token prompt, 64 new tokens
    python benchmarks/decode.py --device cuda --batch-sizes 1 8 32 --new-tokens 256

Methods: tinyvlm fast path (compiled, shape-static decode step), tinyvlm eager, each also with fused q/k/v
and gate/up projections (`fuse_projections`), tinyvlm without cache, transformers `generate` with its
dynamic cache, transformers with a static cache + torch.compile. ms/step is
the decode step, measured as (time(N new tokens) - time(1 new token)) / (N - 1), so the prefill cancels;
tok/s = batch / step time; kernels/step the same difference of the kernels the profiler sees (on a CPU, the
operators that compute).
Also: time to first token for an image + 64-token prompt (nanovlm-222m shape), and cached vs uncached time
against the number of new tokens. Writes benchmarks/results/decode-<device>-<dtype>.{md,json,png}.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import platform
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import LanguageConfig, VisionConfig, VisionLanguageModel, VLMConfig  # noqa: E402

METHODS = ("tinyvlm fast", "tinyvlm fused fast", "tinyvlm eager", "tinyvlm fused eager", "tinyvlm no cache",
           "transformers dynamic", "transformers static+compile")
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
               rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def build_models(device: torch.device, dtype: torch.dtype):
    """transformers' Llama with random weights, and ours loaded from its saved checkpoint: the same
    weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    reference = LlamaForCausalLM(LlamaConfig(**SMOLLM2, eos_token_id=None, bos_token_id=None)).eval()
    with tempfile.TemporaryDirectory() as directory:
        reference.save_pretrained(directory)
        config = VLMConfig(vision=VisionConfig(image_size=32, patch_size=16, hidden_size=32,
                                               intermediate_size=64, num_layers=1, num_heads=2),
                           language=LanguageConfig(pretrained=directory))
        ours = VisionLanguageModel.from_backbones(config).eval()
    return reference.to(device, dtype), ours.to(device, dtype)


_FUSED: dict[int, VisionLanguageModel] = {}


def fused(ours: VisionLanguageModel) -> VisionLanguageModel:
    """One copy of `ours` with fused projections per model."""
    if id(ours) not in _FUSED:
        _FUSED[id(ours)] = copy.deepcopy(ours).fuse_projections()
    return _FUSED[id(ours)]


def make_runner(method: str, reference, ours):
    """A function (ids, new_tokens) -> generated ids [B, new_tokens] for one method."""
    if method.startswith("tinyvlm"):
        model = fused(ours) if "fused" in method else ours
        kind = method.split()[-1]  # fast, eager, or (no) cache
        settings = {"fast": dict(compile=True), "eager": {}, "cache": dict(use_cache=False)}[kind]
        return lambda ids, n: model.generate(ids, None, max_new_tokens=n, greedy=True, **settings)
    from transformers import CompileConfig

    settings = dict(do_sample=False, pad_token_id=0)
    if method == "transformers static+compile":
        cuda = ids_device(reference).type == "cuda"
        compile_config = CompileConfig(fullgraph=True, mode="reduce-overhead" if cuda else "default")
        # transformers compiles on CPU only when told (a class field)
        compile_config._compile_all_devices = not cuda
        settings.update(cache_implementation="static", compile_config=compile_config)
    return lambda ids, n: reference.generate(ids, max_new_tokens=n, min_new_tokens=n, **settings)[
        :, ids.shape[1] :
    ]


def ids_device(model) -> torch.device:
    return next(model.parameters()).device


def timed(run, ids, new_tokens: int, repeats: int, device: torch.device) -> tuple[float, torch.Tensor]:
    times, out = [], None
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        out = run(ids, new_tokens)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


# Metadata-only operators: no kernel runs for them on any device.
VIEWS = {"aten::" + name for name in (
    "view", "_unsafe_view", "as_strided", "alias", "t", "transpose", "expand", "narrow", "slice", "select",
    "split", "split_with_sizes", "unsqueeze", "squeeze", "permute", "reshape", "detach", "lift_fresh",
    "unbind", "chunk", "empty", "empty_strided", "resolve_conj", "resolve_neg", "_reshape_alias")}
# Operators that compute only through what they call (a copy when a cast or a layout needs one).
WRAPPERS = {"aten::to", "aten::contiguous", "aten::flatten", "aten::type_as"}


def kernels(run, ids, new_tokens: int, device: torch.device) -> Counter[str]:
    """Kernels one call of `run` launches, by name: on a GPU the profiler's device events (kernels, copies,
    sets; those inside CUDA graphs included); on a CPU, as a proxy for an eager run, the operators the model
    calls (not those they call in turn; views aside), each of which is at least one kernel on a GPU."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as profiler:
        run(ids, new_tokens)
        synchronize(device)
    events = profiler.events()
    if cuda:
        return Counter(event.name for event in events if event.device_type == torch.autograd.DeviceType.CUDA)

    def called_by_the_model(event) -> bool:
        parent = event.cpu_parent
        return not (parent and parent.name.startswith("aten::")) or parent.name in WRAPPERS

    return Counter(event.name for event in events if event.name.startswith("aten::")
                   and event.name not in VIEWS | WRAPPERS and called_by_the_model(event))


def kernels_per_step(run, ids, new_tokens: int, device: torch.device) -> dict[str, float]:
    """Each kernel's launches in one decode step: (launches(N new tokens) - launches(1)) / (N - 1), so the
    prefill cancels."""
    many, one = kernels(run, ids, new_tokens, device), kernels(run, ids, 1, device)
    return {name: (many[name] - one[name]) / (new_tokens - 1)
            for name in many | one if many[name] != one[name]}


@torch.inference_mode()
def decode_table(reference, ours, args, device) -> list[dict]:
    rows = []
    for batch in args.batch_sizes:
        ids = torch.randint(100, 49000, (batch, args.prompt_len),
                            generator=torch.Generator().manual_seed(batch)).to(device)
        baseline_tokens = None
        for method in args.methods:
            run = make_runner(method, reference, ours)
            # Warm up allocations; compiled methods compile per cache size, so they warm up at the timed
            # length.
            run(ids, args.new_tokens if "fast" in method or "compile" in method else args.warmup_tokens)
            full, tokens = timed(run, ids, args.new_tokens, args.repeats, device)
            first, _ = timed(run, ids, 1, args.repeats, device)
            step_ms = 1000 * (full - first) / (args.new_tokens - 1)
            baseline_tokens = tokens if baseline_tokens is None else baseline_tokens
            same = float((tokens == baseline_tokens).float().mean())
            # a compiled graph's kernels are not operators the profiler sees on a CPU
            compiled = "fast" in method or "compile" in method
            by_name = (None if compiled and device.type == "cpu"
                       else kernels_per_step(run, ids, args.new_tokens, device))
            kernels = None if by_name is None else sum(by_name.values())
            rows.append(dict(batch=batch, method=method, ms_per_step=step_ms,
                             tokens_per_s=1000 * batch / step_ms, total_s=full, kernels_per_step=kernels,
                             kernels_by_name=by_name, same_tokens_as_first_method=same))
            print(f"batch {batch:>3}  {method:<28} {step_ms:9.2f} ms/step {1000 * batch / step_ms:10.1f} "
                  f"tok/s  {kernels or 0:6.0f} kernels/step  same tokens: {same:.3f}", flush=True)
    for row in rows:
        base = next((r for r in rows if r["batch"] == row["batch"] and r["method"] == "transformers dynamic"),
                    None)
        row["speedup_vs_transformers_dynamic"] = base["ms_per_step"] / row["ms_per_step"] if base else None
    return rows


@torch.inference_mode()
def bandwidth_floor_ms(model, device: torch.device, repeats: int = 5) -> tuple[float, float]:
    """(GB/s this device reads at, ms to read `model`'s weights once at that rate): the floor for one batch-1
    decode step, which must read every weight. The rate is the best of a few full reads of a buffer of the
    weights' size."""
    weight_bytes = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    buffer = torch.ones(weight_bytes // 4, dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        buffer.sum()
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return weight_bytes / best / 1e9, 1000 * best


@torch.inference_mode()
def generate_first(model: VisionLanguageModel, image: Tensor, ids: Tensor, n: int, compile: bool) -> Tensor:
    return model.generate(ids, image, max_new_tokens=n, greedy=True, compile=compile)


def time_to_first_token(device: torch.device, dtype: torch.dtype, repeats: int) -> dict[str, float]:
    """Image (SigLIP-B/16-224) + 64-token prompt through the nanovlm-222m shape, to the first sampled token
    (ms): eager, and compiled (generate(compile=True)'s prefill, compiled beforehand)."""
    config = VLMConfig(vision=VisionConfig(), language=LanguageConfig(vocab_size=49216), image_token_id=49152)
    model = VisionLanguageModel(config).eval().to(device, dtype)
    ids = torch.randint(100, 49000, (1, 64 + config.tokens_per_image))
    ids[0, 1 : 1 + config.tokens_per_image] = config.image_token_id
    ids, image = ids.to(device), torch.randn(1, 3, 224, 224, device=device, dtype=dtype)
    result = {}
    for name, compile in (("eager", False), ("compiled", True)):
        run = functools.partial(generate_first, model, image, compile=compile)
        run(ids, 1)
        result[name] = 1000 * timed(run, ids, 1, repeats, device)[0]
        print(f"time to first token, {name}: {result[name]:.1f} ms", flush=True)
    return result


@torch.inference_mode()
def cache_curve(ours, args, device) -> list[dict]:
    """Cached vs uncached generation time against the number of new tokens (batch 1)."""
    ids = torch.randint(100, 49000, (1, args.prompt_len),
                        generator=torch.Generator().manual_seed(0)).to(device)
    points = []
    for n in args.curve_tokens:
        cached, _ = timed(make_runner("tinyvlm eager", None, ours), ids, n, 1, device)
        uncached, _ = timed(make_runner("tinyvlm no cache", None, ours), ids, n, 1, device)
        points.append(dict(new_tokens=n, cached_s=cached, uncached_s=uncached))
        print(f"{n:>5} new tokens: cached {cached:7.2f} s, uncached {uncached:7.2f} s "
              f"({uncached / cached:.1f}x)", flush=True)
    return points


def kernel_breakdown(rows: list[dict], layers: int, top: int = 25) -> list[str]:
    """The kernels of each compiled method's decode step, by name, at the smallest batch measured: where the
    launches of a launch-bound step go."""
    lines, smallest = [], min(row["batch"] for row in rows)
    for r in rows:
        compiled = "fast" in r["method"] or "compile" in r["method"]
        if not compiled or not r["kernels_by_name"] or r["batch"] != smallest:
            continue
        lines += ["", f"**Kernels a decode step, {r['method']}, batch {r['batch']}**", "",
                  "| launches a step | a layer | kernel |", "|---|---|---|"]
        ranked = sorted(r["kernels_by_name"].items(), key=lambda item: -item[1])
        lines += [f"| {count:.1f} | {count / layers:.2f} | {name[:100]} |" for name, count in ranked[:top]]
    return lines


def write_results(rows, ttft_ms: dict[str, float] | None, curve, floor, args, device, out: Path) -> None:
    hardware = (torch.cuda.get_device_name(device) if device.type == "cuda"
                else f"{platform.processor() or 'CPU'}, {torch.get_num_threads()} threads")
    title = (f"Decode, SmolLM2-135M shape, random weights, {args.dtype}, greedy, {args.prompt_len}-token "
             f"prompt, {args.new_tokens} new tokens; {hardware}; torch {torch.__version__}")
    lines = [f"**{title}**", "",
             "| batch | method | ms/step | tok/s | x transformers dynamic | kernels/step (a layer) "
             "| same tokens |",
             "|---|---|---|---|---|---|---|"]
    layers = SMOLLM2["num_hidden_layers"]
    for r in rows:
        ratio = f"{r['speedup_vs_transformers_dynamic']:.2f}" if r["speedup_vs_transformers_dynamic"] else "–"
        count = r["kernels_per_step"]
        kernels = "–" if count is None else f"{count:.0f} ({count / layers:.1f})"
        lines.append(f"| {r['batch']} | {r['method']} | {r['ms_per_step']:.2f} | {r['tokens_per_s']:.1f} | "
                     f"{ratio} | {kernels} | {r['same_tokens_as_first_method']:.3f} |")
    gb_per_s, floor_ms = floor
    lines += ["", f"Bandwidth floor, batch 1 (reading every weight once per step at the {gb_per_s:.1f} GB/s "
                  f"this device reads a buffer of the same size): {floor_ms:.2f} ms/step"]
    lines += kernel_breakdown(rows, layers)
    if ttft_ms is not None:
        lines += ["", f"Time to first token, image + 64-token prompt (nanovlm-222m shape): eager "
                      f"{ttft_ms['eager']:.1f} ms, compiled prefill {ttft_ms['compiled']:.1f} ms"]
    if curve:
        lines += ["", "| new tokens | cached s | uncached s | uncached / cached |", "|---|---|---|---|"]
        lines += [f"| {p['new_tokens']} | {p['cached_s']:.2f} | {p['uncached_s']:.2f} | "
                  f"{p['uncached_s'] / p['cached_s']:.1f} |" for p in curve]
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"decode-{device.type}-{args.dtype}"
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    stem.with_suffix(".json").write_text(
        json.dumps(
            dict(
                title=title,
                rows=rows,
                ttft_ms=ttft_ms,
                curve=curve,
                bandwidth_gb_per_s=gb_per_s,
                floor_ms_per_step=floor_ms,
            ),
            indent=2,
        )
    )
    plot(rows, curve, stem.with_suffix(".png"), title)
    print("\n".join(lines))


def plot(rows, curve, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for method in dict.fromkeys(r["method"] for r in rows):
        points = [(r["batch"], r["tokens_per_s"]) for r in rows if r["method"] == method]
        left.plot(*zip(*points), "o-", label=method)
    left.set(xlabel="batch size", ylabel="new tokens / s", xscale="log", yscale="log",
             title="decode throughput")
    left.legend(fontsize=8)
    if curve:
        right.plot([p["new_tokens"] for p in curve], [p["cached_s"] for p in curve], "o-", label="KV cache")
        right.plot([p["new_tokens"] for p in curve], [p["uncached_s"] for p in curve], "o-", label="no cache")
        right.set(xlabel="new tokens", ylabel="seconds", title="cached vs uncached generation")
        right.legend()
    figure.suptitle(title, fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--dtype", default="bfloat16" if cuda else "float32",
                        choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32] if cuda else [1])
    parser.add_argument("--prompt-len", type=int, default=100)
    parser.add_argument("--new-tokens", type=int, default=256 if cuda else 64)
    parser.add_argument("--warmup-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3 if cuda else 1)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--curve-tokens", type=int, nargs="*",
                        default=[16, 64, 256, 1000] if cuda else [8, 16, 32, 64])
    parser.add_argument("--no-ttft", action="store_true", help="skip the time-to-first-token measurement")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    reference, ours = build_models(device, dtype)
    rows = decode_table(reference, ours, args, device)
    floor = bandwidth_floor_ms(ours.language, device)
    ttft = None if args.no_ttft else time_to_first_token(device, dtype, args.repeats)
    curve = cache_curve(ours, args, device) if args.curve_tokens else []
    write_results(rows, ttft, curve, floor, args, device, args.out)


if __name__ == "__main__":
    main()
