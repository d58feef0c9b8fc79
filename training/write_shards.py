"""A config's synthetic shapes set (`data.shapes`) written as parquet shards (data/shards.py), validation rows
first, to train on streamed (configs/tiny-stream.yaml, docs/streaming.md):

    python -m training.write_shards runs/shards/tiny --config configs/tiny.yaml
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from data.shards import write_synthetic_shards
from training.config import load_run_config, parse_overrides
from typed_config import ConfigError


def main(argv: list[str] | None = None) -> int:
    """`python -m training.write_shards DIRECTORY [--config CONFIG] [--files N] [--rows-per-group N]
    [--data.shapes.FIELD VALUE ...]`: a config's synthetic shapes set written as parquet shards."""
    parser = argparse.ArgumentParser(
        prog="python -m training.write_shards",
        description="Write a config's synthetic shapes set (data.shapes) as parquet shards, validation rows "
        "first.")
    parser.add_argument("directory", type=Path)
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--rows-per-group", type=int, default=500)
    arguments, overrides = parser.parse_known_args(argv)
    try:
        config = load_run_config(arguments.config, parse_overrides(overrides))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if arguments.files < 1 or arguments.rows_per_group < 1:
        print("error: --files and --rows-per-group must be at least 1", file=sys.stderr)
        return 2
    shapes = config.data.shapes
    keys = write_synthetic_shards(arguments.directory, shapes, arguments.files, arguments.rows_per_group)
    print(f"{len(keys)} records ({shapes.num_validation} validation first, then {shapes.num_train} train) in "
          f"{arguments.files} files under {arguments.directory}: train with data.holdout "
          f"{shapes.num_validation}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
