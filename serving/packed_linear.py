"""Linear layers computed through oneDNN with their weights reordered once into its blocked layout, for
inference on a CPU (what Inductor's CPU freezing does to a frozen graph's linears).

At the tens of rows of a serving engine's decode step MKL's matmul repacks the plain weight on every call; the
prepacked weight does not. On a 2-core AMD EPYC (AVX2) a decode step's linears for SmolLM2-135M at 34 rows,
weights read from memory, took 99 ms instead of 189 ms (1.9x), the 49k-column head alone 2x. Results differ
from MKL's by float32 rounding; on that CPU a row's result also did not depend on how many
rows ran with it (MKL's does, below 8 rows).

    packed = PackedLinears(model.language)  # a packed copy of every plain linear weight: as much memory again
    with packed:                            # in it those layers compute through oneDNN (no autograd)
        hidden, _ = model.language(embeddings, kv_cache=cache)
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from torch import Tensor, nn

from models.fused_linear import FusedLinear

PACKABLE = (nn.Linear, FusedLinear)  # these types exactly: subclasses (bitsandbytes' 4-bit) keep theirs
ROWS_HINT = 64  # the batch size oneDNN picks its blocked layout for (any number of rows runs on it)


def onednn_available() -> bool:
    """Whether this torch build has oneDNN's linear with prepacked weights."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def packing_available(weight: Tensor) -> bool:
    """Whether oneDNN can take this weight: float32 on a CPU, in a torch built with oneDNN."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and onednn_available()


class PackedLinears:
    """The plain linear layers under `module`. Entering routes their forward, in the entering thread, through
    a packed copy of each weight (made at the first entry, and again at an entry that finds a new weight
    tensor or one updated in place since: an optimizer step, a loaded state dict; writes through `.data`,
    as peft's merge does, bump no version and go unseen: make a new PackedLinears after them). Leaving puts
    their forward back. Layers that already have a forward of their own on the instance (another
    PackedLinears' entered on them, a hook library's) are left to it."""

    def __init__(self, module: nn.Module) -> None:
        self.layers = [layer for layer in module.modules()
                       if type(layer) in PACKABLE and packing_available(layer.weight)]
        self.forwards: dict[nn.Module, tuple[Tensor, int | None, Callable]] = {}  # weight, version, forward
        self.entered: list[nn.Module] = []
        self.thread: int | None = None
        self.depth = 0  # entries of this object not left yet (a nested one changes nothing)

    def __enter__(self) -> PackedLinears:
        self.depth += 1
        if self.depth > 1:
            return self
        self.thread = threading.get_ident()
        try:
            for layer in self.layers:
                if "forward" not in layer.__dict__:  # (set in __dict__: nn.Module's setattr checks cost more)
                    layer.__dict__["forward"] = self._forward(layer)
                    self.entered.append(layer)
        except BaseException:
            self.depth = 1
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.depth -= 1
        if self.depth > 0:
            return
        for layer in self.entered:
            if layer.__dict__.get("forward") is self.forwards[layer][2]:
                del layer.__dict__["forward"]  # the class's forward again
        self.entered.clear()
        self.thread = None

    def _forward(self, layer: nn.Linear) -> Callable:
        """The layer's forward through its packed weight, packed again if the weight changed."""
        weight, version, forward = self.forwards.get(layer, (None, None, None))
        # an inference tensor has no version: it can only change inside inference mode, unseen
        current = None if layer.weight.is_inference() else layer.weight._version
        if weight is not layer.weight or version != current:
            packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), ROWS_HINT)
            forward = self._packed_forward(layer, packed)
            self.forwards[layer] = (layer.weight, current, forward)
        return forward

    def _packed_forward(self, layer: nn.Linear, packed: Tensor) -> Callable:
        fused = isinstance(layer, FusedLinear)

        def forward(x: Tensor) -> Tensor | tuple[Tensor, ...]:
            if (torch.is_grad_enabled() or x.dtype != packed.dtype or torch.is_autocast_enabled("cpu")
                    or threading.get_ident() != self.thread):  # a backward pass, autocast, another thread
                return type(layer).forward(layer, x)
            out = packed_matmul(x, packed, layer.bias)
            return layer.split(out) if fused else out

        return forward


def packed_matmul(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
