"""Run configs: YAML files map onto the dataclasses, and every field can be overridden from the command
line."""

import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any, Literal

import pytest

from data import QUESTION_TYPES
from training.config import RunConfig, load_run_config, parse_overrides
from typed_config import Config, ConfigError, field_comments


def _leaf_fields(config: Config, prefix: str = ""):
    """(dotted key, value, type annotation) of every field that is not itself a config section."""
    hints = typing.get_type_hints(type(config))
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if isinstance(value, Config):
            yield from _leaf_fields(value, f"{prefix}{field.name}.")
        else:
            yield f"{prefix}{field.name}", value, hints[field.name]


def _other_value(value: Any, annotation: Any) -> Any:
    """A value of the field's type other than `value`: a bool flipped, a number doubled (or halved), another
    choice, a string extended, a tuple's items changed; None becomes a value."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        kind = [a for a in args if a is not type(None)][0]  # the first: train.packing's choices, not bool
        return _other_value(value, kind) if value is not None else {int: 1, str: "somewhere/else"}[kind]
    if origin is Literal:
        return args[(args.index(value) + 1) % len(args)]
    if origin is tuple:
        item = args[0]
        if not value:
            return (_other_value(None, item | None),)
        return tuple(_other_value(v, item) for v in value) if item is not str else value[:-1]
    if annotation is bool:
        return not value
    if annotation is int:
        return 2 * value or 1
    if annotation is float:
        return value / 2 or 0.5
    assert annotation is str, annotation
    return value + "-other"


# Fields whose doubled value or next choice does not fit the rest of configs/tiny.yaml: another valid value,
# with the fields it must change along with (tiny.yaml pre-trains its ViT on the synthetic scenes, on a 3x3
# patch grid).
TINY_CHANGES = {
    # must stay equal
    "model.vision.image_size": {"model.vision.image_size": 96, "data.shapes.image_size": 96},
    "data.shapes.image_size": {"model.vision.image_size": 96, "data.shapes.image_size": 96},
    # 3x3 grid
    "model.vision.patch_size": {"model.vision.patch_size": 16, "model.projector.pixel_shuffle_factor": 1},
    "model.vision.num_channels": {
        "model.vision.num_channels": 4,
        "model.vision.image_mean": (0.5,) * 4,
        "model.vision.image_std": (0.25,) * 4,
    },  # a mean and std per channel
    "model.vision.pretrained": {"model.vision.pretrained": "some/siglip", "train.vision_pretrain_steps": 0},
    # must divide the 6x6 grid
    "model.projector.pixel_shuffle_factor": {"model.projector.pixel_shuffle_factor": 3},
    "data.source": {"data.source": "jsonl", "data.path": "data.jsonl"},
    "train.flex_attention": {"train.flex_attention": True, "train.compile": True},  # it needs compiling
    "data.validation_path": {
        "data.source": "jsonl",
        "data.path": "data.jsonl",
        "data.validation_path": "val.jsonl",
    },
    "data.shapes.train_turns": {
        "data.shapes.train_turns": 2,
        "data.shapes.train_question_types": QUESTION_TYPES,
    },
    "train.decay_steps": {"train.decay_steps": 200},  # 0 or at least warmup_steps (100)
    "train.packing": {"train.packing": "off"},  # max_length packs streamed samples only
    # a whole VLM brings a trained ViT
    "init_from": {"init_from": "some/vlm", "train.vision_pretrain_steps": 0},
    # adapters
    "train.lora.rank": {"train.lora.rank": 8, "init_from": "some/vlm", "train.vision_pretrain_steps": 0},
    "train.lora.quantize_base": {
        "train.lora.quantize_base": True,
        "train.lora.rank": 8,
        # a 4-bit base under adapters
        "init_from": "some/vlm",
        "train.vision_pretrain_steps": 0,
    },
}
TINY = load_run_config("configs/tiny.yaml", {})
LEAVES = {key: (value, annotation) for key, value, annotation in _leaf_fields(TINY)}


def _text(value: Any) -> str:
    """`value` as it is typed on the command line."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


def _get(config: Config, key: str) -> Any:
    for part in key.split("."):
        config = getattr(config, part)
    return config


def test_every_field_is_walked():
    assert len(LEAVES) > 60 and "tokenizer" in LEAVES and "model.language.pretrained" in LEAVES
    assert set(TINY_CHANGES) <= set(LEAVES) and YAML_ONLY <= set(LEAVES)


def test_a_list_of_sections_on_the_command_line_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"data.streams\[0\]: expected a mapping of fields"):
        load_run_config("configs/tiny.yaml", parse_overrides(["--data.streams", "shards/*.parquet"]))


