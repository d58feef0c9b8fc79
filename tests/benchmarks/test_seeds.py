"""benchmarks/seeds.py --collect: the table of finished runs (their metrics.json, and the seed and threads of
their last checkpoint's config) has each run's numbers and the min / median / max of each column."""

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# What each fake run's metrics.json holds (3 decimals, as the table prints them); the third run has no
# caption score, so that column is left out.
RUNS = {
    3: {"accuracy": 0.5, "accuracy/color": 0.25, "accuracy/caption": 0.125, "validation_loss": 0.75},
    1: {"accuracy": 0.875, "accuracy/color": 1.0, "accuracy/caption": 0.5, "validation_loss": 0.375},
    4: {"accuracy": 0.625, "accuracy/color": 0.5, "validation_loss": 0.25},
}


def _load_benchmark():
    spec = importlib.util.spec_from_file_location("seeds_benchmark", ROOT / "benchmarks" / "seeds.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write_run(run: Path, seed: int, metrics: dict, step: int = 40) -> None:
    """A finished run as train.py leaves it: metrics.json and its last checkpoint's run_config.json (an
    earlier checkpoint with another seed must not be read)."""
    for at, at_seed in ((step // 2, seed + 100), (step, seed)):
        checkpoint = run / f"step_{at:06d}"
        checkpoint.mkdir(parents=True)
        (checkpoint / "run_config.json").write_text(json.dumps({"train": {"seed": at_seed,
                                                                          "num_threads": 1}}))
    (run / "metrics.json").write_text(json.dumps({"step": step, "train_loss": 0.5, **metrics}))


def test_collect_tables_the_runs_written(tmp_path, monkeypatch, capsys):
    runs = []
    for seed, metrics in RUNS.items():
        runs.append(tmp_path / f"run{seed}")
        _write_run(runs[-1], seed, metrics)
    out = tmp_path / "results"
    monkeypatch.setattr(sys, "argv", ["seeds.py", "--config", "configs/tiny-stream.yaml", "--out", str(out),
                                      "--collect", *map(str, runs)])
    _load_benchmark().main()
    printed = capsys.readouterr().out.strip().splitlines()
    assert (out / "seeds-tiny-stream.md").read_text().strip().splitlines() == printed
    header = [cell.strip() for cell in printed[2].strip("|").split("|")]
    assert header == ["run", "accuracy", "color", "validation_loss"]  # caption: not every run has it
    cells = {line.split("|")[1].strip(): [float(cell) for cell in line.strip("|").split("|")[1:]]
             for line in printed[4:]}
    columns = ["accuracy", "accuracy/color", "validation_loss"]
    for seed, metrics in RUNS.items():
        assert cells[f"seed {seed}, 1 thr"] == [metrics[column] for column in columns]
    # the reference: sorted by hand, the middle one of three
    by_column = [sorted(metrics[column] for metrics in RUNS.values()) for column in columns]
    assert cells["**min**"] == [values[0] for values in by_column]
    assert cells["**median**"] == [values[1] for values in by_column]
    assert cells["**max**"] == [values[2] for values in by_column]
    saved = json.loads((out / "seeds-tiny-stream.json").read_text())
    assert [(row["seed"], row["threads"], row["accuracy"]) for row in saved["rows"]] == \
        [(seed, 1, metrics["accuracy"]) for seed, metrics in RUNS.items()]
