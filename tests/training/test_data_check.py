"""`python train.py --check-data`: every record read and encoded as training would, each fault reported with
its line and cause, and a non-zero exit where training would stop on the data."""

import json

import pytest
import yaml
from PIL import Image

from data.shards import write_shards
from tests.shards import tiny_records
from train import main

GOOD = {"images": ["red.png"], "texts": [{"user": "What color is it?", "assistant": "red"}]}
PLANTED = {  # line number -> (the line, the cause the report gives it)
    4: (json.dumps({**GOOD, "images": ["gone.png"]}), "missing image file"),
    6: (json.dumps({**GOOD, "texts": [{"user": "<image>\nWhat color is it?", "assistant": "red"}]}),
        "image placeholder in a text"),
    8: (json.dumps({**GOOD, "texts": [{"user": "What color is it?", "assistant": ""}]}), "empty answer"),
    10: (json.dumps({**GOOD, "images": ["broken.png"]}), "unreadable image"),
    12: ("{not json", "malformed record"),
}


def _data(tmp_path, planted: dict[int, tuple[str, str]], lines: int = 30):
    Image.new("RGB", (40, 30), "red").save(tmp_path / "red.png")
    (tmp_path / "broken.png").write_bytes(b"not a png")
    rows = [planted[n][0] if n in planted else json.dumps(GOOD) for n in range(1, lines + 1)]
    rows[13] = json.dumps({**GOOD, "texts": [{"user": "Describe it.", "assistant": "red " * 300}]})  # line 14
    (tmp_path / "data.jsonl").write_text("\n".join(rows) + "\n")
    return ["--data.source", "jsonl", "--data.path", str(tmp_path / "data.jsonl"), "--check-data"]


def test_each_planted_fault_is_reported_with_its_line_and_cause(tmp_path, capsys):
    assert main(_data(tmp_path, PLANTED)) == 0  # 5 of 30 bad: training skips and counts them
    out = capsys.readouterr().out
    path = tmp_path / "data.jsonl"
    for number, (_, cause) in PLANTED.items():
        section = out.split(f"  {cause}: 1\n", 1)[1]
        assert section.splitlines()[0].strip().startswith(f"{path}:{number}:"), (cause, out)
    assert "longer than train.max_length (256): 1 records" in out and "answer tokens lost" in out
    assert f"{path}: 30 records, 5 bad" in out
    assert "data check passed: 24 of 30 records train; 5 bad ones are skipped and counted; 1 too long" in out


def test_it_fails_where_training_would_stop(tmp_path, capsys):
    arguments = _data(tmp_path, PLANTED)
    assert main([*arguments, "--data.on_bad_record", "fail"]) == 1
    assert "data check failed: 5 bad records" in capsys.readouterr().out
    mostly_bad = {n: PLANTED[4] for n in range(1, 21)}
    assert main(_data(tmp_path, mostly_bad)) == 1
    assert "data check failed: 19 of 30 records of" in capsys.readouterr().out  # line 14: too long


def test_it_trains_nothing(tmp_path):
    assert main([*_data(tmp_path, {}), "--train.output_dir", str(tmp_path / "run")]) == 0
    assert not (tmp_path / "run").exists()


def test_resuming_takes_no_check(tmp_path):
    with pytest.raises(SystemExit):
        main(["--resume", str(tmp_path), "--check-data"])


def test_a_stream_is_checked_on_its_first_samples(tmp_path, capsys):
    records = tiny_records(40)
    for number, record in enumerate(records):  # every third record's turn rated 1 for relevance
        record["relevance_ratings"] = [1 if number % 3 == 0 else 4]
    records[25]["images"] = [{"bytes": b"not a png", "path": None}]
    write_shards(tmp_path / "shards", records, "finevision", files=2, rows_per_group=5)
    stream = {"files": str(tmp_path / "shards" / "*.parquet"), "layout": "finevision", "min_relevance": 2}
    config = {"data": {"source": "stream", "streams": [stream], "holdout": 10},
              "train": {"vision_pretrain_steps": 0, "output_dir": str(tmp_path / "run")}}
    (tmp_path / "stream.yaml").write_text(yaml.safe_dump(config))
    argv = ["--config", str(tmp_path / "stream.yaml"), "--check-data", "--data.check_samples", "20"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    checked = range(10, 30)  # after the 10 held out, the first 20
    dropped = sum(number % 3 == 0 for number in checked)
    assert f"{stream['files']}: {20 - dropped} records, 1 bad" in out
    assert f"dropped by the ratings filters: {dropped} records" in out
    assert "relevance ratings per turn: min 1 / median 4" in out and "unreadable image: 1" in out
    assert "validation: 6 records, 0 bad" in out  # the 10 held-out rows, less the 4 rated 1


def test_clips_are_reported_with_frames_and_video_tokens_and_bad_ones_by_line(tmp_path, capsys):
    from data.video import Clip, read_video, write_video
    from models.split_config import VideoConfig

    frames = [Image.new("RGB", (48, 48), (40 * i, 0, 0)) for i in range(4)]
    write_video(Clip(frames, [0, 1, 2, 3], [0.0, 1.0, 2.0, 3.0], 4.0), tmp_path / "clip.mp4", fps=1)
    (tmp_path / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(200))
    clip = {"video": "clip.mp4", "texts": [{"user": "Which way?", "assistant": "left"}]}
    rows = [clip] * 8 + [{**clip, "video": "broken.mp4"}, {**clip, "video": "gone.mp4"},
                         {**clip, "max_frames": 2}]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert main(["--data.source", "jsonl", "--data.path", str(tmp_path / "data.jsonl"), "--check-data",
                 "--model.video.max_frames", "3"]) == 0
    out, path = capsys.readouterr().out, tmp_path / "data.jsonl"
    assert f"  unreadable video: 1\n    {path}:9: {tmp_path / 'broken.mp4'}: not a readable video" in out
    assert f"  missing video file: 1\n    {path}:10: {tmp_path / 'gone.mp4'}: no such video file" in out
    assert len(read_video(tmp_path / "clip.mp4", VideoConfig(max_frames=3)).frames) == 3
    assert "records with a clip: 9; frames per clip: min 2 / median 3 / p99 3 / max 3" in out
