"""generate.py's normal output against the model it loads: streamed text, captions, samples, compile, stop
tokens."""

import json
import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import PreTrainedTokenizerFast

import generate
from data import CAPTION_PROMPT, IM_END, IMAGE_TOKEN, ImageProcessor, Message, encode_prompt, stop_token_ids
from data.prompts import encode_text
from data.tokenizer import token_id
from loading import load_for_inference
from models import VisionLanguageModel
from models.quantize import quantize
from tests.models import helpers
from tests.models.helpers import INT8_DYNAMIC, tiny_vlm_config


@pytest.fixture(scope="module")
def base_tokenizer():
    return helpers.base_tokenizer()


def _config(tokenizer, **language):
    config = tiny_vlm_config(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                             max_position_embeddings=512, **language)
    return config.replace({"image_token_id": token_id(tokenizer, IMAGE_TOKEN),
                           "stop_token_ids": stop_token_ids(tokenizer)})


def _save(model, tokenizer, directory):
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    path = tmp_path_factory.mktemp("image") / "photo.png"
    Image.new("RGB", (40, 30), "skyblue").save(path)
    return path


@pytest.fixture(scope="module")
def random_checkpoint(tmp_path_factory, base_tokenizer):
    return _save(helpers.chat_vlm(base_tokenizer), base_tokenizer, tmp_path_factory.mktemp("random"))