# A list of sections, written in a YAML file (configs/nanovlm-222m-finevision.yaml), not on the command line.
YAML_ONLY = {"data.streams"}


@pytest.mark.parametrize("key", sorted(set(LEAVES) - YAML_ONLY))
def test_every_field_is_set_from_the_command_line(key):
    """`--key VALUE` with a value other than tiny.yaml's reaches the config, and changes nothing else."""
    value, annotation = LEAVES[key]
    changes = TINY_CHANGES.get(key, {key: _other_value(value, annotation)})
    assert changes[key] != value
    # both spellings: --key VALUE and --key=VALUE
    argv = [arg for i, (k, v) in enumerate(changes.items())
            for arg in ([f"--{k}", _text(v)] if i % 2 == 0 else [f"--{k}={_text(v)}"])]
    config = load_run_config("configs/tiny.yaml", parse_overrides(argv))
    for other, (original, _) in LEAVES.items():
        expected = changes.get(other, original)
        assert _get(config, other) == expected and type(_get(config, other)) is type(expected), other


@pytest.mark.parametrize("path",
                         ["configs/tiny.yaml", "configs/smollm2-shapes.yaml", "configs/nanovlm-222m.yaml",
                          "configs/tiny-stream.yaml"])
def test_shipped_configs_load(path):
    assert isinstance(load_run_config(path, {}), RunConfig)


def test_boolean_and_numeric_overrides_parse():
    argv = ["--train.compile", "false", "--train.max_steps=200", "--train.output_dir", "runs/try1",
            "--train.wandb", "true"]
    config = load_run_config("configs/tiny.yaml", parse_overrides(argv))
    assert config.train.compile is False and config.train.wandb is True
    assert config.train.max_steps == 200 and config.train.output_dir == "runs/try1"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--train.max_stepz", "3"], "unknown key train.max_stepz; valid keys: train.output_dir"),
        (["--trian.max_steps", "3"], "unknown key trian"),
        (["--train.max_steps", "many"], "train.max_steps: expected int, got 'many'"),
        (["--train.compile", "perhaps"], "train.compile: expected true or false"),
        (["--train.max_steps"], "--train.max_steps needs a value"),
        (["max_steps"], "unexpected argument 'max_steps'"),
        (
            ["--model.language.num_kv_heads", "3"],
            r"num_heads \(\d+\) must be divisible by language.num_kv_heads \(3\)",
        ),
        (
            [
                "--data.source",
                "jsonl",
                "--data.path",
                "x.jsonl",
                "--train.vision_pretrain_objective",
                "cells",
            ],
            r"vision_pretrain_objective=cells needs the scenes' labels.* use answers \(or auto\) for "
            r"data.source=jsonl",
        ),
        (
            ["--train.answer_pretrain_steps", "0"],
            "train.answer_pretrain_steps must be null or at least 1, got 0",
        ),
        (["--train.min_lr_tail_fraction", "1"], r"train.min_lr_tail_fraction must lie in \[0, 1\), got 1.0"),
        (
            ["--train.min_lr_tail_fraction", "-0.1"],
            r"train.min_lr_tail_fraction must lie in \[0, 1\), got -0.1",
        ),
        (
            ["--train.max_steps", "120"],
            r"train.min_lr_tail_fraction \(0.2\) ends the cosine at step 96 of train.max_steps "
            r"\(120\), before the warmup ends \(train.warmup_steps 100\): lower one of them or set "
            r"train.decay_steps",
        ),
        (
            ["--train.vision_pretrain_objective", "labels"],
            "train.vision_pretrain_objective: 'labels' is not one of 'auto', 'cells', 'answers'",
        ),
        (
            ["--model.vision.patch_size", "12"],
            r"the patch grid \(4x4\) must split evenly into the scenes' 3x3 cells",
        ),
        (
            ["--model.vision.image_size", "96"],
            r"model.vision.image_size \(96\) must equal data.shapes.image_size \(48\)",
        ),
    ],
)
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


@pytest.mark.parametrize(("overrides", "steps"), [
    ({}, 400),  # synthetic shapes: cells, vision_pretrain_steps
    ({"data.source": "jsonl", "data.path": "x.jsonl"}, 3000),  # any other source: answers, its own step count
    ({"train.vision_pretrain_objective": "answers"}, 3000),
    ({"data.source": "jsonl", "data.path": "x.jsonl", "train.answer_pretrain_steps": "null"}, 400),
    # 0 skips either
    ({"data.source": "jsonl", "data.path": "x.jsonl", "train.vision_pretrain_steps": "0"}, 0),
    # else, not used
    ({"data.source": "jsonl", "data.path": "x.jsonl", "train.vision_pretrain_steps": "100"}, 3000),
])
def test_the_vit_pretrains_for_its_objectives_steps(overrides, steps):
    assert load_run_config("configs/tiny.yaml", overrides).pretrain_steps() == steps


