"""The synthetic shapes set written as parquet shards (data/shards.py): the in-memory records, validation
first, each with its scene's labels, which name what the caption describes."""

import numpy as np
import pytest

from data.bad_records import checked_record
from data.shards import write_synthetic_shards
from data.streaming import Source, StreamConfig
from data.synthetic import (
    CELL_CLASSES,
    SHAPES,
    Item,
    ShapesConfig,
    describe,
    make_shapes_dataset,
    shapes_datasets,
)
from training.write_shards import main

SHAPES_CONFIG = ShapesConfig(image_size=32, num_train=24, num_validation=6, train_turns=1,
                             train_question_types=("color", "caption", "presence"))


def _rows(directory) -> list[dict]:
    source = Source.open(StreamConfig(files=str(directory / "*.parquet")))
    return [checked_record(source.record(row)) for _, row in source.rows()]


def test_the_shards_hold_the_in_memory_records_validation_first(tmp_path):
    keys = write_synthetic_shards(tmp_path, SHAPES_CONFIG, files=2, rows_per_group=4)
    train, validation = shapes_datasets(SHAPES_CONFIG)
    rows, expected = _rows(tmp_path), [*validation, *train]
    assert len(keys) == len(rows) == len(expected) == 30
    for row, record in zip(rows, expected):
        assert row["texts"] == record["texts"] and row["question_type"] == record["question_type"]
        assert np.array_equal(np.asarray(row["images"][0]), np.asarray(record["images"][0]))


def test_each_rows_labels_name_the_scene_its_caption_describes(tmp_path):
    captions = ShapesConfig(image_size=32, num_train=20, num_validation=4, train_turns=1,
                            train_question_types=("caption",))
    write_synthetic_shards(tmp_path, captions, files=1, rows_per_group=8)
    rows = _rows(tmp_path)
    for row in rows[captions.num_validation:]:
        scene = tuple(Item(cell, *(CELL_CLASSES[name][label] for name, label in zip(CELL_CLASSES, labels)))
                      for cell, labels in enumerate(row["cell_labels"]) if labels[0])
        assert scene and all(item.shape in SHAPES for item in scene)
        assert describe(scene) == row["texts"][0]["assistant"]


def test_labels_leave_the_records_as_they_were():
    common = dict(split="train", num_samples=12, seed=3, image_size=32)
    plain, labelled = make_shapes_dataset(**common), make_shapes_dataset(**common, labels=True)
    assert labelled.column_names == [*plain.column_names, "cell_labels"]
    assert plain.data.table == labelled.remove_columns("cell_labels").data.table


def test_the_command_writes_a_configs_set(tmp_path, capsys):
    assert main([str(tmp_path), "--config", "configs/tiny.yaml", "--files", "2", "--rows-per-group", "5",
                 "--data.shapes.num_train", "12", "--data.shapes.num_validation", "3"]) == 0
    assert "data.holdout 3" in capsys.readouterr().out
    assert len(_rows(tmp_path)) == 15 and len(list(tmp_path.glob("*.parquet"))) == 2


@pytest.mark.parametrize("argv, message", [
    (["--files", "0"], "--files and --rows-per-group must be at least 1"),
    (["--data.shapes.num_train", "0"], "num_train"),
])
def test_the_command_refuses_bad_input_in_one_line(tmp_path, capsys, argv, message):
    assert main([str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
