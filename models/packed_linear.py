"""Linear layers computed through oneDNN with their weights reordered once into its blocked layout, for
inference on a CPU (what Inductor's CPU freezing does to a frozen graph's linears).

At the tens of rows of a serving engine's decode step MKL's matmul repacks the plain weight on every call; the
prepacked weight does not. On a 2-core AMD EPYC (AVX2) the linears of SmolLM2-135M at 34 rows ran 1.9x
faster, their 49k-column head 2x (benchmarks/results/serving-cpu.md). A row's result does not depend on how
many rows run with it (MKL's does, below 8 rows), and differs from MKL's by float32 rounding.

    packed = PackedLinears(model.language)  # a packed copy of every plain linear weight: as much memory again
    with packed:                            # in it those layers compute through oneDNN (no autograd)
        hidden, _ = model.language(embeddings, kv_cache=cache)
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from models.fused_linear import FusedLinear

PACKABLE = (nn.Linear, FusedLinear)  # these types exactly: subclasses (bitsandbytes' 4-bit) keep theirs
ROWS_HINT = 64  # the batch size oneDNN picks its blocked layout for (any number of rows runs on it)


def packing_available(weight: Tensor) -> bool:
    """Whether oneDNN can take this weight: float32 on a CPU, in a torch built with oneDNN."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class PackedLinears:
    """The plain linear layers under `module`, with a packed copy of each weight made on first use and made
    again when the weight has changed since (a new tensor, or an in-place update: an optimizer step, a loaded
    state dict). Entering routes their forward through the packed copies; leaving restores it."""

    def __init__(self, module: nn.Module) -> None:
        self.layers = [layer for layer in module.modules()
                       if type(layer) in PACKABLE and packing_available(layer.weight)]
        self.packed: dict[nn.Module, tuple[Tensor, int, Tensor]] = {}  # weight, its version, packed copy

    def __enter__(self) -> PackedLinears:
        for layer in self.layers:
            layer.forward = _packed_forward(layer, self._packed_weight(layer))
        return self

    def __exit__(self, *exc) -> None:
        for layer in self.layers:
            del layer.forward  # the class's forward again

    def _packed_weight(self, layer: nn.Linear) -> Tensor:
        weight, version, packed = self.packed.get(layer, (None, -1, None))
        if weight is not layer.weight or version != layer.weight._version:
            packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), ROWS_HINT)
            self.packed[layer] = (layer.weight, layer.weight._version, packed)
        return packed


def _packed_forward(layer: nn.Linear, packed: Tensor):
    parts = list(layer.parts.values()) if isinstance(layer, FusedLinear) else None

    def forward(x: Tensor) -> Tensor | tuple[Tensor, ...]:
        if torch.is_grad_enabled() or x.dtype != packed.dtype:  # a backward pass, autocast: the plain matmul
            return type(layer).forward(layer, x)
        out = torch.ops.mkldnn._linear_pointwise(x, packed, layer.bias, "none", [], "")
        return out if parts is None else out.split(parts, dim=-1)

    return forward
