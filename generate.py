"""Answer a question about an image, or caption it, streaming the answer as it is generated.

    python generate.py --image photo.png --prompt "What color is the circle?"   # newest checkpoint under runs/
    python generate.py --checkpoint runs/tiny --image photo.png                 # no prompt: a caption
    python generate.py --image photo.png --temperature 0.8 --top-k 50 --top-p 0.9 --num-samples 3
    python generate.py --image photo.png --compile                              # the fast decode path

Decoding is greedy unless a sampling option (--temperature, --top-k, --top-p) is given.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from data import CAPTION_PROMPT, ImageProcessor, encode_prompt, load_image
from models import CheckpointError, GenerationError, TinyVLMError, VisionLanguageModel, kv_cache_bytes
from models.checkpoints import SHARDED, find_checkpoint, newest_checkpoint, pick_device

RUNS = Path("runs")


def load(checkpoint: Path | None, device: torch.device, allow_pickle: bool = False):
    """Model and tokenizer from a checkpoint directory (or the newest one under runs/)."""
    from transformers import AutoTokenizer

    if checkpoint is None:
        path = newest_checkpoint(RUNS)
        print(f"using the newest checkpoint: {path}", file=sys.stderr)
    else:
        path = find_checkpoint(checkpoint)
    if (path / SHARDED).is_dir() and not (path / "model.safetensors").is_file():
        raise CheckpointError(f"{path}: a sharded (FSDP2) checkpoint; export it first: "
                              f"python -m training.export {path}")
    model = VisionLanguageModel.from_pretrained(path, map_location=device, allow_pickle=allow_pickle).eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: no usable tokenizer ({type(e).__name__})") from None
    return model, tokenizer


def check_prompt(prompt: str) -> str:
    if not prompt.strip():
        raise GenerationError("the prompt is empty (leave --prompt out to caption the image)")
    return prompt


def run(args: argparse.Namespace) -> None:
    device = pick_device(args.device)
    prompt = check_prompt(CAPTION_PROMPT if args.prompt is None else args.prompt)
    image = load_image(args.image)
    model, tokenizer = load(args.checkpoint, device, args.allow_pickle)
    pixels = ImageProcessor.from_config(model.config.vision)(image)[None].to(device)
    ids = torch.tensor([encode_prompt(tokenizer, prompt, 1, model.config.tokens_per_image,
                                      model.config.image_position)], device=device)
    rows, tokens = args.num_samples, ids.shape[1] + args.max_new_tokens
    dtype = next(model.parameters()).dtype
    print(f"KV cache: {kv_cache_bytes(model.config.language, rows, tokens, dtype) / 2**20:.2f} MiB "
          f"({rows} x {tokens} tokens, {dtype})", file=sys.stderr)
    sampling = [args.temperature, args.top_k, args.top_p]
    settings = dict(max_new_tokens=args.max_new_tokens, greedy=args.greedy or sampling == [None] * 3,
                    temperature=1.0 if args.temperature is None else args.temperature, top_k=args.top_k or 0,
                    top_p=1.0 if args.top_p is None else args.top_p, num_samples=args.num_samples,
                    eos_token_id=model.config.stop_ids, pad_token_id=tokenizer.pad_token_id,
                    compile=args.compile, generator=torch.Generator(device).manual_seed(args.seed))
    if args.num_samples == 1:  # stream: print what each new token adds to the decoded text
        generated, shown = [], ""
        for token in model.stream(ids, pixels, **settings):
            if int(token) in model.config.stop_ids:
                break
            generated.append(int(token))
            text = tokenizer.decode(generated, skip_special_tokens=True)
            print(text[len(shown):], end="", flush=True)
            shown = text
        print()
    else:
        for i, row in enumerate(model.generate(ids, pixels, **settings).tolist()):
            print(f"[{i + 1}] {tokenizer.decode(row, skip_special_tokens=True).strip()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, help="run or checkpoint directory (default: newest under runs/)")
    parser.add_argument("--image", required=True, help="image file to ask about")
    parser.add_argument("--prompt", help=f"question (default: caption the image with {CAPTION_PROMPT!r})")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--greedy", action="store_true",
                        help="pick the most likely token (the default without sampling options)")
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--num-samples", type=int, default=1, help="answers per prompt, sharing one prefill")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    parser.add_argument("--compile", action="store_true",
                        help="compiled, shape-static decode step (CUDA graphs on GPU)")
    parser.add_argument("--allow-pickle", action="store_true",
                        help="accept pytorch_model.bin weights (read with torch.load(weights_only=True)); "
                             "only for files you trust")
    args = parser.parse_args(argv)
    try:
        run(args)
    except TinyVLMError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
