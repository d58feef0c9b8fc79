"""Time to first token and peak memory for a question about a 64-frame clip: the clip's frames decoded, the
prompt built, the prefill run and the first token sampled, tinyvlm against transformers' SmolVLM2 on the same
random weights (a small SmolVLM2 built and saved with transformers, loaded into tinyvlm), one run each.

    python benchmarks/video.py                # CPU: a 70 s clip, 640 x 360 at 10 fps, sampled to 64 frames
    python benchmarks/video.py --device cuda

The model has SmolVLM2-256M's prompt for the clip (frames resized to 512 px, each then one square tile of 64
tokens, no splitting: 4,096 image tokens and SmolVLM2's timestamps) and a small body (256 px tiles, a 4-layer
ViT of width 192, a 4-layer LM of width 256), so that a run on a shared 2-core CPU takes minutes. Each side
runs in its own process: it loads the model, answers a 3 s clip once (imports and first-call costs out of the
timing), then the clip is timed: tinyvlm as `generate.py --video` answers (load_for_inference, data/video.py's
reader, which decodes only the sampled frames, the checkpoint's processor, `generate` for one token);
transformers as its model card says (`apply_chat_template` with the clip's path, `generate` for one token),
its frames read by its PyAV backend (its default, torchcodec, needs a system FFmpeg), which decodes each frame
up to the last sampled one and keeps the sampled ones. Peak memory is the process's resident-set high-water
mark (Linux VmHWM, reset through /proc/self/clear_refs after the warm-up) while the clip is answered, beside
its RSS before (model loaded).
Writes benchmarks/results/video-<device>.{md,json}.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import ROOT, hardware, write_result  # noqa: E402

QUESTION = "Which way does the red square move?"
SIDES = ("tinyvlm", "transformers")
SAMPLING = {"fps": 1, "max_frames": 64, "video_size": {"longest_edge": 512}}  # SmolVLM2's own
TILE = 256  # 16 px patches, pixel shuffle 2: 64 tokens a frame


def save_checkpoint(directory: Path) -> None:
    """A random SmolVLMForConditionalGeneration (SmolVLM2's input shape, a small body) with its processor
    (a byte-level BPE with SmolVLM's special tokens, SmolVLM2's video sampling)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        PreTrainedTokenizerFast,
        SmolVLMConfig,
        SmolVLMForConditionalGeneration,
        SmolVLMImageProcessor,
        SmolVLMProcessor,
        SmolVLMVideoProcessor,
    )

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<image>", "<fake_token_around_image>", "<global-img>",
               "<end_of_utterance>", "<video>"]
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator([f"User: You are provided the following series of sixty-four frames from a "
                             f"0:01:10 [H:MM:SS] video. Frame from 00:{s:02d}: {QUESTION} Assistant: left "
                             "to right" for s in range(60)], trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<end_of_utterance>",
                                        bos_token="<|im_start|>", pad_token="<|endoftext|>")
    torch.manual_seed(0)
    config = SmolVLMConfig(
        vision_config=dict(model_type="smolvlm_vision", hidden_size=192, intermediate_size=768,
                           num_hidden_layers=4, num_attention_heads=4, image_size=TILE, patch_size=16),
        text_config=dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=256,
                         intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2,
                         max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                         eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True),
        scale_factor=2, image_token_id=tokenizer.convert_tokens_to_ids("<image>"), tie_word_embeddings=True)
    model = SmolVLMForConditionalGeneration(config).eval()
    tile = {"longest_edge": TILE}
    processor = SmolVLMProcessor(
        SmolVLMImageProcessor(do_image_splitting=False, size=tile, max_image_size=tile), tokenizer,
        SmolVLMVideoProcessor(video_sampling=SAMPLING, max_image_size=tile), image_seq_len=64)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)


def write_clip(path: Path, seconds: int, rate: int = 10, size: tuple[int, int] = (640, 360)) -> Path:
    """An MPEG-4 clip (a keyframe a second) of a red square crossing a dark frame."""
    import av
    import numpy as np

    width, height = size
    count = seconds * rate
    with av.open(str(path), "w") as out:
        stream = out.add_stream("mpeg4", rate=rate)
        stream.width, stream.height, stream.pix_fmt, stream.gop_size = width, height, "yuv420p", rate
        for i in range(count):
            frame = np.full((height, width, 3), (20, 20, 60), np.uint8)
            x = i * (width - 40) // (count - 1)
            frame[160:200, x:x + 40] = (255, 0, 0)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return path


