"""SmolVLM2 (transformers' SmolVLMForConditionalGeneration) with video: a tiny random checkpoint built and
saved with transformers, its clips sampled and prompted as its own processor does, answered with its greedy
tokens."""

from pathlib import Path

import pytest
import torch

from data.chat_processors import CheckpointProcessor
from data.prompts import Message
from data.video import read_video
from models import VisionLanguageModel
from models.split_config import VideoConfig
from tests.data.test_video import write_clip
from tests.models.helpers import SMOLVLM_CHAT_TEMPLATE, save_tiny_idefics3

QUESTION = "which way does the square move?"
SAMPLING = {"fps": 2, "max_frames": 5, "video_size": {"longest_edge": 48}}


def save_tiny_smolvlm2(directory: Path):
    """A random SmolVLMForConditionalGeneration (the tiny Idefics3's weights and tokenizer, helpers.py: 32 px
    frames of 4 tokens) with its processor (image and video processors, chat template), saved as a
    transformers checkpoint; returns the transformers model and processor."""
    from transformers import (
        SmolVLMConfig,
        SmolVLMForConditionalGeneration,
        SmolVLMImageProcessor,
        SmolVLMProcessor,
        SmolVLMVideoProcessor,
    )

    idefics3, idefics3_processor = save_tiny_idefics3(directory / "idefics3", split=False)
    settings = {**idefics3.config.to_dict(), "model_type": "smolvlm"}
    settings["vision_config"]["model_type"] = "smolvlm_vision"
    model = SmolVLMForConditionalGeneration(SmolVLMConfig.from_dict(settings)).eval()
    model.load_state_dict(idefics3.state_dict())
    image_processor = SmolVLMImageProcessor(do_image_splitting=False, size={"longest_edge": 32},
                                            max_image_size={"longest_edge": 32})
    video_processor = SmolVLMVideoProcessor(video_sampling=SAMPLING, max_image_size={"longest_edge": 32})
    processor = SmolVLMProcessor(image_processor, idefics3_processor.tokenizer, video_processor,
                                 image_seq_len=4, chat_template=SMOLVLM_CHAT_TEMPLATE)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return model, processor


@pytest.fixture(scope="module")
def smolvlm2(tmp_path_factory):
    directory = tmp_path_factory.mktemp("smolvlm2")
    reference, processor = save_tiny_smolvlm2(directory)
    clip = write_clip(directory / "clip.mp4", 4)
    return directory, reference, processor, clip


def reference_inputs(processor, clip: Path, monkeypatch, turns: list[dict] | None = None):
    """transformers' own inputs for the clip: its chat template, its processor's sampling (over its PyAV
    reader: its default, torchcodec, needs a system FFmpeg) and its video prompt."""
    from transformers.video_utils import load_video

    def fetch_videos(urls: list[str], sample_indices_fn=None):
        return tuple(zip(*[load_video(url, backend="pyav", sample_indices_fn=sample_indices_fn)
                           for url in urls]))

    monkeypatch.setattr(processor.video_processor, "fetch_videos", fetch_videos)
    conversation = [{"role": "user", "content": [{"type": "video", "path": str(clip)},
                                                 {"type": "text", "text": QUESTION}]}, *(turns or [])]
    return processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True,
                                         return_dict=True, return_tensors="pt")


def our_sampling(processor) -> VideoConfig:
    return VideoConfig(fps=processor.video_processor.fps, max_frames=processor.video_processor.num_frames,
                       max_side=processor.video_processor.size["longest_edge"])


def test_video_prompt_ids_and_pixels_match_transformers(smolvlm2, monkeypatch):
    directory, _, processor, clip = smolvlm2
    ids, pixels = CheckpointProcessor.from_pretrained(directory).encode(
        QUESTION, [], read_video(clip, our_sampling(processor)))
    expected = reference_inputs(processor, clip, monkeypatch)
    assert ids == expected["input_ids"][0].tolist()
    assert len(pixels) == 5  # 4 s at 2 fps, capped at max_frames
    torch.testing.assert_close(pixels, expected["pixel_values"][0], atol=0, rtol=0)


def test_the_checkpoint_loads_with_its_video_settings(smolvlm2):
    directory, reference, processor, _ = smolvlm2
    config = VisionLanguageModel.from_pretrained(directory).config
    assert config.video == our_sampling(processor)
    assert config.image_token_id == reference.config.image_token_id and not config.splitting.enabled