def test_the_streamed_tiny_default_is_the_tiny_default_streamed():
    """configs/tiny-stream.yaml (base: tiny.yaml): the same model and recipe, ViT pre-training included
    (cells, from the shards' labels), on the shards streamed."""
    tiny, streamed = (load_run_config(path, {}).to_dict() for path in ("configs/tiny.yaml",
                                                                         "configs/tiny-stream.yaml"))
    assert streamed["model"] == tiny["model"] and streamed["tokenizer"] == tiny["tokenizer"]
    changed = {key for key in tiny["train"] if streamed["train"][key] != tiny["train"][key]}
    assert changed == {"output_dir", "vision_pretrain_objective"}
    config = load_run_config("configs/tiny-stream.yaml", {})
    assert config.data.source == "stream" and config.data.holdout == config.data.shapes.num_validation
    assert config.vision_pretrain_objective() == "cells" and config.pretrain_steps() == 400


def test_a_base_config_is_merged_section_by_section(tmp_path):
    (tmp_path / "base.yaml").write_text("train: {max_steps: 7, seed: 3}\ndata: {holdout: 5}\n")
    (tmp_path / "run.yaml").write_text("base: base.yaml\ntrain: {seed: 4}\n")
    config = load_run_config(tmp_path / "run.yaml", {})
    assert (config.train.max_steps, config.train.seed, config.data.holdout) == (7, 4, 5)
    (tmp_path / "loop.yaml").write_text("base: loop.yaml\n")
    with pytest.raises(ConfigError, match="loop.yaml: its bases lead back to it"):
        load_run_config(tmp_path / "loop.yaml", {})


@pytest.mark.parametrize(("overrides", "message"), [
    ({"train.vision_pretrain_objective": "answers"},
     "the ViT's answers pre-training reads the records in memory"),
    ({"train.group_by_length": "true"}, "train.group_by_length reads the records in memory"),
])
def test_a_stream_refuses_what_reads_records_in_memory(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_run_config("configs/tiny-stream.yaml", overrides)


def test_packing_takes_its_choices_and_the_older_true_and_false(tmp_path):
    """train.packing: longest (the default), max_length (streams only: one line says what to write in
    memory) or off; true and false, as configs and checkpoints before the choice hold them, mean longest and
    off."""
    assert load_run_config("configs/tiny.yaml", {}).train.packing == "longest"
    for written, meant in (("true", "longest"), ("false", "off")):
        (tmp_path / "old.yaml").write_text(f"base: {Path('configs/tiny.yaml').resolve()}\n"
                                           f"train:\n  packing: {written}\n")
        assert load_run_config(tmp_path / "old.yaml", {}).train.packing == meant
    assert load_run_config("configs/tiny-stream.yaml", {"train.packing": "max_length"}).train.packing \
        == "max_length"
    with pytest.raises(ConfigError, match="train.packing=max_length packs streamed samples .*: use longest"):
        load_run_config("configs/tiny.yaml", {"train.packing": "max_length"})


def test_help_lists_every_setting_with_its_type_value_and_description(capsys):
    """`python train.py --help`: a line per setting of the run config, from the typed configs themselves."""
    from train import main

    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    lines = {
        line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.startswith("  --")
    }
    tiny = load_run_config("configs/tiny.yaml", {})
    for key, value, annotation in _leaf_fields(tiny):
        line = lines[f"--{key}"]
        kind, rest = line.split()[1], line.split("(= ", 1)[1]
        shown, description = rest.split(")  ", 1)
        assert json.loads(shown) == (list(value) if isinstance(value, tuple) else value), line
        assert len(description.split()) >= 2, line  # every field has its comment
        assert kind == {bool: "true|false", int: "int", float: "float"}.get(annotation, kind), line
        assert kind.endswith("|null") == (type(None) in typing.get_args(annotation)), line  # if it may be
    assert len(lines) == len(list(_leaf_fields(tiny))) + 3  # and --config, --resume, --check-data


def test_field_comments_are_a_fields_own_line_or_the_block_above():
    @dataclasses.dataclass
    class Example(Config):
        plain: int = 1  # the comment on its line
        # a comment above,
        # over two lines
        above: str = "a"
        bare: bool = False

    assert field_comments(Example) == {"plain": "the comment on its line",
                                       "above": "a comment above, over two lines", "bare": ""}
