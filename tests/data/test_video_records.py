"""Training records with a clip (JSONL "video" lines, the synthetic moving shapes): frames sampled and
prompted exactly as inference samples and prompts them, and bad clips treated like bad images."""

import json
import random

import numpy as np
import pytest
import torch
from PIL import Image

from data import DataSourceError, VQACollator, load_jsonl
from data.bad_records import BadRecordError, CheckedRecords
from data.chat_processors import ChatProcessor
from data.prompts import IGNORE_INDEX
from data.synthetic_video import QUESTION_TYPES, make_video_dataset, sample_clip, split_of
from data.video import Clip, read_video, write_video
from models.split_config import VideoConfig
from training.config import load_run_config

VIDEO = VideoConfig(fps=1, max_frames=6, max_side=48)


@pytest.fixture(scope="module")
def processor(shapes_tokenizer):
    config = load_run_config("configs/tiny-video.yaml", {}).model
    return ChatProcessor.from_config(config, shapes_tokenizer)


def _clip(seconds: int, size: int = 48) -> Clip:
    rng = np.random.default_rng(seconds)
    frames = [Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)) for _ in range(seconds)]
    return Clip(frames, list(range(seconds)), [float(i) for i in range(seconds)], float(seconds))


@pytest.fixture
def clips(tmp_path):
    write_video(_clip(8), tmp_path / "clip.mp4", fps=1)
    (tmp_path / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(200))
    return tmp_path


def _jsonl(root, rows) -> str:
    (root / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(root / "data.jsonl")


QUESTION = {"texts": [{"user": "Which way?", "assistant": "left"}]}


def test_a_clip_record_trains_on_the_prompt_inference_builds(clips, processor):
    path = _jsonl(clips, [{"video": "clip.mp4", **QUESTION},
                          {"video": "clip.mp4", "max_frames": 3, **QUESTION}])
    records = CheckedRecords(load_jsonl(path), "fail", video=VIDEO)
    batch = VQACollator.for_encoder(processor, 512)([records[0], records[1]])
    for row, config in enumerate((VIDEO, VideoConfig(fps=1, max_frames=3, max_side=48))):
        # the reference: what inference builds for the same clip and question
        prompt, pixels = processor.encode("Which way?", [], read_video(clips / "clip.mp4", config))
        assert batch["input_ids"][row, :len(prompt)].tolist() == prompt
        answer = batch["targets"][row, len(prompt) - 1:].tolist()
        assert processor.tokenizer.decode([t for t in answer if t != IGNORE_INDEX]) == "left<|im_end|>"
        first = 0 if row == 0 else len(read_video(clips / "clip.mp4", VIDEO).frames)
        assert torch.equal(batch["images"][first:first + len(pixels)], pixels)
    assert len(batch["images"]) == 6 + 3


def test_written_clips_read_back_losslessly(tmp_path):
    clip = _clip(5)
    read = read_video(write_video(clip, tmp_path / "c.mp4", fps=1), VIDEO)
    assert (read.indices, read.timestamps, read.duration) == (clip.indices, clip.timestamps, clip.duration)
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(read.frames, clip.frames))


def test_bad_clips_are_skipped_and_counted_or_refused(clips):
    path = _jsonl(clips, [{"video": "broken.mp4", **QUESTION}, {"video": "clip.mp4", **QUESTION}])
    reports = []
    records = CheckedRecords(load_jsonl(path), "skip", report=reports.append, video=VIDEO)
    assert records[0] is None and records[1] is not None and records.num_bad == 1
    assert "broken.mp4: not a readable video" in reports[0]
    with pytest.raises(BadRecordError, match="train record 0 is bad.*broken.mp4"):
        CheckedRecords(load_jsonl(path), "fail", video=VIDEO)[0]


@pytest.mark.parametrize("row, words", [
    ({"video": "gone.mp4"}, r"gone.mp4: no such video file \(listed at .*data.jsonl:1\)"),
    ({"video": "clip.mp4", "images": ["clip.mp4"]},
     r"data.jsonl:1: a record holds a clip or images, not both"),
    ({"video": "clip.mp4", "fps": 0}, r"data.jsonl:1: 'fps' must be a positive number"),
    ({"video": "clip.mp4", "max_frames": 2.5},
     r"data.jsonl:1: 'max_frames' must be a positive whole number"),
    ({"video": ["clip.mp4"]}, r"data.jsonl:1: 'video' must be a file path"),
])
def test_bad_clip_lines_are_refused_by_line_or_kept_as_bad_records(clips, row, words):
    path = _jsonl(clips, [{**row, **QUESTION}, {"video": "clip.mp4", **QUESTION}])
    with pytest.raises((DataSourceError, ValueError), match=words):
        load_jsonl(path)
    records = CheckedRecords(load_jsonl(path, "skip"), "skip", report=lambda _: None, video=VIDEO)
    assert records[0] is None and records[1] is not None


def test_synthetic_clips_are_what_reading_them_from_a_file_gives(tmp_path):
    dataset = make_video_dataset("validation", 8, seed=0, image_size=48, frames=6, fps=1.0)
    assert [r["question_type"] for r in dataset] == [*QUESTION_TYPES] * 2
    for index in range(4):
        record = dataset[index]
        read = read_video(write_video(record["video"], tmp_path / "c.mp4", fps=1.0), VIDEO)
        assert (read.indices, read.timestamps, read.duration) == (
            record["video"].indices, record["video"].timestamps, record["video"].duration)
        assert all(np.array_equal(np.asarray(a), np.asarray(b))
                   for a, b in zip(read.frames, record["video"].frames))
        assert record["images"] == []


def test_synthetic_clips_are_deterministic_and_the_splits_disjoint():
    def texts(split, seed):
        return make_video_dataset(split, 40, seed=seed, image_size=48, frames=6, fps=1.0)["texts"]

    assert texts("train", 0) == texts("train", 0) != texts("train", 1)
    rng = random.Random(0)
    for _ in range(200):  # a clip's split follows from its content alone
        kind = rng.choice(QUESTION_TYPES)
        scenes, _ = sample_clip(kind, 6, rng)
        assert split_of(kind, scenes, 0.1) == split_of(kind, list(scenes), 0.1)


@pytest.mark.parametrize("seed", range(20))
def test_synthetic_answers_follow_from_the_frames(seed):
    rng = random.Random(seed)
    scenes, answer = sample_clip("direction", 6, rng)
    circle = [next(i.cell for i in scene if i.shape == "circle") for scene in scenes]
    rows, cols = [divmod(c, 3)[0] for c in circle], [divmod(c, 3)[1] for c in circle]
    moved = {"left": cols[0] - cols[-1], "right": cols[-1] - cols[0], "up": rows[0] - rows[-1],
             "down": rows[-1] - rows[0]}
    assert moved[answer] == 2 and sorted(moved.values()) == [-2, 0, 0, 2]
    scenes, answer = sample_clip("blink", 6, rng)
    shown = [any(i.shape == "square" for i in scene) for scene in scenes]
    assert shown[0] and shown[-1] and answer == str(sum(a and not b for a, b in zip(shown, shown[1:])))
    scenes, answer = sample_clip("first_color", 6, rng)
    first = next(scene for scene in scenes if scene)
    assert len(first) == 1 and answer == first[0].color and len(scenes[-1]) == 2
    scenes, answer = sample_clip("last_frame", 6, rng)
    assert answer == f"a {scenes[-1][0].color} {scenes[-1][0].shape}"
