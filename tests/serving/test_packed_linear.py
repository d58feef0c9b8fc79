"""oneDNN's prepacked linears (serving/packed_linear.py): float64's outputs within float32 rounding, through
oneDNN; repacked when the weights change; autograd, autocast, other threads and 4-bit layers left to the plain
forward; the forward a layer had back after the block."""

import threading

import pytest
import torch
from torch import nn

import serving.packed_linear
from models.fused_linear import FusedLinear
from serving.packed_linear import PackedLinears, packing_available
from tests.models.helpers import fused_copy, tiny_vlm

pytestmark = pytest.mark.skipif(not packing_available(torch.zeros(1)), reason="torch built without oneDNN")


@pytest.fixture
def packed_calls(monkeypatch) -> list[int]:
    """Counts the matmuls that run through oneDNN's packed weights."""
    calls = []
    matmul = serving.packed_linear.packed_matmul

    def counted(*args):
        calls.append(1)
        return matmul(*args)

    monkeypatch.setattr(serving.packed_linear, "packed_matmul", counted)
    return calls


def _float64_linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    bias = None if layer.bias is None else layer.bias.double()
    return nn.functional.linear(x.double(), layer.weight.double(), bias)


def test_packed_layers_compute_the_linear_and_give_their_forward_back(packed_calls):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 40, bias=False))
    fused = FusedLinear({"a": nn.Linear(64, 24), "b": nn.Linear(64, 8)})
    x = torch.randn(3, 5, 64)
    packed = PackedLinears(nn.ModuleList([model, fused]))
    assert len(packed.layers) == 3
    with torch.inference_mode(), packed:
        hidden = model[0](x)
        out = model[1](hidden)
        parts = fused(x)
    assert len(packed_calls) == 3
    torch.testing.assert_close(hidden.double(), _float64_linear(model[0], x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.double(), _float64_linear(model[1], hidden), atol=1e-5, rtol=1e-5)
    assert [part.shape[-1] for part in parts] == [24, 8]
    torch.testing.assert_close(torch.cat(parts, -1).double(), _float64_linear(fused, x), atol=1e-5, rtol=1e-5)
    assert not any("forward" in layer.__dict__ for layer in packed.layers)


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


def test_autograd_autocast_other_threads_and_4bit_layers_keep_the_plain_forward(packed_calls):
    torch.manual_seed(0)
    layer = nn.Linear(32, 16)
    x = torch.randn(4, 32)
    with PackedLinears(layer):  # grad mode: the packed weights are detached
        layer(x).sum().backward()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            assert layer(x).dtype == torch.bfloat16
        thread = threading.Thread(target=torch.inference_mode()(layer), args=(x,))
        thread.start()
        thread.join()
    assert not packed_calls
    torch.testing.assert_close(layer.weight.grad, x.sum(0).expand(16, 32))

    class Quantized(nn.Linear):  # as bitsandbytes' Linear4bit subclasses nn.Linear
        pass

    layers = PackedLinears(nn.Sequential(Quantized(8, 8), nn.Linear(8, 8))).layers
    assert [type(layer) for layer in layers] == [nn.Linear]


def test_nested_blocks_and_a_forward_of_the_instance_are_left_alone():
    layer, x = nn.Linear(8, 8), torch.randn(2, 8)
    outer, inner = PackedLinears(layer), PackedLinears(layer)
    with torch.inference_mode(), outer:
        forward = layer.forward
        with inner, outer:  # the outer block's forward stays
            assert layer.forward is forward
        assert layer.forward is forward
        layer(x)
    assert "forward" not in layer.__dict__

    def hooked(x):
        return x

    with outer:  # one set while the block runs stays too
        layer.forward = hooked
    assert layer.forward is hooked
    with torch.inference_mode(), outer:
        assert layer(x) is x
    assert layer.forward is hooked


def test_a_packed_model_generates_its_own_greedy_tokens(packed_calls):
    model = fused_copy(tiny_vlm(seed=1))
    ids = torch.randint(3, 90, (2, 10), generator=torch.Generator().manual_seed(0))
    expected = model.generate(ids, max_new_tokens=12, greedy=True)
    with PackedLinears(model.language):
        packed = model.generate(ids, max_new_tokens=12, greedy=True)
    assert len(packed_calls) == 12 * (3 * 4 + 1)  # 3 blocks of 4 linears (q/k/v and gate/up fused), the head
    assert torch.equal(packed, expected)