def _rss_mib(field: str) -> float:
    """A line of /proc/self/status (VmRSS: now, VmHWM: the high-water mark) in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def answerer(side: str, checkpoint: Path, device: torch.device):
    """A function answering QUESTION about a clip's path with one token: (first token, frames, prompt
    tokens, seconds reading and preparing the clip)."""
    if side == "tinyvlm":
        from data.video import read_video
        from loading import load_for_inference

        model, processor = load_for_inference(str(checkpoint), device)

        def answer(clip: Path):
            start = time.perf_counter()
            ids, pixels = processor.encode(QUESTION, [], read_video(clip, model.config.video))
            prepared = time.perf_counter() - start
            token = model.generate(torch.tensor([ids], device=device), pixels.to(device), max_new_tokens=1,
                                   greedy=True)
            return int(token[0, 0]), len(pixels), len(ids), prepared
        return answer

    from transformers import AutoProcessor, SmolVLMForConditionalGeneration
    from transformers.video_utils import load_video

    model = SmolVLMForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).to(device).eval()
    processor = AutoProcessor.from_pretrained(checkpoint)
    processor.video_processor.fetch_videos = lambda urls, sample_indices_fn=None: tuple(zip(*[
        load_video(url, backend="pyav", sample_indices_fn=sample_indices_fn) for url in urls]))

    def answer(clip: Path):
        start = time.perf_counter()
        inputs = processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "video", "path": str(clip)},
                                          {"type": "text", "text": QUESTION}]}],
            add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt").to(device)
        prepared = time.perf_counter() - start
        token = model.generate(**inputs, max_new_tokens=1, do_sample=False)
        return (int(token[0, -1]), inputs["pixel_values"].shape[1], inputs["input_ids"].shape[1], prepared)
    return answer


@torch.no_grad()
def measure(side: str, checkpoint: Path, clip: Path, warm_up: Path, device: torch.device) -> dict:
    """One side's answer to the clip, timed, after one to `warm_up`; its memory."""
    answer = answerer(side, checkpoint, device)
    answer(warm_up)
    gc.collect()
    before = _rss_mib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    token, frames, prompt, prepared = answer(clip)
    if device.type == "cuda":
        torch.cuda.synchronize()
    total = time.perf_counter() - start
    return {"side": side, "first_token": token, "frames": frames, "prompt_tokens": prompt,
            "prepare_s": prepared, "prefill_s": total - prepared, "ttft_s": total, "rss_before_mib": before,
            "peak_rss_mib": _rss_mib("VmHWM"),
            "peak_gpu_mib": torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None}


def cpu_name() -> str:
    return next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")), "CPU")


def load_average() -> str:
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seconds", type=int, default=70, help="the clip's length (1 frame a second)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # one side, in its own process
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.side:
        print(json.dumps(measure(args.side, args.work / "checkpoint", args.work / "clip.mp4",
                                 args.work / "warm-up.mp4", device)))
        return 0
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        save_checkpoint(work / "checkpoint")
        write_clip(work / "clip.mp4", args.seconds)
        write_clip(work / "warm-up.mp4", 3)
        load = [load_average()]
        rows = []
        for side in SIDES:
            done = subprocess.run([sys.executable, __file__, "--side", side, "--work", str(work), "--device",
                                   args.device], capture_output=True, text=True, cwd=ROOT)
            if done.returncode != 0:
                raise SystemExit(f"error: {side}: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            load.append(load_average())
    ours, theirs = rows
    threads = torch.get_num_threads()
    machine = hardware(device) if device.type == "cuda" else f"{cpu_name()}, {threads} threads"
    table = [f"# A question about a {ours['frames']}-frame clip: time to first token and peak memory "
             f"({device.type})",
             "",
             f"`python benchmarks/video.py{'' if args.device == 'cpu' else ' --device ' + args.device}`: "
             f"{machine}, torch {torch.__version__}; load average (1/5/15 min) before and after each side: "
             f"{' -> '.join(load)}. One run per side, each in its own process after a warm-up.",
             "",
             "| side | frames | prompt tokens | decode + prepare (s) | prefill + first token (s) | "
             "time to first token (s) | RSS before (MiB) | peak RSS (MiB) | peak - before (MiB) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        table.append(f"| {row['side']} | {row['frames']} | {row['prompt_tokens']} | {row['prepare_s']:.2f} | "
                     f"{row['prefill_s']:.2f} | {row['ttft_s']:.2f} | {row['rss_before_mib']:.0f} | "
                     f"{row['peak_rss_mib']:.0f} | {row['peak_rss_mib'] - row['rss_before_mib']:.0f} |")
    table += ["", f"- time to first token: tinyvlm / transformers = "
              f"{ours['ttft_s'] / theirs['ttft_s']:.2f}x; "
              f"peak over the loaded model: {(ours['peak_rss_mib'] - ours['rss_before_mib']):.0f} vs "
              f"{(theirs['peak_rss_mib'] - theirs['rss_before_mib']):.0f} MiB.",
              f"- the same first token on both sides: {ours['first_token'] == theirs['first_token']} "
              f"({ours['first_token']}, {theirs['first_token']})."]
    if device.type == "cuda":
        table.append(f"- peak GPU memory allocated: {ours['peak_gpu_mib']:.0f} vs "
                     f"{theirs['peak_gpu_mib']:.0f} MiB.")
    write_result(args.out, f"video-{device.type}", table,
                 {"machine": machine, "torch": torch.__version__, "load_average": load, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