@pytest.mark.parametrize("follow_up", [False, True], ids=["video-turn", "text-turn-after-the-video"])
def test_greedy_tokens_on_a_clip_match_transformers(smolvlm2, monkeypatch, follow_up):
    directory, reference, processor, clip = smolvlm2
    model = VisionLanguageModel.from_pretrained(directory).eval()
    answer, follow_up_question = "left to right", "and the blue one?"
    turns = [{"role": "assistant", "content": [{"type": "text", "text": answer}]},
             {"role": "user", "content": [{"type": "text", "text": follow_up_question}]}] if follow_up else []
    messages = [Message("user", QUESTION), *(Message(t["role"], t["content"][0]["text"]) for t in turns)]
    ids, pixels = CheckpointProcessor.from_pretrained(directory).encode_chat(
        messages, [], read_video(clip, model.config.video))
    inputs = reference_inputs(processor, clip, monkeypatch, turns)
    assert ids == inputs["input_ids"][0].tolist() and len(pixels) == 5  # five frames
    expected = reference.generate(**inputs, max_new_tokens=16, do_sample=False,
                                  eos_token_id=None)[0, len(ids):]
    tokens = model.generate(torch.tensor([ids]), pixels, max_new_tokens=16, greedy=True)[0]
    assert len(set(expected.tolist())) > 5  # a wandering sequence, not one repeated token
    assert tokens.tolist() == expected.tolist()


def test_a_checkpoint_without_a_video_processor_refuses_a_clip_in_one_line(smolvlm2):
    from data.prompts import PromptError

    clip = read_video(smolvlm2[3], VideoConfig(fps=1, max_frames=2))
    with pytest.raises(PromptError, match="takes no video") as error:
        CheckpointProcessor.from_pretrained(smolvlm2[0] / "idefics3").encode(QUESTION, [], clip)
    assert "\n" not in str(error.value)


def test_a_fine_tune_with_video_settings_exports_as_a_smolvlm2_that_transformers_samples_and_answers_alike(
        smolvlm2, tmp_path, monkeypatch):
    """A tinyvlm checkpoint of the SmolVLM2 (its processor kept) with video sampling of its own exports as a
    SmolVLM2: transformers' processor samples as the model's config says, builds the prompt ours builds
    from the export, and its model answers with the model's greedy tokens."""
    from transformers import AutoProcessor, SmolVLMForConditionalGeneration

    from training.export import main as export

    directory, _, processor, clip = smolvlm2
    sampling = VideoConfig(fps=3, max_frames=6, max_side=40)  # 4 s at 3 fps: 12 frames, 6 kept
    model = VisionLanguageModel.from_pretrained(directory).eval()
    model.config = model.config.replace({"video.fps": sampling.fps, "video.max_frames": sampling.max_frames,
                                         "video.max_side": sampling.max_side})
    model.save_pretrained(tmp_path / "ours")
    CheckpointProcessor.from_pretrained(directory).save_pretrained(tmp_path / "ours")
    assert export(["--format", "idefics3", str(tmp_path / "ours"), str(tmp_path / "smolvlm2")]) == 0
    reference = SmolVLMForConditionalGeneration.from_pretrained(tmp_path / "smolvlm2").eval()
    exported = AutoProcessor.from_pretrained(tmp_path / "smolvlm2")
    assert reference.config.model_type == "smolvlm" and our_sampling(exported) == sampling
    assert VisionLanguageModel.from_pretrained(tmp_path / "smolvlm2").config.video == sampling
    inputs = reference_inputs(exported, clip, monkeypatch)
    ids, pixels = CheckpointProcessor.from_pretrained(tmp_path / "smolvlm2").encode(
        QUESTION, [], read_video(clip, model.config.video))
    assert ids == inputs["input_ids"][0].tolist() and len(pixels) == 6
    torch.testing.assert_close(pixels, inputs["pixel_values"][0], atol=0, rtol=0)
    expected = reference.generate(**inputs, max_new_tokens=16, do_sample=False,
                                  eos_token_id=None)[0, len(ids):]
    assert model.generate(torch.tensor([ids]), pixels, max_new_tokens=16, greedy=True)[0].tolist() \
        == expected.tolist()
