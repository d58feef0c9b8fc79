"""Run configs: YAML files map onto the dataclasses, and every field can be overridden from the command line."""

import dataclasses

import pytest

from models.config import Config, ConfigError
from training.config import RunConfig, load_run_config, parse_overrides


def _leaf_fields(config: Config, prefix: str = ""):
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if isinstance(value, Config):
            yield from _leaf_fields(value, f"{prefix}{field.name}.")
        else:
            yield f"{prefix}{field.name}", value


@pytest.mark.parametrize("path", ["configs/tiny.yaml", "configs/smollm2-shapes.yaml", "configs/nanovlm-222m.yaml"])
def test_shipped_configs_load(path):
    assert isinstance(load_run_config(path, {}), RunConfig)


def test_every_field_is_reachable_from_the_command_line():
    config = load_run_config("configs/tiny.yaml", {})
    leaves = dict(_leaf_fields(config))
    assert len(leaves) > 60
    for key, value in leaves.items():
        text = "none" if value is None else ",".join(map(str, value)) if isinstance(value, (tuple, list)) else str(value)
        assert config.replace({key: text}) == config, key


def test_boolean_and_numeric_overrides_parse():
    argv = ["--train.compile", "false", "--train.max_steps=200", "--train.output_dir", "runs/try1", "--train.wandb", "true"]
    config = load_run_config("configs/tiny.yaml", parse_overrides(argv))
    assert config.train.compile is False and config.train.wandb is True
    assert config.train.max_steps == 200 and config.train.output_dir == "runs/try1"


@pytest.mark.parametrize("argv, message", [
    (["--train.max_stepz", "3"], "unknown key train.max_stepz; valid keys: train.output_dir"),
    (["--trian.max_steps", "3"], "unknown key trian"),
    (["--train.max_steps", "many"], "train.max_steps: expected int, got 'many'"),
    (["--train.compile", "perhaps"], "train.compile: expected true or false"),
    (["--train.max_steps"], "--train.max_steps needs a value"),
    (["max_steps"], "unexpected argument 'max_steps'"),
    (["--model.language.num_kv_heads", "3"], r"num_heads \(\d+\) must be divisible by language.num_kv_heads \(3\)"),
    (["--data.source", "jsonl", "--data.path", "x.jsonl"], r"vision_pretrain_steps \(400\) needs data.source=synthetic.* set it to 0"),
    (["--model.vision.patch_size", "12"], r"the patch grid \(4x4\) must split evenly into the scenes' 3x3 cells"),
    (["--model.vision.image_size", "96"], r"model.vision.image_size \(96\) must equal data.shapes.image_size \(48\)"),
])
def test_bad_overrides_are_clear_errors(argv, message):
    with pytest.raises(ConfigError, match=message):
        load_run_config("configs/tiny.yaml", parse_overrides(argv))


def test_yaml_that_does_not_parse(tmp_path):
    (tmp_path / "bad.yaml").write_text("train: {max_steps: [1, 2\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: not valid YAML \(line"):
        load_run_config(tmp_path / "bad.yaml", {})
    with pytest.raises(ConfigError, match="no such config file"):
        load_run_config(tmp_path / "missing.yaml", {})


def test_nothing_in_a_config_is_executed(tmp_path):
    marker = tmp_path / "executed"
    (tmp_path / "evil.yaml").write_text(f"train: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(ConfigError, match=r"evil.yaml: not valid YAML"):
        load_run_config(tmp_path / "evil.yaml", {})
    assert not marker.exists()
