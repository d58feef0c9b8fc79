"""Progress by the clock (a fake one here): a run says what it does as it starts each part, and while a part
lasts, a line every ~10 s: the start-up's parts from a thread, the ViT's pre-training between its steps."""

import threading

import pytest
import torch

from data import build_datasets
from tests.training.helpers import small_config
from training import progress, run
from training.vision_pretraining import Pretraining


class Clock:
    """A clock that moves only when told."""

    def __init__(self) -> None:
        self.time = 0.0

    def __call__(self) -> float:
        return self.time


@pytest.fixture
def clock(monkeypatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(progress, "now", fake)
    return fake


def test_every_is_due_once_per_interval(clock):
    every = progress.Every(10)
    due = []
    for t in (3, 9.9, 10, 12, 19.9, 20.5, 45, 46):
        clock.time = t
        due.append(every.due())
    assert due == [False, False, True, False, False, True, True, False]


def test_a_phase_says_it_started_and_that_it_still_runs_every_10_s(clock, monkeypatch):
    """Its thread says so while the work (here: the test) holds the main thread; nothing once it ended."""
    monkeypatch.setattr(progress, "POLL_S", 0.001)
    lines, said = [], threading.Semaphore(0)

    def say(line):
        lines.append(line)
        said.release()

    with progress.Phase("reading the data", say) as phase:
        assert said.acquire(timeout=60)  # the opening line
        for t in (10, 15, 25):  # a line once the clock passed 10 s, none at 15, one at 25
            clock.time = t
            if t != 15:
                assert said.acquire(timeout=60)
        phase.end()
        clock.time = 100
    assert lines == ["reading the data ...", "reading the data ... (10 s)", "reading the data ... (25 s)"]
    with progress.Phase("the first step", say, announce=False):
        clock.time = 115
        assert said.acquire(timeout=60)
    assert lines[3:] == ["the first step ... (15 s)"]


def test_vision_pretraining_reports_every_10_s_and_at_its_last_step(clock):
    """Each step takes 4 s of the fake clock: a line at steps 3, 6, 9 (12, 24, 36 s) and at the last, 10."""
    weight = torch.nn.Parameter(torch.ones(2))
    head = torch.nn.Linear(2, 2)

    def batch_loss():
        clock.time += 4
        return (weight ** 2).sum() + head(weight).sum()

    class Draws:
        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    pretraining = Pretraining(batch_loss, head, torch.optim.AdamW([weight, *head.parameters()]), Draws(), 10)
    lines = []
    assert pretraining.run(lines.append)
    assert [line.split(":")[0] for line in lines] == [f"vision pre-training step {step}/10"
                                                       for step in (3, 6, 9, 10)]
    assert lines[-1].endswith(f"loss {pretraining.loss_history()[-1]:.4f}")


def test_a_run_says_what_it_does_before_it_reads_the_data_and_builds_the_model(tmp_path, capsys, monkeypatch):
    """The first lines come before the first long parts (reading the tiny default's data took ~20 s)."""
    seen = {}

    def read(config):
        seen["reading"] = capsys.readouterr().out
        return build_datasets(config)

    def build(*args):
        seen["building"] = capsys.readouterr().out
        raise KeyboardInterrupt  # enough seen

    monkeypatch.setattr(run, "build_datasets", read)
    monkeypatch.setattr(run, "model_and_processor", build)
    with pytest.raises(KeyboardInterrupt):
        run.train(small_config(tmp_path))
    assert seen["reading"].splitlines() == ["reading the data (data.source synthetic) ..."]
    assert seen["building"].splitlines() == ["building the tokenizer and the model ..."]
