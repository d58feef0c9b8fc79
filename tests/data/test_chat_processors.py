"""tinyvlm's own ChatProcessor with a clip: SmolVLM2's words (frame count, duration, timestamps) around each
frame's placeholders, as the tokenizer itself reads that text; each frame one global image, resized as
transformers' SmolVLM2 video processor resizes it; and the model answers a clip as it answers its frames."""

import pytest
import torch

from data.chat_processors import ChatProcessor
from data.image_splitting import marker_tokens
from data.prompts import Message, PromptError
from data.tokenizer import IMAGE_TOKEN, prepare_tokenizer
from data.video import read_video, video_prompt
from models.split_config import VideoConfig
from tests.data.test_video import write_clip
from tests.models.helpers import base_tokenizer, chat_vlm

QUESTION = "what colour is the sky?"


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    path = write_clip(tmp_path_factory.mktemp("clip") / "clip.mp4", 4)  # 4 s of 64 x 48 at 10 fps
    return read_video(path, VideoConfig(fps=1, max_frames=3, max_side=32))


def _chatml(user: str) -> str:
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def test_a_clip_is_smolvlm2s_text_with_each_frames_placeholders_as_the_tokenizer_reads_it(clip):
    tokenizer = base_tokenizer()
    model = chat_vlm(tokenizer)
    processor = ChatProcessor.from_config(model.config, tokenizer)
    ids, pixels = processor.encode(QUESTION, [], clip)
    frame = IMAGE_TOKEN * model.config.tokens_per_image
    text = _chatml(video_prompt(clip, frame) + QUESTION)
    # 3 frames of 4 s, at 0, 1.9 and 3.9 s: whole seconds, as SmolVLM2 writes them
    assert "three frames from a 0:00:04" in text and "00:01:<|image|>" in text and "00:03:" in text
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    # the same frames given as images (their pixels) and the same text give the same greedy answer
    _, frame_pixels = processor.encode("", clip.frames)
    assert torch.equal(pixels, frame_pixels)
    settings = dict(max_new_tokens=12, greedy=True)
    answer = model.generate(torch.tensor([ids]), pixels, **settings)
    expected = model.generate(torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]]),
                              frame_pixels, **settings)
    assert answer.tolist() == expected.tolist() and len(set(answer[0].tolist())) > 3


@pytest.mark.parametrize(("layout", "frame"), [
    ("idefics3", "<fake_token_around_image><global-img>{}<fake_token_around_image>"),
    ("nanovlm", "<|global_image|>{}"),
])
def test_a_splitting_model_sees_each_frame_as_one_global_image(clip, layout, frame):
    tokenizer = base_tokenizer()
    model = chat_vlm(tokenizer)
    config = model.config.replace({"splitting": {"enabled": True, "max_image_size": 96, "layout": layout}})
    prepare_tokenizer(tokenizer, marker_tokens(config))
    processor = ChatProcessor.from_config(config, tokenizer)
    ids, pixels = processor.encode(QUESTION, [], clip)
    frame = frame.format(IMAGE_TOKEN * config.tokens_per_image)
    text = _chatml(video_prompt(clip, frame) + QUESTION)
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert pixels.shape == (3, 3, 32, 32)  # one tile a frame, none split off


def test_frames_are_resized_as_smolvlm2s_video_processor_resizes_them(clip):
    import numpy as np
    from transformers import SmolVLMVideoProcessor

    tokenizer = base_tokenizer()
    config = chat_vlm(tokenizer).config.replace({"splitting": {"enabled": True, "max_image_size": 96}})
    prepare_tokenizer(tokenizer, marker_tokens(config))
    _, pixels = ChatProcessor.from_config(config, tokenizer).encode(QUESTION, [], clip)
    reference = SmolVLMVideoProcessor(size={"longest_edge": 32}, max_image_size={"longest_edge": 32})
    frames = np.stack([np.asarray(frame) for frame in clip.frames])
    expected = reference(videos=[frames], do_sample_frames=False, return_tensors="pt")["pixel_values"][0]
    torch.testing.assert_close(pixels, expected, atol=0, rtol=0)


def test_images_beside_a_clip_are_refused_in_one_line(clip):
    tokenizer = base_tokenizer()
    processor = ChatProcessor.from_config(chat_vlm(tokenizer).config, tokenizer)
    with pytest.raises(PromptError, match="no other images") as error:
        processor.encode_chat([Message("user", QUESTION, 1)], clip.frames[:1], clip)
    assert "\n" not in str(error.value)
