"""Answer a question about an image or a video clip, or caption it, streaming the answer as it is generated.

    python generate.py --image photo.png --prompt "What color is the circle?"  # newest run under runs/
    python generate.py --checkpoint runs/tiny --image photo.png                 # no prompt: a caption
    python generate.py --image photo.png --temperature 0.8 --top-k 50 --top-p 0.9 --num-samples 3
    python generate.py --image photo.png --compile                              # the fast decode path
    python generate.py --image photo.png --quantize int8                        # int8 weights (or int4)
    python generate.py --checkpoint HuggingFaceTB/SmolVLM-256M-Instruct --image cat.jpg --prompt "What is it?"
    python generate.py --checkpoint lusxvr/nanoVLM-460M-8k --image a.jpg --image b.jpg --prompt "Compare."
    python generate.py --batch requests.jsonl --output answers.jsonl   # many at once (serving engine)
    python generate.py --chat --image photo.png                        # a conversation in the terminal
    python generate.py --video clip.mp4 --prompt "Which way does the circle move?" --fps 2 --max-frames 16

--checkpoint takes tinyvlm's own checkpoints, SmolVLM / Idefics3 and nanoVLM ones, as directories or hub ids;
each is asked the way it was trained (its chat template, its image splitting). A --video is sampled as the
checkpoint's `video` settings say (SmolVLM2's: frames per second, at most max_frames; --fps and --max-frames
override them), each frame one image after its timestamp (data/video.py). Decoding is greedy unless a
sampling option (--temperature, --top-k, --top-p) is given. In batch mode each line of the input is {"image":
path, "prompt": text} (either may be left out: no image, or a caption) or {"messages": [{"role": "system" |
"user" | "assistant", "content": text, "images": [paths]}, ...]} (a conversation to answer); a line may
instead hold a "video" (a path; "fps" and "max_frames" override the checkpoint's sampling, as --fps and
--max-frames do), its frames opening the first user message; the output has the same lines, in the same
order, each with its "answer" added. In chat mode each line you type is a user
turn, answered as it is generated, and each turn reuses the earlier turns' KV blocks through the engine's
prefix cache (it says how many prompt tokens it reused): `/image PATH` attaches an image to your next turn,
`/video PATH` a clip to the conversation's first (before it starts, or after `/reset`), `/reset` starts a new
conversation (with the `--image` / `--video` files attached again), `/quit` (or Ctrl-D) ends.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from data import CAPTION_PROMPT, ImageLoadError, Message, load_image
from data.chat_processors import NO_IMAGES_BESIDE_A_VIDEO
from data.detokenizer import IncrementalDetokenizer
from data.video import Clip, VideoError, read_video, video_sampling
from loading import load_for_inference, pick_device
from models import GenerationError, TinyVLMError, kv_cache_bytes
from models.quantize import QUANTIZATIONS, weights_summary
from models.split_config import VideoConfig
from models.weights import atomic_write
from serving.config import ServingConfig
from serving.requests import RequestError, RequestParams
from typed_config import ConfigError


def check_prompt(prompt: str) -> str:
    if not prompt.strip():
        raise GenerationError("the prompt is empty (leave --prompt out to caption the image)")
    return prompt


def sampling_settings(args: argparse.Namespace) -> dict:
    """The sampling settings of the command line: greedy unless a sampling option is given."""
    sampling = [args.temperature, args.top_k, args.top_p]
    return dict(greedy=args.greedy or sampling == [None] * 3, top_k=args.top_k or 0,
                temperature=1.0 if args.temperature is None else args.temperature,
                top_p=1.0 if args.top_p is None else args.top_p)


def load(args: argparse.Namespace, device: torch.device):
    """The command line's model (fused, quantized as --quantize says) and processor."""
    return load_for_inference(args.checkpoint, device, args.allow_pickle, quantization=args.quantize,
                              quantize_vision=args.quantize_vision)


def read_clip(path: str, args: argparse.Namespace, model) -> Clip:
    """The clip at `path`, its frames sampled for `model` as the command line says; VideoError if
    unreadable."""
    return read_video(path, video_sampling(model.config.video, args.fps, args.max_frames))


