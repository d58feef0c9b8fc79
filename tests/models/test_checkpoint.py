"""save_pretrained / from_pretrained: exact round trip, atomic files, clear errors for checkpoints that do not
fit."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from models import CheckpointError, ConfigError, VisionLanguageModel
from tests.models.helpers import tiny_vlm


@pytest.fixture
def saved(tmp_path):
    model = tiny_vlm()
    model.save_pretrained(tmp_path)
    return model, tmp_path


def _logits(model):
    ids = torch.randint(0, 90, (2, 10), generator=torch.Generator().manual_seed(0))
    ids[:, 1:5] = 95
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(ids, images)[0]


def test_round_trip_reproduces_logits_exactly(saved):
    model, directory = saved
    torch.manual_seed(1)
    loaded = VisionLanguageModel.from_pretrained(directory).eval()
    torch.manual_seed(2)
    assert loaded.config == model.config
    assert torch.equal(_logits(loaded), _logits(model))
    assert loaded.language.head.weight is loaded.language.token_embedding.weight


def test_files_written(saved):
    _, directory = saved
    names = {p.name for p in directory.iterdir()}
    assert {"config.json", "model.safetensors"} <= names and not any(n.endswith(".tmp") for n in names)
    assert "language.head.weight" not in load_file(directory / "model.safetensors")  # tied: stored once
    assert json.loads((directory / "config.json").read_text())["image_token_id"] == 95


def test_weights_that_do_not_fit_the_config_name_the_keys(saved):
    _, directory = saved
    config = json.loads((directory / "config.json").read_text())
    config["language"]["num_layers"] = 4
    config["language"]["hidden_size"] = 96
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as error:
        VisionLanguageModel.from_pretrained(directory)
    message = str(error.value)
    assert "missing keys: language.blocks.3." in message and "shape mismatch" in message
    assert "language.token_embedding.weight (96, 64) vs (96, 96)" in message


def test_truncated_weights_are_refused(saved):
    _, directory = saved
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="unreadable or truncated"):
        VisionLanguageModel.from_pretrained(directory)


def test_pickle_weights_are_refused_unless_the_user_opts_in(saved):
    model, directory = saved
    (directory / "model.safetensors").unlink()
    torch.save(model.state_dict(), directory / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pickle files can run code and are refused.*allow_pickle=True"):
        VisionLanguageModel.from_pretrained(directory)
    loaded = VisionLanguageModel.from_pretrained(directory, allow_pickle=True)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("echo this must never run",))


def test_opted_in_pickles_are_read_with_weights_only(saved, tmp_path, capfd):
    model, directory = saved
    (directory / "model.safetensors").unlink()
    torch.save({**model.state_dict(), "payload": _RunsCode()}, directory / "pytorch_model.bin")
    with pytest.raises(CheckpointError,
                       match=r"refused by torch.load\(weights_only=True\): .*GLOBAL .*system"):
        VisionLanguageModel.from_pretrained(directory, allow_pickle=True)
    assert "must never run" not in capfd.readouterr().out


def test_missing_config_and_invalid_config(saved, tmp_path):
    _, directory = saved
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="missing config.json"):
        VisionLanguageModel.from_pretrained(tmp_path / "empty")
    config = json.loads((directory / "config.json").read_text())
    config["language"]["num_kv_heads"] = 3
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError,
                       match=r"num_heads \(4\) must be divisible by language.num_kv_heads \(3\)"):
        VisionLanguageModel.from_pretrained(directory)


def test_files_follow_the_umask_so_a_shared_run_directory_is_readable(tmp_path):
    """Regression: mkstemp's owner-only mode (0600) reached every checkpoint file, whatever the umask."""
    previous = os.umask(0o022)
    try:
        tiny_vlm().save_pretrained(tmp_path)
    finally:
        os.umask(previous)
    modes = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()}
    assert {"config.json", "model.safetensors"} <= set(modes) and set(modes.values()) == {0o644}, modes


def test_stop_token_ids_round_trip_and_default_to_the_eos(tmp_path):
    model = tiny_vlm()
    assert model.config.stop_ids == [2]  # a config from before stop_token_ids: the language model's EOS
    model.config = model.config.replace({"stop_token_ids": [7, 2]})
    model.save_pretrained(tmp_path)
    assert VisionLanguageModel.from_pretrained(tmp_path).config.stop_ids == [7, 2]
    with pytest.raises(ConfigError, match="stop_token_ids"):
        model.config.replace({"stop_token_ids": [96]})
