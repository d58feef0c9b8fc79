"""The optimiser recipe: one learning rate per part times the schedule, lr 0 freezes a part, AdamW's decoupled
weight decay on matrices only, linear warmup then cosine decay to min_lr_ratio over decay_steps (or, when 0,
all but min_lr_tail_fraction of max_steps)."""

import copy
import dataclasses
import math

import pytest
import torch
from safetensors.torch import load_file

from tests.models.helpers import tiny_vlm
from tests.training.helpers import small_config
from training import run
from training.config import TrainConfig, load_run_config
from training.optim import build_optimizer, build_scheduler, lr_factor

PARTS = ("projector", "vision", "language")
RECIPE = {"lr_projector": 3e-3, "lr_vision": 5e-4, "lr_language": 1e-3, "weight_decay": 0.1,
          "warmup_steps": 4, "max_steps": 40, "min_lr_ratio": 0.2}


def expected_factor(step: int, warmup: int, decay_steps: int, min_ratio: float) -> float:
    """The schedule written out in float64: (step + 1) / warmup during warmup, then cosine from 1 to
    min_ratio."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / (decay_steps - warmup))
    return min_ratio + (1.0 - min_ratio) * (1.0 + math.cos(math.pi * progress)) / 2.0


def _groups_by_name(optimizer: torch.optim.Optimizer) -> dict[str, dict]:
    return {group["name"]: group for group in optimizer.param_groups}


def test_each_part_gets_its_own_groups_and_decay_goes_to_matrices_only():
    model, config = tiny_vlm(), TrainConfig(**RECIPE)
    groups = _groups_by_name(build_optimizer(model, config, torch.device("cpu")))
    expected = {}
    for part in PARTS:
        params = list(getattr(model, part).parameters())
        expected[f"{part}.decay"] = {id(p) for p in params if p.dim() >= 2}
        expected[f"{part}.no_decay"] = {id(p) for p in params if p.dim() < 2}
    # an empty group is left out (the tiny projector has no bias); norms' gains and biases fill the others
    assert sorted(groups) == sorted(name for name, ids in expected.items() if ids)
    assert {"vision.no_decay", "language.no_decay"} <= set(groups)
    for name, group in groups.items():
        part, kind = name.split(".")
        assert {id(p) for p in group["params"]} == expected[name], name
        assert group["weight_decay"] == (RECIPE["weight_decay"] if kind == "decay" else 0.0), name
        assert group["lr"] == RECIPE[f"lr_{part}"], name  # before a scheduler sets the factor


@pytest.mark.parametrize("decay_steps", [0, 25], ids=["max_steps", "decay_steps"])
def test_each_groups_lr_is_its_parts_lr_times_the_schedule(decay_steps):
    """Warmup to step 4, cosine to min_lr_ratio at decay_steps (max_steps when 0), then flat at
    min_lr_ratio."""
    config = TrainConfig(**RECIPE, decay_steps=decay_steps)
    optimizer = build_optimizer(tiny_vlm(), config, torch.device("cpu"))
    scheduler = build_scheduler(optimizer, config)
    end = decay_steps or config.max_steps
    for step in range(config.max_steps + 5):
        factor = expected_factor(step, config.warmup_steps, end, config.min_lr_ratio)
        assert lr_factor(step, config) == pytest.approx(factor, rel=1e-12, abs=1e-15), step
        for group in optimizer.param_groups:
            part = group["name"].split(".")[0]
            assert group["lr"] == pytest.approx(RECIPE[f"lr_{part}"] * factor, rel=1e-12), (
                step,
                group["name"],
            )
        optimizer.step()  # no gradients: nothing moves, but LambdaLR wants the optimizer to step first
        scheduler.step()
    # landmarks: warmup ends at 1, then min_lr_ratio from the end of the decay on
    assert lr_factor(config.warmup_steps, config) == 1.0
    assert [lr_factor(s, config) for s in (end, end + 1, end + 100)] == pytest.approx([0.2] * 3, abs=1e-15)
    # a scheduler built at step 7 (a resumed run) starts from that step's factor
    resumed = build_optimizer(tiny_vlm(), config, torch.device("cpu"))
    build_scheduler(resumed, config, step=7)
    for group in resumed.param_groups:
        part = group["name"].split(".")[0]
        assert group["lr"] == pytest.approx(RECIPE[f"lr_{part}"] * expected_factor(7, 4, end, 0.2), rel=1e-12)


def test_decay_steps_stops_the_cosine_before_max_steps():
    config = TrainConfig(**{**RECIPE, "max_steps": 100}, decay_steps=20)
    assert lr_factor(19, config) > config.min_lr_ratio
    assert all(
        lr_factor(step, config) == pytest.approx(config.min_lr_ratio, abs=1e-15) for step in range(20, 100)
    )
    assert lr_factor(12, config) == pytest.approx(expected_factor(12, 4, 20, 0.2), rel=1e-12)


@pytest.mark.parametrize("max_steps, end", [(100, 75), (41, 31), (43, 32), (10, 8)])
def test_min_lr_tail_fraction_ends_the_cosine_that_share_of_max_steps_early(max_steps, end):
    """With decay_steps 0, the cosine ends at the step nearest max_steps x (1 - min_lr_tail_fraction) (30.75,
    32.25, 7.5) and stays at min_lr_ratio."""
    config = TrainConfig(**{**RECIPE, "max_steps": max_steps, "min_lr_tail_fraction": 0.25})
    for step in range(max_steps + 3):
        assert lr_factor(step, config) == pytest.approx(
            expected_factor(step, 4, end, 0.2), rel=1e-12, abs=1e-15
        ), step
    assert lr_factor(end - 1, config) > config.min_lr_ratio


def test_decay_steps_when_set_overrides_min_lr_tail_fraction():
    """A run that stops early and resumes keeps its schedule by decay_steps, whatever max_steps and the share
    say."""
    config = TrainConfig(**{**RECIPE, "max_steps": 100, "min_lr_tail_fraction": 0.5}, decay_steps=20)
    without_share = dataclasses.replace(config, min_lr_tail_fraction=0)
    assert [lr_factor(s, config) for s in range(100)] == [lr_factor(s, without_share) for s in range(100)]


def test_the_tiny_default_schedule_keeps_its_shape_when_shortened():
    """configs/tiny.yaml: cosine to step 4,000 of 5,000, then flat, exactly as `decay_steps: 4000` wrote it;
    shortened to 200 steps (and the warmup to 10), it ends the cosine at step 160 (with decay_steps 4000, a
    shortened run stayed on the cosine's first half unless decay_steps was shortened too)."""
    tiny = load_run_config("configs/tiny.yaml", {}).train
    absolute = dataclasses.replace(tiny, min_lr_tail_fraction=0.0, decay_steps=4000)
    assert [lr_factor(s, tiny) for s in range(5000)] == [lr_factor(s, absolute) for s in range(5000)]
    short = load_run_config("configs/tiny.yaml", {"train.max_steps": "200", "train.warmup_steps": "10"}).train
    assert lr_factor(159, short) > short.min_lr_ratio
    assert all(lr_factor(s, short) == pytest.approx(short.min_lr_ratio, abs=1e-15) for s in range(160, 200))


def test_one_adamw_step_decays_matrices_but_not_biases_or_norms():
    """A float64 model, one step with known gradients, against AdamW written out: at step 1, m_hat = g and
    v_hat = g^2, so p <- p - lr * wd * p - lr * g / (|g| + eps) for matrices, without the decay term
    elsewhere."""
    model = tiny_vlm().double()
    config = TrainConfig(**{**RECIPE, "weight_decay": 0.3})
    optimizer = build_optimizer(model, config, torch.device("cpu"))
    build_scheduler(optimizer, config)
    generator = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=generator, dtype=torch.float64)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer.step()
    factor, eps = expected_factor(0, 4, 40, 0.2), 1e-8
    checked = {"matrix": 0, "vector": 0}
    for name, p in model.named_parameters():
        part = name.split(".")[0]
        lr, old, grad = RECIPE[f"lr_{part}"] * factor, before[name], p.grad
        decay = config.weight_decay if p.dim() >= 2 else 0.0
        expected = old - lr * decay * old - lr * grad / (grad.abs() + eps)
        torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-15,
                                   msg=lambda m, name=name: f"{name}: {m}")
        checked["matrix" if p.dim() >= 2 else "vector"] += 1
    assert checked["matrix"] > 0 and checked["vector"] > 0