def _run(capsys, *argv) -> tuple[int, str, str]:
    code = generate.main([*map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def _expected(directory, image, prompt, quantization: str | None = None, **settings) -> list[str]:
    """What the checkpoint's model (fused and quantized with `quantization`) answers, decoded: the reference
    the CLI's output is checked against."""
    model = VisionLanguageModel.from_pretrained(directory).eval()
    if quantization is not None:
        quantize(model.fuse_projections(), quantization)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(directory)
    ids = torch.tensor([encode_prompt(tokenizer, prompt, 1, model.config.tokens_per_image)])
    pixels = ImageProcessor.from_config(model.config.vision)(Image.open(image))[None]
    tokens = model.generate(ids, pixels, eos_token_id=model.config.stop_ids,
                            pad_token_id=tokenizer.pad_token_id, **settings)
    return [tokenizer.decode(row, skip_special_tokens=True).strip() for row in tokens.tolist()]


@pytest.mark.parametrize("prompt", ["what colour is the sky?", None, "<|image|> " * 20])
def test_streamed_answer_equals_the_models_greedy_answer(random_checkpoint, image, capsys, prompt):
    """Streaming prints what the model generates (the default with no prompt is a caption; typed placeholders
    are text, so the answer is the one for that text, not an image splice error)."""
    argv = ["--checkpoint", random_checkpoint, "--image", image, "--max-new-tokens", 12]
    code, out, err = _run(capsys, *argv, *(["--prompt", prompt] if prompt else []))
    expected = _expected(random_checkpoint, image, prompt or CAPTION_PROMPT, max_new_tokens=12, greedy=True)
    assert code == 0, err
    assert out.strip() == expected[0] and expected[0]


def test_num_samples_prints_each_sample_from_one_prefill(random_checkpoint, image, capsys, monkeypatch):
    prefills = []
    embed = VisionLanguageModel.embed
    monkeypatch.setattr(VisionLanguageModel, "embed",
                        lambda self, *args: prefills.append(1) or embed(self, *args))
    code, out, err = _run(capsys, "--checkpoint", random_checkpoint, "--image", image, "--prompt", "the sky",
                          "--num-samples", 3, "--temperature", 1.5, "--seed", 7, "--max-new-tokens", 10)
    assert code == 0, err and len(prefills) == 1
    monkeypatch.undo()
    expected = _expected(random_checkpoint, image, "the sky", max_new_tokens=10, temperature=1.5,
                         num_samples=3, generator=torch.Generator().manual_seed(7))
    assert out.strip().splitlines() == [f"[{i + 1}] {text}" for i, text in enumerate(expected)]
    assert len(set(expected)) > 1  # the samples differ, so each row is printed from its own tokens


@pytest.mark.parametrize("method", ["int8", "int4", INT8_DYNAMIC])
def test_quantize_answers_with_the_quantized_models_greedy_answer_and_says_so(random_checkpoint, image,
                                                                              capsys, method):
    pytest.importorskip("torchao")
    code, out, err = _run(capsys, "--checkpoint", random_checkpoint, "--image", image, "--prompt", "the sky",
                          "--max-new-tokens", 12, "--quantize", method)
    expected = _expected(random_checkpoint, image, "the sky", method, max_new_tokens=12, greedy=True)
    assert code == 0, err
    assert out.strip() == expected[0] and expected[0]
    assert re.search(rf"weights: [\d.]+ MiB \(language {method}; [\d.]+ MiB in float32\)$", err.strip()), err


@pytest.mark.parametrize("method", ["int8", "int4", INT8_DYNAMIC])
def test_a_checkpoint_saved_quantized_answers_as_the_float_one_quantized_at_load(random_checkpoint, image,
                                                                                 capsys, tmp_path, method):
    """save_pretrained of a quantized model, then generate.py --checkpoint on it (no --quantize): the answer
    of the float checkpoint quantized at load, and the weights line says it is quantized."""
    pytest.importorskip("torchao")
    model, processor = load_for_inference(random_checkpoint, torch.device("cpu"), quantization=method)
    _save(model, processor.tokenizer, tmp_path)
    code, out, err = _run(capsys, "--checkpoint", tmp_path, "--image", image, "--prompt", "the sky",
                          "--max-new-tokens", 12)
    assert code == 0, err
    assert out.strip() == _expected(random_checkpoint, image, "the sky", method, max_new_tokens=12,
                                    greedy=True)[0]
    assert f" (language {method}; " in err


def test_an_unknown_quantization_is_refused_before_loading(capsys):
    with pytest.raises(SystemExit) as exit:
        generate.main(["--image", "x.png", "--quantize", "int3"])
    assert exit.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after argparse's usage lines; quotes by version
    assert re.fullmatch(r"\S+: error: argument --quantize: invalid choice: 'int3' "
                        r"\(choose from '?int8'?, '?int4'?, '?int8-dynamic'?\)", last), last


@pytest.mark.slow
def test_compile_prints_the_same_greedy_answer(random_checkpoint, image, capsys):
    argv = ["--checkpoint", random_checkpoint, "--image", image, "--prompt", "blue", "--max-new-tokens", 12]
    plain, compiled = _run(capsys, *argv), _run(capsys, *argv, "--compile")
    assert plain[0] == compiled[0] == 0 and compiled[1] == plain[1] and plain[1].strip()


def successor_model(tokenizer, successor: dict[int, int], default: int) -> VisionLanguageModel:
    """A VLM whose next token depends only on the current one: `successor[t]`, else `default`. One-hot
    embeddings, blocks whose output projections are zero (each block passes its input through), and a head
    that maps each one-hot to its successor, so what greedy decoding says is known in advance."""
    vocab = len(tokenizer)
    hidden = -(-vocab // 8) * 8
    model = VisionLanguageModel(_config(tokenizer, hidden_size=hidden, num_heads=4, num_kv_heads=2,
                                        num_layers=1, tie_word_embeddings=False))
    with torch.no_grad():
        model.language.token_embedding.weight.copy_(torch.eye(vocab, hidden))
        for block in model.language.blocks:
            block.attn.o_proj.weight.zero_()
            block.mlp.down_proj.weight.zero_()
        head = torch.zeros(vocab, hidden)
        head[default, :vocab] = 0.5
        for token, following in successor.items():
            head[following, token] = 1.0
        model.language.head.weight.copy_(head)
    return model.eval()


def test_answers_stop_at_the_end_of_turn_when_the_eos_is_another_token(
    base_tokenizer, image, capsys, tmp_path
):
    """Regression: training ends answers with <|im_end|>, but generate.py stopped only at the tokenizer's EOS;
    with a base tokenizer (EOS `</s>`) every answer ran on to max_new_tokens."""
    prompt = encode_prompt(base_tokenizer, "what colour is the sky?", 1, tiny_vlm_config().tokens_per_image)
    answer, after = encode_text(base_tokenizer, "blue"), encode_text(base_tokenizer, " the sky")
    chain = [prompt[-1], *answer, token_id(base_tokenizer, IM_END), *after]
    assert len(set(chain)) == len(chain)
    model = successor_model(base_tokenizer, dict(zip(chain, chain[1:])), default=after[-1])
    checkpoint = _save(model, base_tokenizer, tmp_path / "chain")
    code, out, err = _run(
        capsys, "--checkpoint", checkpoint, "--image", image, "--prompt", "what colour is the sky?"
    )
    assert code == 0, err
    assert out.strip() == "blue"


def test_a_missing_checkpoint_is_reported_for_a_readable_image(image, capsys, tmp_path, monkeypatch):
    code, _, err = _run(capsys, "--checkpoint", tmp_path / "nowhere", "--image", image)
    last = err.strip().splitlines()[-1]
    assert code == 2 and last.startswith(f"error: {tmp_path / 'nowhere'}: no such file or directory")
    monkeypatch.chdir(tmp_path)
    code, _, err = _run(capsys, "--image", image)
    assert code == 2 and err.strip().splitlines()[-1].startswith("error: no checkpoint under runs/")


def test_batch_mode_answers_every_line_in_order(random_checkpoint, image, tmp_path, capsys):
    """--batch runs the serving engine: each line's answer equals the model's greedy answer to it alone."""
    batch = tmp_path / "requests.jsonl"
    lines = [{"image": str(image), "prompt": "what colour is the sky?"}, {"image": str(image)},
             {"image": str(image), "prompt": "the sky", "id": 7}]
    batch.write_text("".join(json.dumps(line) + "\n" for line in lines))
    output = tmp_path / "answers.jsonl"
    code, _, err = _run(capsys, "--checkpoint", random_checkpoint, "--batch", batch, "--output", output,
                        "--max-new-tokens", 10)
    assert code == 0, err
    answers = [json.loads(line) for line in output.read_text().splitlines()]
    assert [{k: v for k, v in a.items() if k != "answer"} for a in answers] == lines
    for line, answer in zip(lines, answers):
        expected = _expected(random_checkpoint, image, line.get("prompt", CAPTION_PROMPT), max_new_tokens=10,
                             greedy=True)
        assert answer["answer"] == expected[0]


def _conversation_answer(directory, messages: list[Message], images: list, max_new_tokens: int,
                         video=None) -> str:
    """The model's greedy answer to a conversation (or a clip, data/video.py) as its processor renders it."""
    model, processor = load_for_inference(directory, torch.device("cpu"))
    ids, pixels = processor.encode_chat(messages, images, video)
    row = model.generate(torch.tensor([ids]), pixels, max_new_tokens=max_new_tokens, greedy=True)[0].tolist()
    stops = [i for i, token in enumerate(row) if token in model.config.stop_ids]
    return processor.tokenizer.decode(row[: stops[0]] if stops else row, skip_special_tokens=True)


def test_batch_lines_may_be_conversations(random_checkpoint, image, tmp_path, capsys):
    batch = tmp_path / "requests.jsonl"
    messages = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": "what colour is it?", "images": [str(image)]},
                {"role": "assistant", "content": "blue"}, {"role": "user", "content": "and the sea?"}]
    batch.write_text(
        json.dumps({"messages": messages}) + "\n" + json.dumps({"messages": messages[:2]}) + "\n"
    )
    output = tmp_path / "answers.jsonl"
    code, _, err = _run(capsys, "--checkpoint", random_checkpoint, "--batch", batch, "--output", output,
                        "--max-new-tokens", 10)
    assert code == 0, err
    answers = [json.loads(line)["answer"] for line in output.read_text().splitlines()]
    rendered = [Message("system", "Answer briefly."), Message("user", "what colour is it?", 1),
                Message("assistant", "blue"), Message("user", "and the sea?")]
    pixels = [Image.open(image)]
    assert answers == [_conversation_answer(random_checkpoint, rendered, pixels, 10).strip(),
                       _conversation_answer(random_checkpoint, rendered[:2], pixels, 10).strip()]


def _chat(checkpoint, arguments: list[str], lines: list[str]) -> list[str]:
    """generate.py --chat driven through a pseudo-terminal: what it printed after each of `lines` (up to its
    next prompt); it must then end with /quit, exit code 0."""
    master, terminal = pty.openpty()
    process = subprocess.Popen([sys.executable, "generate.py", "--chat", "--checkpoint", str(checkpoint),
                                "--max-new-tokens", "8", "--kv-cache-mib", "16", *arguments],
                               stdin=terminal, stdout=terminal, stderr=terminal,
                               cwd=Path(generate.__file__).parent, close_fds=True)
    os.close(terminal)
    screen = b""

    def until_prompt() -> str:
        nonlocal screen
        deadline, start = time.monotonic() + 120, len(screen)
        while not screen[start:].rstrip().endswith(b">"):
            assert time.monotonic() < deadline and process.poll() is None, screen.decode(errors="replace")
            if select.select([master], [], [], 1)[0]:
                screen += os.read(master, 4096)
        return screen[start:].decode().replace("\r\n", "\n")

    try:
        until_prompt()
        replies = []
        for line in lines:
            os.write(master, f"{line}\n".encode())
            replies.append(until_prompt())
        os.write(master, b"/quit\n")
        assert process.wait(timeout=30) == 0
    finally:
        process.kill()
        os.close(master)
    return replies


def test_chat_in_a_terminal_answers_each_turn_and_reuses_the_earlier_ones(random_checkpoint, image):
    """An image, then two questions; each answer is the model's to the conversation so far, and the second
    turn found the first one's tokens in the prefix cache."""
    attached, *replies = _chat(random_checkpoint, [],
                               [f"/image {image}", "what colour is it?", "and the sky?"])
    assert "attached" in attached
    first = _conversation_answer(random_checkpoint, [Message("user", "what colour is it?", 1)],
                                 [Image.open(image)], 8)
    second = _conversation_answer(
        random_checkpoint,
        [
            Message("user", "what colour is it?", 1),
            Message("assistant", first),
            Message("user", "and the sky?"),
        ],
        [Image.open(image)],
        8,
    )
    assert first.strip() and second.strip()
    assert first.strip() in replies[0] and second.strip() in replies[1]
    reused = [re.search(r"\((\d+) of the prompt's (\d+) tokens reused", reply).groups() for reply in replies]
    assert int(reused[0][0]) == 0 and int(reused[1][0]) > 0


def test_chat_reset_keeps_the_command_lines_image_and_says_so(random_checkpoint, image):
    """Regression: /reset dropped the --image without a word, so the same question after it was answered
    about no image."""
    question = "what colour is it?"
    first, reset, again = _chat(random_checkpoint, ["--image", str(image)], [question, "/reset", question])
    assert f"(a new conversation; {image} attached to your next question)" in reset
    answer = _conversation_answer(random_checkpoint, [Message("user", question, 1)], [Image.open(image)], 8)
    assert answer.strip() and answer.strip() in first and answer.strip() in again


@pytest.mark.parametrize("content, message", [
    ('{"prompt": "hi"}\nnot json\n', "requests.jsonl:2: not valid JSON"),
    ('{"image": "missing.png"}\n', "missing.png: no such file"),
    ('["a list"]\n', "requests.jsonl:1: expected"),
    ('{"messages": [{"role": "assistant", "content": "hi"}]}\n', "ending with a user message"),
    ('{"video": "clip.mp4", "image": "a.png"}\n', "requests.jsonl:1: a video prompt holds the video's"),
    ('{"prompt": "hi", "fps": 2}\n', 'requests.jsonl:1: "fps" and "max_frames" sample a "video"'),
    ('{"video": "clip.mp4", "max_frames": 0}\n', "requests.jsonl:1: video.max_frames must be positive"),
    ('{"video": "missing.mp4"}\n', "missing.mp4: no such file"),
])
def test_bad_batch_files_are_one_line_errors_before_any_work(
    random_checkpoint, tmp_path, capsys, content, message
):
    batch = tmp_path / "requests.jsonl"
    batch.write_text(content)
    code, _, err = _run(
        capsys, "--checkpoint", random_checkpoint, "--batch", batch, "--output", tmp_path / "out.jsonl"
    )
    assert code == 2 and message in err.strip().splitlines()[-1], err
    assert not (tmp_path / "out.jsonl").exists()


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    from tests.data.test_video import write_clip

    return write_clip(tmp_path_factory.mktemp("clip") / "clip.mp4", 4)  # 4 s, 10 fps


def test_a_clip_is_answered_as_the_model_answers_its_frames_sampled_as_fps_and_max_frames_say(
        random_checkpoint, clip, capsys):
    from data.video import read_video
    from models.split_config import VideoConfig

    question = "which way does the square move?"
    code, out, err = _run(capsys, "--checkpoint", random_checkpoint, "--video", clip, "--prompt", question,
                          "--fps", 2, "--max-frames", 3, "--max-new-tokens", 10)
    frames = read_video(clip, VideoConfig(fps=2, max_frames=3))  # not the checkpoint's 1 fps: 4 frames
    expected = _conversation_answer(random_checkpoint, [Message("user", question)], [], 10, frames)
    assert code == 0, err
    assert out.strip() == expected.strip() and expected.strip()


def test_batch_lines_with_a_video_answer_as_the_one_answer_video_path(random_checkpoint, clip, tmp_path,
                                                                     capsys):
    """A "video" line (its own "fps" / "max_frames", or the checkpoint's sampling; a prompt, a caption, or
    messages) is answered by the engine as `--video` answers it alone."""
    from data.video import read_video

    question = "which way does the square move?"
    lines = [{"video": clip.name, "prompt": question, "fps": 2, "max_frames": 3}, {"video": str(clip)},
             {"video": clip.name, "messages": [{"role": "system", "content": "Answer briefly."},
                                               {"role": "user", "content": question}]}]
    batch = clip.parent / "requests.jsonl"  # a relative "video" is read beside the batch file
    batch.write_text("".join(json.dumps(line) + "\n" for line in lines))
    output = tmp_path / "answers.jsonl"
    code, _, err = _run(capsys, "--checkpoint", random_checkpoint, "--batch", batch, "--output", output,
                        "--max-new-tokens", 10)
    assert code == 0, err
    answers = [json.loads(line)["answer"] for line in output.read_text().splitlines()]
    alone = [_run(capsys, "--checkpoint", random_checkpoint, "--video", clip, "--max-new-tokens", 10, *argv)
             for argv in (["--prompt", question, "--fps", 2, "--max-frames", 3], [])]
    assert all(code == 0 for code, _, _ in alone)
    model = VisionLanguageModel.from_pretrained(random_checkpoint)
    conversation = _conversation_answer(random_checkpoint, [Message("system", "Answer briefly."),
                                                            Message("user", question)], [], 10,
                                        read_video(clip, model.config.video))
    assert answers == [out.strip() for _, out, _ in alone] + [conversation.strip()]
    assert len(set(answers)) == 3  # three prompts, three answers: each line asked its own


def test_an_unreadable_clip_is_a_one_line_error(random_checkpoint, tmp_path, capsys):
    text = tmp_path / "notes.mp4"
    text.write_text("not a video\n" * 20)
    code, out, err = _run(capsys, "--checkpoint", random_checkpoint, "--video", text)
    assert code == 2 and not out
    assert err.strip().splitlines()[-1].startswith(f"error: {text}: not a readable video")


@pytest.mark.parametrize(("argv", "message"), [
    (["--video", "x.mp4", "--fps", "0"], "video.fps must be positive, got 0.0"),
    (["--video", "x.mp4", "--max-frames", "0"], "video.max_frames must be positive, got 0"),
    (["--image", "x.png", "--fps", "2"], "--fps and --max-frames sample a --video"),
])
def test_bad_sampling_options_are_refused_before_loading(capsys, argv, message):
    with pytest.raises(SystemExit) as exit:
        generate.main(argv)
    assert exit.value.code == 2 and capsys.readouterr().err.strip().splitlines()[-1].endswith(message)


def test_chat_video_opens_a_conversation_and_is_refused_inside_one(random_checkpoint, clip):
    from data.video import read_video

    question = "which way does it move?"
    attached, answer, refused = _chat(random_checkpoint, [], [f"/video {clip}", question, f"/video {clip}"])
    assert "(a clip of 4 frames attached to your next question)" in attached  # 4 s at the default 1 fps
    model = VisionLanguageModel.from_pretrained(random_checkpoint)
    expected = _conversation_answer(random_checkpoint, [Message("user", question)], [], 8,
                                    read_video(clip, model.config.video))
    assert expected.strip() and expected.strip() in answer
    assert "error: a clip opens a conversation: /reset, then /video PATH" in refused


def test_inference_imports_nothing_from_training():
    """Regression: generate.py took checkpoint discovery and device choice from training/, and with them
    torch.distributed.checkpoint; inference needs only models/ and data/ (and serving/)."""
    import subprocess
    import sys

    code = ("import sys, generate, serving.server, serving.engine; "
            "print(sorted(m for m in sys.modules if m == 'training' or m.startswith('training.')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_answering_imports_no_module_it_does_not_use(random_checkpoint, image):
    """Regression: generate.py imported torchvision (used by image splitting only), torch._dynamo
    (compile=True only) and FSDP2 / torch.distributed.checkpoint (sharded training only), ~3 s of a ~10 s call
    on 2 cores. A whole answer, in a fresh process, loads none of them."""
    import subprocess
    import sys

    heavy = ["torchvision", "torch._dynamo", "torch.distributed.checkpoint", "torch.distributed.fsdp"]
    code = (f"import sys, generate; code = generate.main(sys.argv[1:]); "
            f"print(code, [m for m in {heavy!r} if m in sys.modules], file=sys.stderr)")
    result = subprocess.run([sys.executable, "-c", code, "--checkpoint", str(random_checkpoint), "--image",
                             str(image), "--prompt", "What colour is it?", "--max-new-tokens", "3"],
                            capture_output=True, text=True, timeout=120)
    assert result.stderr.strip().splitlines()[-1] == "0 []", result.stderr[-2000:]
