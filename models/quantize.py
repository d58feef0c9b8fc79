"""Weight-only int8 / int4 quantization of a VisionLanguageModel's linear layers for inference, through
torchao (gpt-fast's int8 and int4 weight-only schemes): the weights are stored in 8 or 4 bits and de-quantized
inside the matmul, activations stay in the model's dtype. Decoding a batch of a few rows reads every weight
once a step, so its time follows the weights' bytes.

    model = quantize(model, "int8")                # the language model's linears: int8, one scale per row
    model = quantize(model, "int4", vision=True)   # and the ViT's: int4 in groups of 32-128 weights
    describe(model)                                # {"language": "int8", ...}: what is quantized
    weights_summary(model)                         # "22.1 MiB (language int8; 90.4 MiB in float32)"

int8: symmetric, one scale per output row (torchao's Int8WeightOnlyConfig). int4: asymmetric groups of 32
weights along the input (gpt-fast's and GGUF Q4_1's group), a scale and a zero point each, packed for
tinygemm's kernels (torchao's CPU `Int4OpaqueTensor`, on a GPU its tile-packed layout in bfloat16). A layer
whose shape the int4 kernel cannot take stays in float. Fuse first (`fuse_projections`), then quantize: a
fused q/k/v layer's rows and groups are its parts' rows and groups, so the numbers are the same either way.
"""

from __future__ import annotations

import torch
from torch import nn

from models.errors import TinyVLMError

QUANTIZATIONS = ("int8", "int4")
INT4_GROUP_SIZE = 32  # the finest group torchao's int4 kernels take (128 and 64 cost SmolLM2-135M far more)
INT4_ROWS_MULTIPLE = 16  # tinygemm's CPU packing takes output widths that are multiples of 16
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INT4_DTYPES = {"cpu": FLOAT_DTYPES, "cuda": (torch.bfloat16,)}  # tinygemm: CPU any float, CUDA bfloat16
# torchao's weight tensors by kind (its class names: importing them would import torchao)
KINDS = {"Int8Tensor": "int8", "Int4OpaqueTensor": "int4", "Int4TilePackedTo4dTensor": "int4"}


class QuantizationError(TinyVLMError, ValueError):
    """A quantization that cannot be applied: unknown, unsupported on this device or dtype, or on a model
    with adapters."""


def check_supported(method: str, device: torch.device, dtype: torch.dtype) -> None:
    """QuantizationError unless `method` runs on weights of `dtype` on `device`."""
    if method not in QUANTIZATIONS:
        raise QuantizationError(f"unknown quantization {method!r}: choose one of {', '.join(QUANTIZATIONS)}")
    if dtype not in FLOAT_DTYPES:
        raise QuantizationError(f"{method} quantizes float32, bfloat16 or float16 weights, not {dtype}")
    if method == "int4" and dtype not in INT4_DTYPES.get(device.type, ()):
        supported = ", ".join(f"{name} ({', '.join(str(d).removeprefix('torch.') for d in dtypes)})"
                              for name, dtypes in INT4_DTYPES.items())
        raise QuantizationError(f"int4 does not run with {str(dtype).removeprefix('torch.')} weights on "
                                f"{device.type}: it runs on {supported}")


def quantize(model: nn.Module, method: str, vision: bool = False) -> nn.Module:
    """`model` (a VisionLanguageModel) with its language model's linear layers, and with `vision` its ViT's,
    quantized weight-only in place for inference (`method` "int8" or "int4"); returns the model. The token
    embedding stays in float, as in gpt-fast and torchao (a lookup reads one row a token), and so does an
    output head tied to it (transformers' torchao integration keeps a tied head: quantizing it would quantize
    the embedding too); an untied head is quantized like the other linears, as gpt-fast does. Merge adapters
    first (models/lora.py)."""
    from models.lora import has_adapters

    weight = next(model.language.parameters())
    check_supported(method, weight.device, weight.dtype)
    if has_adapters(model):
        raise QuantizationError("the model has LoRA adapters: merge them into its weights before quantizing "
                                "(models/lora.py merge_adapters), or train them on the float model")
    if describe(model):
        raise QuantizationError(f"the model is already quantized ({describe(model)})")
    shared = _shared_parameters(model)
    for part in ("language", "vision") if vision else ("language",):
        quantize_linears(getattr(model, part), method, keep=shared)
    return model


