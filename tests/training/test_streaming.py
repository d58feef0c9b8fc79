"""Training on a streamed source (data.source=stream): a run resumed from a checkpoint trains on the samples
of the uninterrupted run, in its order, to the same weights and stream positions; a streamed run resumed with
another number of readers is refused; a JSONL stream's bad lines are skipped and counted."""

import dataclasses
import json
import shutil
import signal
import subprocess
import sys
import time

import pytest
import yaml
from safetensors.torch import load_file

from data import jsonl_stream, make_shapes_dataset
from data.shards import write_shards
from data.sources import DataConfig
from data.streaming import StreamConfig
from loading import STATE_JSON
from tests.training.helpers import small_config
from training.run import train
from typed_config import ConfigError


def _stream_config(tmp_path, run_dir, packing="longest", **train_settings):
    shards = tmp_path / "shards"
    if not shards.exists():
        records = list(make_shapes_dataset("train", 96, seed=0, image_size=32))
        write_shards(shards, records, "finevision", files=2, rows_per_group=8)
    settings = {"train.max_steps": "6", "train.save_every": "3", "train.eval_every": "6",
                "train.eval_questions": "4", **train_settings}
    config = small_config(run_dir, **settings)
    streams = (StreamConfig(files=str(shards / "*.parquet"), layout="finevision", min_relevance=1),)
    return dataclasses.replace(config, data=DataConfig(source="stream", streams=streams, holdout=8,
                                                       shuffle_buffer=5),
                               train=dataclasses.replace(config.train, packing=packing))


@pytest.mark.parametrize(("workers", "packing"), [
    (0, "longest"), (0, "max_length"), pytest.param(2, "longest", marks=pytest.mark.slow),
    pytest.param(2, "max_length", marks=pytest.mark.slow)])
def test_a_resumed_stream_trains_like_the_uninterrupted_run(tmp_path, workers, packing):
    """train.packing max_length: the resumed run reads its windows' samples again and packs the same rows."""
    settings = {"train.num_workers": str(workers), "train.max_length": "128", "packing": packing,
                "train.batch_size": "4"}
    whole = tmp_path / "whole"
    metrics = train(_stream_config(tmp_path, whole, **settings))
    assert metrics["bad_records"] == 0 and set(metrics["source_token_shares"].values()) == {1.0}
    resumed = tmp_path / "resumed"  # as if killed after step 3's checkpoint
    shutil.copytree(whole / "step_000003", resumed / "step_000003")
    train(_stream_config(tmp_path, resumed, **settings), resume=resumed / "step_000003")
    expected, got = (load_file(run / "step_000006" / "model.safetensors") for run in (whole, resumed))
    assert all((expected[key] == got[key]).all() for key in expected)
    saved = [json.loads((run / "step_000006" / STATE_JSON).read_text()) for run in (whole, resumed)]
    assert saved[0]["sample_digests"] == saved[1]["sample_digests"]  # the same samples, step by step
    assert saved[0]["stream"] == saved[1]["stream"] and saved[0]["history"] == saved[1]["history"]
    windows = [position.get("window") for position in saved[0]["stream"].values()]
    assert all(bool(window) == (packing == "max_length") for window in windows)


def test_resuming_a_stream_with_other_readers_is_refused(tmp_path):
    run = tmp_path / "run"
    train(_stream_config(tmp_path, run, **{"train.max_steps": "3"}))
    with pytest.raises(ConfigError, match="as many readers"):
        train(_stream_config(tmp_path, run, **{"train.num_workers": "2"}), resume=run / "step_000003")


