"""oneDNN's prepacked linears (serving/packed_linear.py): a copy of the model on its parameters, the copy's
plain linears within float32 rounding of float64's through oneDNN; repacked when the weights change;
autograd, autocast and quantized or 4-bit layers left to the plain forward; the model itself unchanged."""

import pytest
import torch
from torch import nn

import serving.packed_linear
from models.fused_linear import FusedLinear
from serving.packed_linear import PackedLinear, packed_copy, packing_available
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


def test_the_copys_layers_compute_the_linear_on_the_models_parameters(packed_calls):
    torch.manual_seed(0)
    model = nn.ModuleList([nn.Linear(64, 96), nn.Linear(96, 40, bias=False),
                           FusedLinear({"a": nn.Linear(64, 24), "b": nn.Linear(64, 8)})])
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    packed = packed_copy(model)
    assert [type(layer).__name__ for layer in packed] == ["PackedLinear", "PackedLinear", "PackedFusedLinear"]
    assert [type(layer) for layer in model] == [nn.Linear, nn.Linear, FusedLinear]  # the model is unchanged
    assert all(a is b for a, b in zip(packed.parameters(), model.parameters(), strict=True))
    x = torch.randn(3, 5, 64)
    with torch.inference_mode():
        hidden = packed[0](x)
        out = packed[1](hidden)
        parts = packed[2](x)
    assert len(packed_calls) == 3
    torch.testing.assert_close(hidden.double(), _float64_linear(model[0], x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.double(), _float64_linear(model[1], hidden), atol=1e-5, rtol=1e-5)
    assert [part.shape[-1] for part in parts] == [24, 8]
    torch.testing.assert_close(torch.cat(parts, -1).double(), _float64_linear(model[2], x),
                               atol=1e-5, rtol=1e-5)
    assert packed.state_dict().keys() == state.keys()
    assert all(torch.equal(packed.state_dict()[name], tensor) for name, tensor in state.items())


def test_changed_weights_are_packed_again():
    torch.manual_seed(0)
    layer = nn.Linear(32, 16)
    packed = packed_copy(nn.Sequential(layer))[0]
    x = torch.randn(4, 32)
    with torch.inference_mode():
        packed(x)
    with torch.no_grad():
        layer.weight.mul_(-2)  # the model's weight updated in place (an optimizer step, a loaded state dict)
        expected = nn.functional.linear(x, layer.weight, layer.bias)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), expected, atol=1e-5, rtol=1e-5)
    packed.weight = nn.Parameter(torch.randn(16, 32))  # a new tensor
    with torch.no_grad():
        expected = nn.functional.linear(x, packed.weight, packed.bias)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), expected, atol=1e-5, rtol=1e-5)


def test_autograd_autocast_and_quantized_or_4bit_layers_keep_the_plain_forward(packed_calls):
    torch.manual_seed(0)
    layer = packed_copy(nn.Sequential(nn.Linear(32, 16)))[0]
    x = torch.randn(4, 32)
    layer(x).sum().backward()  # grad mode: the packed weights are detached
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(x).dtype == torch.bfloat16
    assert not packed_calls
    torch.testing.assert_close(layer.weight.grad, x.sum(0).expand(16, 32))

    class Quantized(nn.Linear):  # as bitsandbytes' Linear4bit subclasses nn.Linear
        pass

    class QuantizedWeight(torch.Tensor):  # as torchao's quantized weights subclass Tensor
        pass

    quantized = nn.Linear(8, 8)
    quantized.weight = nn.Parameter(quantized.weight.detach().as_subclass(QuantizedWeight))
    kept = packed_copy(nn.Sequential(Quantized(8, 8), quantized, nn.Linear(8, 8)))
    assert [type(layer) for layer in kept] == [Quantized, nn.Linear, PackedLinear]


def test_a_packed_copy_generates_the_models_greedy_tokens(packed_calls):
    model = fused_copy(tiny_vlm(seed=1))
    ids = torch.randint(3, 90, (2, 10), generator=torch.Generator().manual_seed(0))
    expected = model.generate(ids, max_new_tokens=12, greedy=True)
    assert not packed_calls
    model.language = packed_copy(model.language)
    packed = model.generate(ids, max_new_tokens=12, greedy=True)
    assert len(packed_calls) == 12 * (3 * 4 + 1)  # 3 blocks of 4 linears (q/k/v and gate/up fused), the head
    assert torch.equal(packed, expected)