def quantize_linears(module: nn.Module, method: str, keep: set[int] = frozenset()) -> None:
    """Every linear layer under `module` (any model's: transformers' too) quantized with `method`, in place,
    except those whose weight's id is in `keep` and those the int4 kernel cannot take."""
    quantize_, config_for = torchao_quantizer(method)
    for linear in module.modules():
        config = config_for(linear) if isinstance(linear, nn.Linear) else None
        if config is not None and id(linear.weight) not in keep:
            quantize_(linear, config)


def describe(model: nn.Module) -> dict[str, str]:
    """Each part of the model ("vision", "projector", "language") that has quantized weights, and how
    ("int8", "int4"); empty for a float model."""
    found = {}
    for part, module in model.named_children():
        kinds = {KINDS.get(type(p).__name__) for p in module.parameters()} - {None}
        if kinds:
            found[part] = "+".join(sorted(kinds))
    return found


def stored_bytes(tensor: torch.Tensor) -> int:
    """The bytes a tensor holds: a torchao weight's quantized data, scales and zero points."""
    if hasattr(tensor, "__tensor_flatten__"):  # a tensor subclass: the plain tensors it is made of
        names, _ = tensor.__tensor_flatten__()
        return sum(stored_bytes(getattr(tensor, name)) for name in names)
    return tensor.numel() * tensor.element_size()


def weights_summary(model: nn.Module) -> str:
    """The model's parameters' bytes, and what is quantized with the bytes it would hold in float."""
    parameters = list(model.parameters())
    stored = sum(stored_bytes(p) for p in parameters) / 2**20
    quantized = describe(model)
    dtype = str(parameters[0].dtype).removeprefix("torch.")
    if not quantized:
        return f"{stored:.1f} MiB, {dtype}"
    unquantized = sum(p.numel() * p.element_size() for p in parameters) / 2**20
    parts = ", ".join(f"{part} {kind}" for part, kind in quantized.items())
    return f"{stored:.1f} MiB ({parts}; {unquantized:.1f} MiB in {dtype})"


def _shared_parameters(model: nn.Module) -> set[int]:
    """ids of the parameters that more than one module holds (a tied output head's weight)."""
    seen, shared = set(), set()
    for _, parameter in model.named_parameters(remove_duplicate=False):
        (shared if id(parameter) in seen else seen).add(id(parameter))
    return shared


def torchao_quantizer(method: str):
    """torchao's `quantize_`, and a function from a linear layer to its torchao config (None: stays float),
    imported here so that everything else runs without torchao."""
    from models.lora import quiet_import

    try:
        quiet_import("torchao")
        from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig
        from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize_
    except ImportError:
        raise QuantizationError("quantization needs torchao: pip install 'tinyvlm[quantize]'") from None

    # set_inductor_config=False: tinyvlm's compiled steps keep their own inductor settings (torchao's would be
    # set for the whole process)
    def int4(linear: nn.Linear):
        if linear.in_features % INT4_GROUP_SIZE or linear.out_features % INT4_ROWS_MULTIPLE:
            return None
        if linear.weight.device.type == "cuda":
            return Int4WeightOnlyConfig(group_size=INT4_GROUP_SIZE, int4_packing_format="tile_packed_to_4d",
                                        set_inductor_config=False)
        return PrototypeInt4WeightOnlyConfig(group_size=INT4_GROUP_SIZE, set_inductor_config=False)

    int8 = Int8WeightOnlyConfig(set_inductor_config=False)
    return quantize_, int4 if method == "int4" else lambda linear: int8
