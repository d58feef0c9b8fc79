"""AdamW with one learning rate per part (projector, vision, language), decay on matrices only;
warmup + cosine."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from training.config import TrainConfig
from typed_config import check

BETA1 = 0.9


def learning_rates(config: TrainConfig) -> dict[str, float]:
    return {"projector": config.lr_projector, "vision": config.lr_vision, "language": config.lr_language}


def freeze_parts(model: nn.Module, config: TrainConfig) -> None:
    """Parts with a learning rate of 0 are frozen (requires_grad=False); call before DDP / FSDP2 wrap the
    model."""
    for part, lr in learning_rates(config).items():
        for p in getattr(model, part).parameters():
            p.requires_grad_(lr > 0)


def check_same_parts(before: TrainConfig, after: TrainConfig) -> None:
    """A resumed run trains the parts its checkpoint trained: a part frozen (lr 0) has no optimizer state, and
    one that trained cannot leave the optimizer whose state holds it."""
    for (part, old), new in zip(learning_rates(before).items(), learning_rates(after).values()):
        check((old > 0) == (new > 0),
              f"train.lr_{part} cannot change from {old:g} to {new:g} on resume: it would "
              f"{'freeze' if old else 'unfreeze'} the {part}; keep it {'above' if old else 'at'} 0, or start "
              "a new run")


def group_settings(name: str, config: TrainConfig) -> dict[str, Any]:
    """Learning rate, weight decay and betas of the param group `name` (`<part>.decay` or
    `<part>.no_decay`)."""
    part, kind = name.split(".")
    return {"lr": learning_rates(config)[part],
            "weight_decay": config.weight_decay if kind == "decay" else 0.0,
            "betas": (BETA1, config.adam_beta2)}


def build_optimizer(model: nn.Module, config: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW over the parts that train (see `freeze_parts`), weight decay on matrices only."""
    groups = []
    for part, lr in learning_rates(config).items():
        if lr == 0:
            continue
        # tied weights once; with adapters (models/lora.py) only they train
        unique = [
            p for p in {id(p): p for p in getattr(model, part).parameters()}.values() if p.requires_grad
        ]
        groups.append({"name": f"{part}.decay", "params": [p for p in unique if p.dim() >= 2]})
        groups.append({"name": f"{part}.no_decay", "params": [p for p in unique if p.dim() < 2]})
    groups = [{**g, **group_settings(g["name"], config)} for g in groups if g["params"]]
    return torch.optim.AdamW(groups, fused=device.type == "cuda")


def lr_factor(step: int, config: TrainConfig) -> float:
    """Linear warmup to 1, then cosine decay to min_lr_ratio at `config.cosine_end()`, flat after."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    progress = min(1.0, (step - config.warmup_steps) / max(1, config.cosine_end() - config.warmup_steps))
    return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, config: TrainConfig,
                    step: int = 0) -> torch.optim.lr_scheduler.LambdaLR:
    """Each group's lr is `lr_factor(step, config)` x its part's lr: a function of the config and the step
    alone.

    Every group's learning rate, weight decay and betas are (re)set from `config`, so a run resumed at `step`
    (after its optimizer state was loaded) follows its new config from there, as a fresh run of that config
    would.
    """
    for group in optimizer.param_groups:
        settings = group_settings(group["name"], config)
        group.update(initial_lr=settings["lr"], weight_decay=settings["weight_decay"],
                     betas=settings["betas"])
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, config), last_epoch=step - 1)
