"""Training on clips: own-data JSONL "video" records, and the synthetic moving-shapes task whose held-out clip
generate.py answers."""

import json

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer

import generate
from data.chat_processors import ChatProcessor
from data.synthetic_video import QUESTION_TYPES
from data.video import Clip, read_video, write_video
from models import VisionLanguageModel
from tests.training.helpers import PRETRAINED_VIT, small_config
from training.evaluate import answer
from training.run import train
from typed_config import ConfigError

VIDEO = {"model.video.fps": "1", "model.video.max_frames": "4", "model.video.max_side": "48"}


def test_jsonl_clips_train_beside_text_records_and_a_corrupt_one_is_skipped_and_counted(tmp_path):
    rng = np.random.default_rng(0)
    for name in ("a", "b"):
        frames = [Image.fromarray(rng.integers(0, 255, (48, 48, 3), dtype=np.uint8)) for _ in range(5)]
        clip = Clip(frames, list(range(5)), [float(i) for i in range(5)], 5.0)
        write_video(clip, tmp_path / f"{name}.mp4", fps=1)
    (tmp_path / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(200))
    rows = [{"video": name, "texts": [{"user": "Which clip?", "assistant": name[0]}]}
            for name in ["a.mp4", "b.mp4"] * 12 + ["broken.mp4"]]
    rows += [{"images": [], "texts": [{"user": "Text only?", "assistant": "yes"}]}] * 4  # mixed with clips
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    settings = {"data.source": "jsonl", "data.path": str(tmp_path / "data.jsonl"), "data.holdout": "4",
                "train.max_steps": "4", "train.eval_every": "4", "train.save_every": "4", "train.seed": "1"}
    metrics = train(small_config(tmp_path / "run", **VIDEO, **settings))
    assert metrics["step"] == 4 and np.isfinite(metrics["train_loss"])
    assert metrics["bad_records"] == 1  # broken.mp4, the one line that cannot be read (refused under "fail":
    # tests/data/test_video_records.py)


SYNTHETIC = {**PRETRAINED_VIT, **VIDEO, "data.source": "synthetic_video", "model.video.max_frames": "6",
             "data.video_shapes.num_train": "64", "data.video_shapes.num_validation": "8",
             "train.eval_questions": "8", "train.max_steps": "3", "train.eval_every": "3",
             "train.save_every": "3"}


def test_the_synthetic_clips_train_and_generate_answers_the_held_out_clip(tmp_path, capsys):
    metrics = train(small_config(tmp_path, **SYNTHETIC))
    assert {f"accuracy/{kind}" for kind in QUESTION_TYPES} <= set(metrics)  # held-out scores per type
    clip_path = tmp_path / "heldout_example.mp4"
    checkpoint = tmp_path / "step_000003"
    model = VisionLanguageModel.from_pretrained(checkpoint)
    clip = read_video(clip_path, model.config.video)
    assert len(clip.frames) == 5  # data.video_shapes.frames
    question = "Which way does the circle move?"
    processor = ChatProcessor.from_config(model.config, AutoTokenizer.from_pretrained(checkpoint))
    record = {"images": [], "video": clip, "texts": [{"user": question, "assistant": ""}]}
    expected = answer(model, processor.tokenizer, processor, [record], torch.device("cpu"), 8)[0]
    capsys.readouterr()
    code = generate.main(["--checkpoint", str(tmp_path), "--video", str(clip_path), "--prompt", question,
                          "--max-new-tokens", "8"])
    assert code == 0 and capsys.readouterr().out.strip() == expected.strip()


def test_the_models_sampling_must_take_every_frame_of_the_synthetic_clips(tmp_path):
    with pytest.raises(ConfigError, match=r"model.video .*must sample every frame of data.video_shapes"):
        small_config(tmp_path, **{**SYNTHETIC, "model.video.max_frames": "4"})
