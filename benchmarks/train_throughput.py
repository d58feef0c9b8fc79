"""Training-step throughput: tokens/s, samples/s and model FLOPs utilisation (MFU) for a model shape.

    python benchmarks/train_throughput.py                                   # tiny default on CPU
    python benchmarks/train_throughput.py --shape nanovlm-222m --batch-size 64 --seq-len 128 --device cuda \\
        --compile
    python benchmarks/train_throughput.py --shape nanovlm-222m --device cuda --compile --profile
    # rows packing 4 samples each: SDPA under the dense mask, then FlexAttention
    python benchmarks/train_throughput.py --shape nanovlm-222m --device cuda --compile --packed 4 [--flex]

A step is forward + backward + AdamW on random data (random weights; the shape is what matters). MFU follows
nanoGPT's estimate_mfu: 6 FLOPs per parameter per token (or patch) for every matrix multiply, plus attention's
12 x layers x width x sequence per token, divided by the device's peak (--peak-tflops; known for
H100/H200/A100). Side by side, the loss from the whole [batch, seq, vocab] logits (`logits`) and with
train.chunked_loss (`chunked`: the head and the cross-entropy a chunk of positions at a time,
models/linear_cross_entropy.py), with what each keeps for the backward pass (saved tensors) and, on a GPU,
its peak memory.
--profile splits a step into its phases (forward + loss, backward, optimizer) and lists its kernels by time,
each with its kind (attention, matmul, loss, optimizer, norm, copies, elementwise) and the device's busy share
of the wall time (the rest: host gaps).
Writes benchmarks/results/train_throughput-<device>[-packed<n>[-flex]][-profile].{md,json}.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import hardware, kernel_table, seconds_per_call, write_result  # noqa: E402
from models import LanguageConfig, VisionConfig, VisionLanguageModel, VLMConfig  # noqa: E402
from training.config import load_run_config  # noqa: E402

PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}  # dense tensor-core peaks


def shape(name: str) -> VLMConfig:
    # SigLIP-B/16-224 + SmolLM2-135M, 49 image tokens (the pretrained sources need the hub)
    if name == "nanovlm-222m":
        return VLMConfig(vision=VisionConfig(), language=LanguageConfig(vocab_size=49216),
                         image_token_id=49152)
    config = load_run_config(name, {}).model
    return config.replace({"language.vocab_size": "512", "image_token_id": "511"})


def matmul_params(module: nn.Module) -> int:
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, (nn.Linear, nn.Conv2d)))


def flops_per_step(config: VLMConfig, model: VisionLanguageModel, batch: int, seq: int) -> float:
    """Training FLOPs (forward + backward) of one step, nanoGPT-style."""
    v, lang = config.vision, config.language
    lm = (6 * matmul_params(model.language) * batch * seq
          + 12 * lang.num_layers * lang.hidden_size * seq * batch * seq)
    patches = v.num_patches * batch
    vision = 6 * (matmul_params(model.vision)
                  + matmul_params(model.projector) * config.tokens_per_image / v.num_patches) * patches
    vision += 12 * v.num_layers * v.hidden_size * v.num_patches * patches
    return lm + vision


def peak_flops(device: torch.device, override: float | None) -> float | None:
    if override:
        return override * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return next((tflops * 1e12 for key, tflops in PEAK_BF16_TFLOPS.items() if key in name), None)
    return None


def parse_args() -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="configs/tiny.yaml", help="nanovlm-222m, or a YAML run config")
    parser.add_argument("--batch-size", type=int, default=64 if cuda else 32)
    parser.add_argument("--seq-len", type=int, default=128 if cuda else 64)
    parser.add_argument("--steps", type=int, default=20 if cuda else 5)
    parser.add_argument("--warmup", type=int, default=5 if cuda else 2)
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=cuda, help="bf16 autocast")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--losses", nargs="+", choices=["logits", "chunked"], default=["logits", "chunked"])
    parser.add_argument("--packed", type=int, default=0,
                        help="samples packed into each row (an attention mask of sequence numbers); 0: none")
    parser.add_argument("--flex", action="store_true",
                        help="packed rows attend through FlexAttention (train.flex_attention; CUDA)")
    parser.add_argument("--profile", action="store_true",
                        help="also split a step into forward + loss, backward and optimizer, and list its "
                             "kernels by time and kind (attention, matmul, loss, optimizer, ...)")
    parser.add_argument("--peak-tflops", type=float, help="device peak for MFU (known for H100/H200/A100)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    if args.flex and (not args.packed or args.device == "cpu"):
        parser.error("--flex needs --packed and a CUDA device (FlexAttention has no backward pass on a CPU)")
    return args


def training_step(config: VLMConfig, args: argparse.Namespace, device: torch.device, chunked: bool):
    """The model and one step (forward, backward, AdamW) on a fixed random batch with an image per row."""
    torch.manual_seed(0)
    model = VisionLanguageModel(config).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    forward = torch.compile(model) if args.compile else model
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if args.bf16 and device.type == "cuda"
                else contextlib.nullcontext())
    ids = torch.randint(0, config.language.vocab_size - 64, (args.batch_size, args.seq_len), device=device)
    ids[:, 1 : 1 + config.tokens_per_image] = config.image_token_id
    targets = ids.roll(-1, 1).masked_fill(ids.roll(-1, 1) == config.image_token_id, -100)
    images = torch.randn(args.batch_size, 3, config.vision.image_size, config.vision.image_size,
                         device=device)
    # --packed n: each row's positions split among n samples (numbered 1 .. n), as data/packing.py gives them
    mask = (torch.arange(args.seq_len, device=device) * args.packed // args.seq_len + 1).expand(
        args.batch_size, -1) if args.packed else None

    losses = []

    def forward_pass() -> None:
        with autocast:
            losses.append(forward(ids, images, mask, targets=targets, return_logits=False,
                                  chunked_loss=chunked, flex_attention=args.flex)[1])

    def backward_pass() -> None:
        losses.pop().backward()

    def optimizer_step() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    phases = {"forward + loss": forward_pass, "backward": backward_pass, "optimizer": optimizer_step}

    def step() -> None:
        for phase in phases.values():
            phase()

    return model, step, phases


def phase_times(phases: dict[str, Callable[[], None]], steps: int, device: torch.device) -> dict[str, float]:
    """Median ms of each phase of a step over `steps` steps: on a GPU the device's time between events
    recorded around it (what it ran, and any wait for the host to launch it), on a CPU the wall time."""
    times: dict[str, list[float]] = {name: [] for name in phases}
    for _ in range(steps):
        for name, phase in phases.items():
            if device.type == "cuda":
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                phase()
                end.record()
                end.synchronize()
                times[name].append(begin.elapsed_time(end))
            else:
                start = time.perf_counter()
                phase()
                times[name].append(1000 * (time.perf_counter() - start))
    return {name: statistics.median(values) for name, values in times.items()}


def kept_for_backward_mib(step: Callable[[], None]) -> float:
    """MiB of the tensors autograd keeps from the forward pass to the backward pass of one `step` (each
    counted once)."""
    kept = {}

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        kept[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        step()
    return sum(kept.values()) / 2**20


def measure(config: VLMConfig, args: argparse.Namespace, device: torch.device, loss: str) -> dict:
    """One loss variant's step: time, throughput, MFU, memory kept for the backward pass, GPU peak."""
    model, step, phases = training_step(config, args, device, chunked=loss == "chunked")
    started = time.perf_counter()
    seconds_per_call(step, args.warmup, device)
    print(f"{loss}: {args.warmup} warm-up steps (with compiling) took {time.perf_counter() - started:.0f} s",
          flush=True)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds = seconds_per_call(step, args.steps, device)
    flops = flops_per_step(config, model, args.batch_size, args.seq_len)
    peak = peak_flops(device, args.peak_tflops)
    profile = None
    if args.profile:
        profile = dict(phases_ms=phase_times(phases, args.steps, device),
                       kernels=kernel_table(step, min(args.steps, 3), device))
    return dict(loss=loss, profile=profile, params_m=sum(p.numel() for p in model.parameters()) / 1e6,
                ms_per_step=1000 * seconds, tokens_per_s=args.batch_size * args.seq_len / seconds,
                samples_per_s=args.batch_size / seconds, achieved_tflops=flops / seconds / 1e12,
                mfu=flops / seconds / peak if peak else None,
                kept_mib=None if args.compile else kept_for_backward_mib(step),  # compiled: one saved graph
                peak_mib=torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None)


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    config = shape(args.shape)
    rows = []
    for loss in args.losses:
        rows.append(measure(config, args, device, loss))
        print(f"{loss}: {rows[-1]['ms_per_step']:.1f} ms/step, {rows[-1]['tokens_per_s']:,.0f} tokens/s, "
              f"MFU {rows[-1]['mfu'] or 0:.1%}", flush=True)
    machine = hardware(device)
    packing = f"{args.packed} samples a row ({'FlexAttention' if args.flex else 'SDPA, dense mask'})"
    table = [f"{args.shape}, batch {args.batch_size} x {args.seq_len}, bf16 {args.bf16}, "
             f"compile {args.compile}, {packing if args.packed else 'unpacked'}, {machine}, "
             f"torch {torch.__version__}", "",
             "| loss | params | ms/step | tokens/s | samples/s | TFLOP/s | MFU | kept for backward | "
             "GPU peak |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        mfu = f"{100 * row['mfu']:.1f}%" if row["mfu"] else "– (--peak-tflops)"
        kept = "–" if row["kept_mib"] is None else f"{row['kept_mib']:,.0f} MiB"
        gpu = "–" if row["peak_mib"] is None else f"{row['peak_mib']:,.0f} MiB"
        table.append(f"| {row['loss']} | {row['params_m']:.1f}M | {row['ms_per_step']:.1f} | "
                     f"{row['tokens_per_s']:,.0f} | {row['samples_per_s']:,.1f} | "
                     f"{row['achieved_tflops']:.2f} | {mfu} | {kept} | {gpu} |")
    result = dict(shape=args.shape, batch=args.batch_size, seq_len=args.seq_len, bf16=args.bf16,
                  compile=args.compile, packed=args.packed, flex=args.flex, hardware=machine,
                  torch=torch.__version__, rows=rows)
    suffix = f"-packed{args.packed}{'-flex' if args.flex else ''}" if args.packed else ""
    for row in rows:
        if row["profile"] is not None:
            phases = row["profile"]["phases_ms"]
            table += ["", f"**{row['loss']} loss: a step's phases** (medians of {args.steps} steps; a step "
                          f"is {row['ms_per_step']:.1f} ms when not split):",
                      ", ".join(f"{name} {ms:.1f} ms" for name, ms in phases.items()), "",
                      *row["profile"]["kernels"]]
    write_result(args.out, f"train_throughput-{device.type}{suffix}{'-profile' if args.profile else ''}",
                 table, result)


if __name__ == "__main__":
    main()
