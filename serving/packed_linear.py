"""Linear layers computed through oneDNN with their weights reordered once into its blocked layout, for
inference on a CPU (what Inductor's CPU freezing does to a frozen graph's linears).

At the tens of rows of a serving engine's decode step MKL's matmul repacks the plain weight on every call; the
prepacked weight does not. On a 2-core AMD EPYC (AVX2) a decode step's linears for SmolLM2-135M at 34 rows,
weights read from memory, took 99 ms instead of 189 ms (1.9x), the 49k-column head alone 2x. Results differ
from MKL's by float32 rounding; on that CPU a row's result also did not depend on how many
rows ran with it (MKL's does, below 8 rows).

    language = packed_copy(model.language)  # its own modules on the same parameters; the model unchanged
    hidden, _ = language(embeddings, kv_cache=cache)  # plain linears through packed copies of their weights

A module conversion, as torchao's and peft's are, but of a copy: the model keeps its own forward for training,
for `generate` and for any other engine.
"""

from __future__ import annotations

import copy
import itertools
from typing import TypeVar

import torch
from torch import Tensor, nn

from models.fused_linear import FusedLinear

ROWS_HINT = 64  # the batch size oneDNN picks its blocked layout for (any number of rows runs on it)
M = TypeVar("M", bound=nn.Module)


def onednn_available() -> bool:
    """Whether this torch build has oneDNN's linear with prepacked weights."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def packing_available(weight: Tensor) -> bool:
    """Whether oneDNN can take this weight: a plain float32 tensor on a CPU (not a tensor subclass, as
    torchao's quantized weights are), in a torch built with oneDNN."""
    return (type(weight) in (Tensor, nn.Parameter) and weight.device.type == "cpu"
            and weight.dtype == torch.float32 and onednn_available())


def packed_copy(module: M) -> M:
    """A copy of `module` (its own module objects on the same parameters and buffers) in which every plain
    linear layer (nn.Linear or FusedLinear exactly: subclasses such as bitsandbytes' 4-bit keep theirs) with a
    packable weight computes through a packed copy of it at inference (as much memory again)."""
    shared = {id(tensor): tensor for tensor in itertools.chain(module.parameters(), module.buffers())}
    copied = copy.deepcopy(module, shared)
    for owner in list(copied.modules()):
        for name, layer in list(owner.named_children()):
            kind = PACKED.get(type(layer))
            if kind is not None and packing_available(layer.weight):
                packed = kind.__new__(kind)
                packed.__dict__.update(layer.__dict__)  # the copy's own layer: parameters, hooks, parts
                owner._modules[name] = packed
    return copied


class PackedLinear(nn.Linear):
    """nn.Linear through oneDNN on a packed copy of its weight at inference: packed at the first call, and
    again at a call that finds a new weight tensor or one updated in place since (an optimizer step, a loaded
    state dict; writes through `.data`, as peft's merge does, bump no version and go unseen: make a new copy
    after them). Autograd and autocast, and inputs of another dtype, take nn.Linear's forward."""

    _packed: tuple[Tensor, int | None, Tensor] | None = None  # the weight, its version, its packed copy

    def forward(self, x: Tensor) -> Tensor:
        if torch.is_grad_enabled() or x.dtype != self.weight.dtype or torch.is_autocast_enabled("cpu"):
            return super().forward(x)
        return packed_matmul(x, self.packed_weight(), self.bias)

    def packed_weight(self) -> Tensor:
        weight, version, packed = self._packed or (None, None, None)
        # an inference tensor has no version: it can only change inside inference mode, unseen
        current = None if self.weight.is_inference() else self.weight._version
        if weight is not self.weight or version != current:
            packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), ROWS_HINT)
            self._packed = (self.weight, current, packed)
        return packed


class PackedFusedLinear(FusedLinear, PackedLinear):
    """FusedLinear through its packed weight: the fused matmul packed, its output split into the parts'."""

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        return self.split(PackedLinear.forward(self, x))


PACKED = {nn.Linear: PackedLinear, FusedLinear: PackedFusedLinear}


def packed_matmul(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