@pytest.mark.slow
@pytest.mark.parametrize("packing", ["longest", "max_length"])
def test_sigkill_and_resume_train_on_the_uninterrupted_samples(tmp_path, packing):
    """`python train.py` killed with SIGKILL after its step-4 checkpoint, then `--resume`d."""
    runs = {name: tmp_path / name for name in ("whole", "killed")}
    for name, run in runs.items():
        config = _stream_config(tmp_path, run, **{"train.max_steps": "10", "train.save_every": "2",
                                                  "train.keep_checkpoints": "10", "train.max_length": "128"},
                                packing=packing)
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(config.to_dict()))
    command = [sys.executable, "train.py", "--config"]
    subprocess.run([*command, str(tmp_path / "whole.yaml")], check=True, capture_output=True)
    killed = subprocess.Popen([*command, str(tmp_path / "killed.yaml")], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    while not (runs["killed"] / "step_000004").is_dir():
        assert killed.poll() is None, "the run ended before its step-4 checkpoint"
        time.sleep(0.05)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    subprocess.run([*command[:2], "--resume", str(runs["killed"])], check=True, capture_output=True)
    saved = [json.loads((run / "step_000010" / STATE_JSON).read_text()) for run in runs.values()]
    assert saved[0]["sample_digests"] == saved[1]["sample_digests"]
    expected, got = (load_file(run / "step_000010" / "model.safetensors") for run in runs.values())
    assert all((expected[key] == got[key]).all() for key in expected)


@pytest.mark.slow
@pytest.mark.parametrize("packing", ["longest", "max_length"])
def test_two_ranks_of_two_workers_resume_their_streams_exactly(tmp_path, packing):
    """torchrun (gloo), 2 ranks x 2 DataLoader workers: the checkpoint holds all 4 readers' positions (with
    train.packing max_length, their windows), and a job resumed from step 2 trains on the samples of the
    uninterrupted one to its weights."""
    runs = {name: tmp_path / name for name in ("whole", "resumed")}
    settings = {"train.max_steps": "4", "train.save_every": "2", "train.keep_checkpoints": "5",
                "train.num_workers": "2", "train.batch_size": "4", "train.num_threads": "1",
                "train.max_length": "128"}
    config = _stream_config(tmp_path, runs["whole"], packing, **settings)
    (tmp_path / "whole.yaml").write_text(yaml.safe_dump(config.to_dict()))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                "train.py"]
    subprocess.run([*torchrun, "--config", str(tmp_path / "whole.yaml")], check=True, capture_output=True,
                   timeout=600)
    shutil.copytree(runs["whole"] / "step_000002", runs["resumed"] / "step_000002")
    subprocess.run([*torchrun, "--resume", str(runs["resumed"] / "step_000002")], check=True,
                   capture_output=True, timeout=600)
    saved = [json.loads((run / "step_000004" / STATE_JSON).read_text()) for run in runs.values()]
    assert sorted(saved[0]["stream"]) == ["0", "1", "2", "3"]  # every rank's every worker
    assert set(saved[0]["sample_digests"]) == {"0", "1"}
    assert saved[0]["sample_digests"] == saved[1]["sample_digests"]
    assert saved[0]["stream"] == saved[1]["stream"]
    expected, got = (load_file(run / "step_000004" / "model.safetensors") for run in runs.values())
    assert all((expected[key] == got[key]).all() for key in expected)


def test_a_jsonl_stream_trains_and_counts_its_bad_lines(tmp_path, monkeypatch):
    """Own-data JSONL streamed (data/jsonl_stream.py): its two bad lines, read within the run's first epoch,
    are skipped and counted by their keys, and the held-out lines are the validation records."""
    monkeypatch.setattr(jsonl_stream, "LINES_PER_UNIT", 4)
    (tmp_path / "pics").mkdir()
    lines = []
    for number, record in enumerate(make_shapes_dataset("train", 32, seed=0, image_size=32)):
        record["images"][0].save(tmp_path / "pics" / f"{number}.png")
        lines.append(json.dumps({"images": [f"pics/{number}.png"], "texts": record["texts"],
                                 "question_type": record["question_type"]}))
    missing = {"images": ["pics/gone.png"], "texts": [{"user": "a", "assistant": "b"}]}
    lines[10:10] = ["{not json", json.dumps(missing)]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    config = small_config(tmp_path / "run", **{"train.max_steps": "5", "train.eval_every": "5",
                                               "train.save_every": "5", "train.eval_questions": "4"})
    streams = (StreamConfig(files=str(path)),)
    metrics = train(dataclasses.replace(config, data=DataConfig(source="stream", streams=streams, holdout=4,
                                                                shuffle_buffer=3)))
    assert metrics["step"] == 5 and metrics["bad_records"] == 2 and metrics["num_questions"] == 4
    saved = json.loads((tmp_path / "run" / "step_000005" / STATE_JSON).read_text())
    assert saved["bad_record_indices"] == [f"{path}#10", f"{path}#11"]
