"""oneDNN's prepacked linears (models/packed_linear.py): float64's outputs within float32 rounding, a row's
result independent of the rows beside it, repacked when the weights change, autograd and quantized layers
left to the plain forward, and the class forward back after the block."""

import pytest
import torch
from torch import nn

from models.fused_linear import FusedLinear
from models.packed_linear import PackedLinears, packing_available
from tests.models.helpers import fused_copy, tiny_vlm

pytestmark = pytest.mark.skipif(not packing_available(torch.zeros(1)), reason="torch built without oneDNN")


def _float64_linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    bias = None if layer.bias is None else layer.bias.double()
    return nn.functional.linear(x.double(), layer.weight.double(), bias)


def test_packed_layers_compute_the_linear_and_give_their_forward_back():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 40, bias=False))
    fused = FusedLinear({"a": nn.Linear(64, 24), "b": nn.Linear(64, 8)})
    x = torch.randn(3, 5, 64)
    packed = PackedLinears(nn.ModuleList([model, fused]))
    assert len(packed.layers) == 3
    with torch.inference_mode(), packed:
        assert all("forward" in layer.__dict__ for layer in packed.layers)
        hidden = model[0](x)
        out = model[1](hidden)
        parts = fused(x)
    torch.testing.assert_close(hidden.double(), _float64_linear(model[0], x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.double(), _float64_linear(model[1], hidden), atol=1e-5, rtol=1e-5)
    assert [part.shape[-1] for part in parts] == [24, 8]
    torch.testing.assert_close(torch.cat(parts, -1).double(), _float64_linear(fused, x), atol=1e-5, rtol=1e-5)
    assert not any("forward" in layer.__dict__ for layer in packed.layers)


def test_a_rows_result_does_not_depend_on_the_rows_beside_it():
    torch.manual_seed(0)
    layer = nn.Linear(576, 960, bias=False)
    x = torch.randn(64, 576)
    with torch.inference_mode(), PackedLinears(layer):
        together = layer(x)
        alone = torch.cat([layer(x[i : i + 1]) for i in range(len(x))])
    assert torch.equal(together, alone)


def test_changed_weights_are_packed_again():
    torch.manual_seed(0)
    layer = nn.Linear(32, 16)
    x = torch.randn(4, 32)
    packed = PackedLinears(layer)
    with torch.inference_mode(), packed:
        layer(x)
    with torch.no_grad():
        layer.weight.mul_(-2)  # an in-place update (an optimizer step, a loaded state dict)
        expected = nn.functional.linear(x, layer.weight, layer.bias)
    with torch.inference_mode(), packed:
        torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)
    layer.weight = nn.Parameter(torch.randn(16, 32))  # a new tensor
    with torch.no_grad():
        expected = nn.functional.linear(x, layer.weight, layer.bias)
    with torch.inference_mode(), packed:
        torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)


def test_autograd_and_4bit_layers_keep_the_plain_forward():
    torch.manual_seed(0)
    layer = nn.Linear(32, 16)
    x = torch.randn(4, 32)
    with PackedLinears(layer):  # grad mode: packed weights are detached, so the class forward runs
        layer(x).sum().backward()
    torch.testing.assert_close(layer.weight.grad, x.sum(0).expand(16, 32))

    class Quantized(nn.Linear):  # as bitsandbytes' Linear4bit subclasses nn.Linear
        pass

    assert PackedLinears(nn.Sequential(Quantized(8, 8), nn.Linear(8, 8))).layers[0].__class__ is nn.Linear


def test_a_packed_model_generates_its_own_greedy_tokens():
    model = fused_copy(tiny_vlm(seed=1))
    ids = torch.randint(3, 90, (2, 10), generator=torch.Generator().manual_seed(0))
    expected = model.generate(ids, max_new_tokens=12, greedy=True)
    with PackedLinears(model.language):
        packed = model.generate(ids, max_new_tokens=12, greedy=True)
    assert torch.equal(packed, expected)
