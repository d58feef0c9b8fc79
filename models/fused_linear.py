"""Linear layers that read the same input, fused into one matmul for inference: fewer and larger kernels per
block (gpt-fast's wqkv, vLLM's QKVParallelLinear). The owner's state dict still holds the separate layers'
tensors under their own names (its hooks split and join them), so saving, exporting and loading see the
layout the checkpoints have, and training (LoRA's adapters included) sees the separate layers.

    fuse_projections(model)                      # every q/k/v and gate/up of the model, for inference
    q, k, v = project(block.attn, x, "qkv_proj")   # fused or not

Why fused at inference, and only there: on an H100 the fused projections take 3 kernels a layer and 14% off a
batch-1 decode step (1.60 -> 1.38 ms, benchmarks/results/fast-paths-cuda.md), so every inference entry point
fuses (loading.load_for_inference: generate.py, the server, lmms-eval). Fused always would cost what users
have: peft's LoRA targets q_proj / k_proj / v_proj, and adapters trained on transformers' Llama load here with
their logits; so training, LoRA and every loader and exporter see the separate layers (the state-dict hooks).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


# The parts' rows stacked in one weight (and bias); the output split back into the parts' outputs.
class FusedLinear(nn.Linear):
    def __init__(self, parts: dict[str, nn.Linear]) -> None:
        layers = list(parts.values())
        first = layers[0]
        if any(type(layer) is not nn.Linear or layer.in_features != first.in_features
               or (layer.bias is None) != (first.bias is None) for layer in layers):
            found = ", ".join(f"{part} {type(layer).__module__}.{type(layer).__name__}"
                              for part, layer in parts.items())
            raise ValueError(f"only plain nn.Linear layers on one input fuse (not adapted or quantized "
                             f"ones): {found}")
        super().__init__(first.in_features, sum(layer.out_features for layer in layers),
                         bias=first.bias is not None, device=first.weight.device, dtype=first.weight.dtype)
        with torch.no_grad():
            self.weight.copy_(torch.cat([layer.weight for layer in layers]))
            if self.bias is not None:
                self.bias.copy_(torch.cat([layer.bias for layer in layers]))
        self.requires_grad_(first.weight.requires_grad)
        self.parts = {part: layer.out_features for part, layer in parts.items()}  # in output order

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        return self.split(super().forward(x))

    def split(self, out: Tensor) -> tuple[Tensor, ...]:
        """The fused matmul's output as the parts' outputs."""
        return out.split(list(self.parts.values()), dim=-1)


def _fused_children(owner: nn.Module) -> list[tuple[str, FusedLinear]]:
    return [(name, child) for name, child in owner.named_children() if isinstance(child, FusedLinear)]


def _split_parts(owner: nn.Module, state: dict, prefix: str, _metadata) -> None:
    """State-dict hook: each fused layer's tensors (its weight and bias, or a quantized weight's integers and
    scales: models/quantize.py; each with a row an output) written as its parts' (copies: no views of one
    another), in the owner's order. The owner's entries are the last ones written, so they are taken out and
    put back."""
    fused = {f"{prefix}{name}.": child for name, child in _fused_children(owner)}
    owned = {key: state.pop(key) for key in [key for key in state if key.startswith(prefix)]}
    for key, tensor in owned.items():
        layer_prefix = next((p for p in fused if key.startswith(p)), None)
        if layer_prefix is None:
            state[key] = tensor
        elif key == next(k for k in owned if k.startswith(layer_prefix)):  # each part's, as separate layers
            sizes = list(fused[layer_prefix].parts.values())
            pieces = {k.removeprefix(layer_prefix): t.split(sizes) for k, t in owned.items()
                      if k.startswith(layer_prefix)}
            for i, part in enumerate(fused[layer_prefix].parts):
                for name, split in pieces.items():
                    state[f"{prefix}{part}.{name}"] = split[i].clone()


def _join_parts(owner: nn.Module, state: dict, prefix: str, *_) -> None:
    """Load hook: the parts' tensors, where a state dict holds them all, read as the fused ones."""
    for name, fused in _fused_children(owner):
        first = f"{prefix}{next(iter(fused.parts))}."
        for entry in [key.removeprefix(first) for key in state if key.startswith(first)]:
            keys = [f"{prefix}{part}.{entry}" for part in fused.parts]
            if all(key in state for key in keys):
                state[f"{prefix}{name}.{entry}"] = torch.cat([state.pop(key) for key in keys])


FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def fuse_projections(model: nn.Module) -> None:
    """Every module of `model` whose children include all of a fused layer's parts gets that fused layer."""
    for owner in list(model.modules()):
        for name, parts in FUSED.items():
            if all(part in owner._modules for part in parts):
                fuse(owner, name, parts)


def fuse(owner: nn.Module, name: str, parts: tuple[str, ...]) -> None:
    """Replace `owner`'s linear layers `parts` with one FusedLinear called `name` (no-op if already fused)."""
    if name in owner._modules:
        return
    if not _fused_children(owner):
        owner.register_state_dict_post_hook(_split_parts)
        owner.register_load_state_dict_pre_hook(_join_parts)
    layer = FusedLinear({part: getattr(owner, part) for part in parts})
    # in the first part's place, so that the state dict keeps the separate layers' order
    children = [(name, layer) if child == parts[0] else (child, module)
                for child, module in owner._modules.items() if child not in parts[1:]]
    owner._modules.clear()
    owner._modules.update(children)


def project(owner: nn.Module, x: Tensor, name: str) -> tuple[Tensor, ...]:
    """Each of the fused layer `name`'s parts' outputs for `x`: from that layer where `owner` has one, else
    layer by layer."""
    fused = owner._modules.get(name)
    return fused(x) if fused is not None else tuple(getattr(owner, part)(x) for part in FUSED[name])