def run(args: argparse.Namespace) -> None:
    device = pick_device(args.device)
    prompt = check_prompt(CAPTION_PROMPT if args.prompt is None else args.prompt)
    images = [load_image(path) for path in args.image or []]
    model, processor = load(args, device)
    tokenizer = processor.tokenizer
    video = None if args.video is None else read_clip(args.video, args, model)
    # the checkpoint's chat format; images split if it splits, a clip's frames one image each
    prompt_ids, pixels = processor.encode(prompt, images, video)
    ids = torch.tensor([prompt_ids], device=device)
    pixels = None if pixels is None else pixels.to(device)
    rows, tokens = args.num_samples, ids.shape[1] + args.max_new_tokens
    dtype = next(model.parameters()).dtype
    print(f"KV cache: {kv_cache_bytes(model.config.language, rows, tokens, dtype) / 2**20:.2f} MiB "
          f"({rows} x {tokens} tokens, {dtype}); weights: {weights_summary(model)}", file=sys.stderr)
    settings = dict(max_new_tokens=args.max_new_tokens, num_samples=args.num_samples,
                    **sampling_settings(args), eos_token_id=model.config.stop_ids,
                    pad_token_id=tokenizer.pad_token_id, compile=args.compile,
                    generator=torch.Generator(device).manual_seed(args.seed))
    if args.num_samples == 1:  # stream: print what each new token adds to the decoded text
        detokenizer = IncrementalDetokenizer(tokenizer)
        for token in model.stream(ids, pixels, **settings):
            if int(token) in model.config.stop_ids:
                break
            print(detokenizer.add([int(token)]), end="", flush=True)
        print(detokenizer.finish())
    else:
        for i, row in enumerate(model.generate(ids, pixels, **settings).tolist()):
            print(f"[{i + 1}] {tokenizer.decode(row, skip_special_tokens=True).strip()}")


def read_requests(path: Path) -> list[dict]:
    """The batch file's lines: JSON objects with an optional "image" or "video" (a path, relative to the file;
    a video's "fps" and "max_frames") and "prompt", or "messages"."""
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise RequestError(f"{path}: unreadable ({type(e).__name__})") from None
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise RequestError(f"{path}:{number}: not valid JSON ({e.msg})") from None
        if not isinstance(record, dict) or not all(
            isinstance(record.get(k, ""), str) for k in ("image", "prompt")
        ):
            raise RequestError(f"{path}:{number}: expected {{\"image\": path, \"prompt\": text}} with string "
                               f"values, or {{\"messages\": [...]}}")
        if "messages" in record and not _messages_ok(record["messages"]):
            raise RequestError(f'{path}:{number}: "messages" must be a list of '
                               '{"role": system|user|assistant, "content": text, "images": [paths] '
                               '(user messages)} ending with a user message')
        _check_video(record, f"{path}:{number}")
        records.append(record)
    return records


def _check_video(record: dict, where: str) -> None:
    """RequestError for a line's "video" that is not a path, has images beside it, or samples with values
    VideoConfig refuses, and for "fps" / "max_frames" without a video."""
    if "video" not in record:
        if {"fps", "max_frames"} & record.keys():
            raise RequestError(f'{where}: "fps" and "max_frames" sample a "video"')
        return
    if not isinstance(record["video"], str):
        raise RequestError(f'{where}: "video" must be a path')
    if "image" in record or any(message.get("images") for message in record.get("messages", [])):
        raise RequestError(f"{where}: {NO_IMAGES_BESIDE_A_VIDEO}")
    try:
        video_sampling(VideoConfig(), record.get("fps"), record.get("max_frames"))
    except ConfigError as e:
        raise RequestError(f"{where}: {e}") from None


def _messages_ok(messages) -> bool:
    def ok(message) -> bool:
        images = message.get("images", []) if isinstance(message, dict) else None
        return (isinstance(message, dict) and message.get("role") in ("system", "user", "assistant")
                and isinstance(message.get("content"), str) and isinstance(images, list)
                and all(isinstance(i, str) for i in images) and (not images or message["role"] == "user"))

    return (
        isinstance(messages, list)
        and bool(messages)
        and all(map(ok, messages))
        and messages[-1]["role"] == "user"
    )


def batch_prompt(record: dict, directory: Path) -> tuple[str | list[Message], list]:
    """A batch line's prompt (text or messages) and images, read; a missing clip is a VideoError here, before
    the model loads."""
    if "video" in record and not (directory / record["video"]).is_file():
        raise VideoError(f"{directory / record['video']}: no such file")
    if "messages" in record:
        return conversation(record, directory)
    image = load_image(directory / record["image"]) if "image" in record else None
    caption = image is not None or "video" in record
    return check_prompt(record.get("prompt", CAPTION_PROMPT if caption else "")), [image] if image else []


def batch_clip(record: dict, directory: Path, model) -> Clip | None:
    """A batch line's clip, sampled as the checkpoint's `video` settings and the line's "fps" / "max_frames"
    say."""
    if "video" not in record:
        return None
    sampling = video_sampling(model.config.video, record.get("fps"), record.get("max_frames"))
    return read_video(directory / record["video"], sampling)