def test_a_zero_learning_rate_freezes_its_part(tmp_path, monkeypatch):
    """lr_vision 0: the ViT is in no param group, and after real training steps its weights are bit-identical
    to what they were when the optimizer was built; the other parts did train."""
    seen = {}

    def spy(model, config, device):
        seen["initial"] = copy.deepcopy(model.state_dict())
        seen["optimizer"] = optimizer = build_optimizer(model, config, device)
        seen["vision"] = {id(p) for p in model.vision.parameters()}
        return optimizer

    monkeypatch.setattr(run, "build_optimizer", spy)
    run.train(small_config(tmp_path,
                           **{"train.lr_vision": "0", "train.max_steps": "3", "train.save_every": "3",
                              "train.eval_every": "3"}))
    optimizer = seen["optimizer"]
    assert all(not group["name"].startswith("vision.") for group in optimizer.param_groups)
    assert not seen["vision"] & {id(p) for group in optimizer.param_groups for p in group["params"]}
    trained = load_file(tmp_path / "step_000003" / "model.safetensors")
    vision = [name for name in trained if name.startswith("vision.")]
    changed = [name for name in vision if not torch.equal(trained[name], seen["initial"][name])]
    assert vision and not changed, changed
    for part in ("projector", "language"):
        assert any(
            not torch.equal(trained[n], seen["initial"][n]) for n in trained if n.startswith(f"{part}.")
        ), part
