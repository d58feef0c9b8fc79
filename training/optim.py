"""AdamW with one learning rate per part (projector, vision, language), decay on matrices only; warmup + cosine."""

from __future__ import annotations

import math

import torch
from torch import nn

from training.config import TrainConfig


def learning_rates(config: TrainConfig) -> dict[str, float]:
    return {"projector": config.lr_projector, "vision": config.lr_vision, "language": config.lr_language}


def freeze_parts(model: nn.Module, config: TrainConfig) -> None:
    """Parts with a learning rate of 0 are frozen (requires_grad=False); call before DDP / FSDP2 wrap the model."""
    for part, lr in learning_rates(config).items():
        for p in getattr(model, part).parameters():
            p.requires_grad_(lr > 0)


def build_optimizer(model: nn.Module, config: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW over the parts that train (see `freeze_parts`), weight decay on matrices only."""
    groups = []
    for part, lr in learning_rates(config).items():
        if lr == 0:
            continue
        unique = list({id(p): p for p in getattr(model, part).parameters()}.values())  # tied weights once
        decay = [p for p in unique if p.dim() >= 2]
        no_decay = [p for p in unique if p.dim() < 2]
        groups.append({"name": f"{part}.decay", "params": decay, "lr": lr, "weight_decay": config.weight_decay})
        groups.append({"name": f"{part}.no_decay", "params": no_decay, "lr": lr, "weight_decay": 0.0})
    groups = [g for g in groups if g["params"]]
    return torch.optim.AdamW(groups, betas=(0.9, config.adam_beta2), fused=device.type == "cuda")


def lr_factor(step: int, config: TrainConfig) -> float:
    """Linear warmup to 1, then cosine decay to min_lr_ratio at decay_steps (or max_steps)."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    decay_steps = config.decay_steps or config.max_steps
    progress = min(1.0, (step - config.warmup_steps) / max(1, decay_steps - config.warmup_steps))
    return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, config: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, config))