def conversation(record: dict, directory: Path) -> tuple[list[Message], list]:
    """A batch line's messages and their images (paths relative to the batch file), in order."""
    messages, images = [], []
    for message in record["messages"]:
        paths = message.get("images", [])
        images += [load_image(directory / path) for path in paths]
        messages.append(Message(message["role"], message["content"], len(paths)))
    if paths and not messages[-1].text.strip():  # the last message: images alone ask for a caption
        messages[-1] = Message("user", CAPTION_PROMPT, len(paths))
    return messages, images


def run_batch(args: argparse.Namespace, params: RequestParams) -> None:
    """Answer every line of --batch with the serving engine (continuous batching over a paged KV cache); write
    the lines with their answers to --output, in input order, once all are answered (atomically). Images are
    read (and clips found) before the model loads; a clip is decoded when the engine takes its line."""
    from tqdm import tqdm

    from serving.engine import Engine
    from serving.requests import Request

    batch = Path(args.batch)
    records = read_requests(batch)
    prompts = [batch_prompt(record, batch.parent) for record in records]  # checked before any work starts
    model, processor = load(args, pick_device(args.device))
    engine = Engine(model, processor, ServingConfig(kv_cache_mib=args.kv_cache_mib))
    # each clip read as the engine takes its line: a few held at once, not the file's
    requests = (Request(prompt, images or None, params, video=batch_clip(record, batch.parent, model))
                for record, (prompt, images) in zip(records, prompts))
    with tqdm(total=len(records), desc="answers", file=sys.stderr, disable=not sys.stderr.isatty()) as bar:
        results = engine.generate(requests, progress=lambda done: bar.update(done - bar.n),
                                  max_pending=2 * engine.settings.max_num_seqs)
    answers = [{**record, **({"answer": result.texts[0]} if params.n == 1 else {"answers": result.texts})}
               for record, result in zip(records, results)]
    atomic_write(Path(args.output),
                 lambda tmp: tmp.write_text("".join(json.dumps(a) + "\n" for a in answers)))
    print(f"{len(answers)} answers written to {args.output}", file=sys.stderr)


def run_chat(args: argparse.Namespace, params: RequestParams) -> None:
    """A conversation in the terminal on the serving engine: each line a user turn, the answer streamed; the
    earlier turns' KV blocks are found in the prefix cache, not computed again."""
    from serving.engine import Engine
    from serving.requests import Request

    given = [load_image(path) for path in args.image or []]  # the command line's: for the first question
    pending = list(given)  # for the next turn
    model, processor = load(args, pick_device(args.device))
    given_video = None if args.video is None else read_clip(args.video, args, model)
    video = given_video  # the conversation's clip, in its first question
    engine = Engine(model, processor, ServingConfig(kv_cache_mib=args.kv_cache_mib))
    print(f"weights: {weights_summary(model)}", file=sys.stderr)
    history, images = [], []
    print("Type a question. /image PATH attaches an image to your next question, /video PATH a clip to the "
          "first, /reset starts over, /quit ends.",
          file=sys.stderr)
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            break
        if line in ("/quit", "/exit"):
            break
        if line == "/reset":  # the command line's images stay, for the new conversation's first question
            history, images, pending, video = [], [], list(given), given_video
            files = [*(args.image or []), *([args.video] if args.video else [])]
            attached = f"; {', '.join(files)} attached to your next question" if files else ""
            print(f"(a new conversation{attached})", file=sys.stderr)
        elif line == "/image" or line.startswith("/image "):
            try:
                pending.append(load_image(line.removeprefix("/image").strip()))
                print(f"(image {len(images) + len(pending)} attached to your next question)", file=sys.stderr)
            except ImageLoadError as e:
                print(f"error: {e}", file=sys.stderr)
        elif line == "/video" or line.startswith("/video "):
            if history:
                print("error: a clip opens a conversation: /reset, then /video PATH", file=sys.stderr)
                continue
            try:
                video = read_clip(line.removeprefix("/video").strip(), args, model)
                print(f"(a clip of {len(video.frames)} frames attached to your next question)",
                      file=sys.stderr)
            except VideoError as e:
                print(f"error: {e}", file=sys.stderr)
        elif line.startswith("/"):
            print(f"error: unknown command {line.split()[0]} (/image PATH, /video PATH, /reset, /quit)",
                  file=sys.stderr)
        elif line:
            messages = [*history, Message("user", line, len(pending))]
            answer = chat_turn(engine, Request(messages, [*images, *pending] or None, params, video=video))
            if answer is not None:
                history, images, pending = [*messages, Message("assistant", answer)], [*images, *pending], []


def chat_turn(engine, request) -> str | None:
    """One chat turn answered and printed, with how much of its prompt was reused; None (said why) for a
    request the engine refuses or an answer stopped with Ctrl-C, which leave the conversation as it was."""
    from serving.requests import RequestError

    try:
        answer, reused, prompt = answer_turn(engine, request)
    except RequestError as e:
        print(f"error: {e} (/reset starts a new conversation)", file=sys.stderr)
        return None
    except KeyboardInterrupt:  # Ctrl-C stops the answer, not the conversation
        for request_id in list(engine.groups):
            engine.abort(request_id)
        print("\n(answer stopped; ask again or go on)", file=sys.stderr)
        return None
    print(f"({reused} of the prompt's {prompt} tokens reused from the earlier turns)", file=sys.stderr)
    return answer


def answer_turn(engine, request) -> tuple[str, int, int]:
    """Serve one turn, printing the answer as it comes; returns it, with the prompt tokens found cached and
    all."""
    group = engine.prepare(request)
    engine.enqueue(group)
    detokenizer = IncrementalDetokenizer(engine.tokenizer)
    stops = set(engine.model.stop_ids)
    while engine.has_unfinished():
        for output in engine.step():
            print(detokenizer.add([token for token in output.new_tokens[0] if token not in stops]), end="",
                  flush=True)
    print(detokenizer.finish(), flush=True)
    return detokenizer.text, group.num_cached or 0, group.num_prompt


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint",
                        help="run or checkpoint directory, or a hub id of a SmolVLM / Idefics3 or "
                                             "nanoVLM model (default: the newest checkpoint under runs/)")
    parser.add_argument("--image", action="append", help="image file to ask about (repeat for several)")
    parser.add_argument("--video", help="video clip to ask about (mp4, webm, mkv, ...: what FFmpeg reads)")
    parser.add_argument("--fps", type=float,
                        help="with --video: frames sampled per second (default: the checkpoint's)")
    parser.add_argument("--max-frames", type=int,
                        help="with --video: the most frames sampled (default: the checkpoint's)")
    parser.add_argument("--batch",
                        help="a JSONL file of requests ({\"image\" or \"video\": path, \"prompt\": text} "
                             "per line)")
    parser.add_argument("--output", help="with --batch: the JSONL file to write the answers to")
    parser.add_argument("--chat", action="store_true", help="a conversation in the terminal (see above)")
    parser.add_argument("--kv-cache-mib", type=int, default=ServingConfig.kv_cache_mib,
                        help="with --batch or --chat: KV-cache memory (MiB)")
    parser.add_argument("--prompt", help=f"question (default: caption the image with {CAPTION_PROMPT!r})")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--greedy", action="store_true",
                        help="pick the most likely token (the default without sampling options)")
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--num-samples", type=int, default=1, help="answers per prompt, sharing one prefill")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto",
                        help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    parser.add_argument("--compile", action="store_true",
                        help="compiled, shape-static decode step (CUDA graphs on GPU)")
    parser.add_argument("--quantize", choices=QUANTIZATIONS,
                        help="the language model's linears weight-only in int8 or int4 (torchao): fewer "
                             "bytes read a decode step; int8-dynamic: int8 activations too (on a CPU, for "
                             "batches: the server)")
    parser.add_argument("--quantize-vision", action="store_true", help="with --quantize: the ViT's too")
    parser.add_argument("--allow-pickle", action="store_true",
                        help="accept pytorch_model.bin weights (read with torch.load(weights_only=True)); "
                             "only for files you trust")
    return parser


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line, its combinations checked (one-line error, exit 2) before any model loads."""
    cli = parser()
    args = cli.parse_args(argv)
    one_answer = args.image is not None or args.video is not None
    one_answer_or_batch = one_answer == (args.batch is None) and (args.batch is None) == (args.output is None)
    if args.chat and (args.batch or args.output or args.prompt is not None or args.num_samples != 1):
        cli.error("--chat takes no --batch, --output, --prompt or --num-samples (type your questions)")
    if not args.chat and not one_answer_or_batch:
        cli.error("give --image or --video (one answer), --batch and --output (a file of requests), "
                  "or --chat")
    if args.video is None and (args.fps, args.max_frames) != (None, None):
        cli.error("--fps and --max-frames sample a --video")
    try:  # checked before any model loads
        video_sampling(VideoConfig(), args.fps, args.max_frames)
    except ConfigError as e:
        cli.error(str(e))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        if args.chat:
            run_chat(args,
                     RequestParams(**sampling_settings(args), max_tokens=args.max_new_tokens, seed=args.seed))
        elif args.batch:
            run_batch(args, RequestParams(**sampling_settings(args), n=args.num_samples,
                                          max_tokens=args.max_new_tokens, seed=args.seed))
        else:
            run(args)
    except TinyVLMError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
