"""int8 / int4 quantization of a VisionLanguageModel's linear layers for inference, through torchao:
weight-only (gpt-fast's int8 and int4 schemes: the weights are stored in 8 or 4 bits and de-quantized inside
the matmul, activations stay in the model's dtype), or int8 weights with int8 dynamic activations (each input
row rounded to int8 as it comes, an int8 x int8 matmul). Decoding a batch of a few rows reads every weight
once a step, so its time follows the weights' bytes.

    model = quantize(model, "int8")                # the language model's linears: int8, one scale per row
    model = quantize(model, "int4", vision=True)   # and the ViT's: int4 in groups of 32 weights
    model = quantize(model, "int8-dynamic")        # int8 weights and int8 activations (a CPU's batches)
    describe(model)                                # {"language": "int8", ...}: what is quantized
    weights_summary(model)                         # "22.1 MiB (language int8; 90.4 MiB in float32)"

int8: symmetric, one scale per output row (torchao's Int8WeightOnlyConfig). int4: asymmetric groups of 32
weights along the input (gpt-fast's and GGUF Q4_1's group), a scale and a zero point each, packed for
tinygemm's kernels (torchao's CPU `Int4OpaqueTensor`, on a GPU its tile-packed layout in bfloat16). A layer
whose shape the int4 kernel cannot take stays in float. int8-dynamic (torchao's
Int8DynamicActivationInt8WeightConfig, on a CPU with AVX512-VNNI): int8's weights, and each row of a layer's
input (a token) rounded symmetrically to int8 when it is multiplied, with its own scale, max |x| / 127.5
(float32; q = round(x * (1 / scale)), half to even, clamped to [-128, 127]: the row's largest negative value,
if the largest in magnitude, lands on a tie, -128 or -127 as float32 rounds); the int32 products times both
scales. Fuse first (`fuse_projections`), then quantize: a fused q/k/v layer's rows and groups are its parts'
rows and groups, so the numbers are the same either way.

Saved (`save_pretrained`): a quantized layer's state dict holds its plain integers, scales and zero points,
row by row (so a fused layer splits into its parts' entries), in safetensors, and config.json says what is
quantized (`"quantization": {"language": "int4"}`, as transformers records its `quantization_config`);
`from_pretrained` rebuilds the same torchao weights from them, without rounding again. Plain, not torchao's
own flattened tensors: the CPU int4 packing depends on the CPU's vector width (AVX-512 and AVX2 interleave
rows differently), which is why torchao's safetensors support leaves `Int4OpaqueTensor` out.

    KEY.weight        int8 (and int8-dynamic): the int8 values [N, K]; int4: two 4-bit values q a byte, the
                      even column's in the low 4 bits [N, K/2]
    KEY.weight_scale  int8 (and int8-dynamic): the row's scale [N, 1]; int4: each group's scale [N, K/32]
    KEY.weight_zero   int4 only: each group's zero [N, K/32]; w = (q - 8) * scale + zero (tinygemm's grid)
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import torch
from torch import Tensor, nn

from models.errors import TinyVLMError

QUANTIZATIONS = ("int8", "int4", "int8-dynamic")
INT8_WEIGHTS = ("int8", "int8-dynamic")  # the same int8 weights, saved alike (int8-dynamic rounds inputs too)
INT4_GROUP_SIZE = 32  # the finest group torchao's int4 kernels take (128 and 64 cost SmolLM2-135M far more)
INT4_ROWS_MULTIPLE = 16  # tinygemm's CPU packing takes output widths that are multiples of 16
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# where a quantization runs, by device type, when not everywhere int8 does: tinygemm's int4 on a CPU in any
# float, on CUDA in bfloat16; int8-dynamic on a CPU only (on CUDA torch._int_mm takes more than 16 rows, and
# torchao falls back to a float matmul below that: every decode step of a smaller batch; not checked on a GPU)
RUNS_ON = {"int4": {"cpu": FLOAT_DTYPES, "cuda": (torch.bfloat16,)}, "int8-dynamic": {"cpu": FLOAT_DTYPES}}
# torchao's weight tensors by kind (its class names: importing them would import torchao); an Int8Tensor that
# also rounds its input (`act_quant_kwargs`) is int8-dynamic's
KINDS = {"Int8Tensor": "int8", "Int4OpaqueTensor": "int4", "Int4TilePackedTo4dTensor": "int4"}
CUDA_INT4 = "Int4TilePackedTo4dTensor"  # not saved yet: no unpacking of its layout written
CUDA_INT4_UNSAVED = ("int4 weights packed for CUDA cannot be saved yet: save the float model and quantize it "
                     "when it loads (--quantize int4)")


class QuantizationError(TinyVLMError, ValueError):
    """A quantization that cannot be applied: unknown, unsupported on this device or dtype, or on a model
    with adapters."""


def check_supported(method: str, device: torch.device, dtype: torch.dtype) -> None:
    """QuantizationError unless `method` runs on weights of `dtype` on `device`."""
    if method not in QUANTIZATIONS:
        raise QuantizationError(f"unknown quantization {method!r}: choose one of {', '.join(QUANTIZATIONS)}")
    if dtype not in FLOAT_DTYPES:
        raise QuantizationError(f"{method} quantizes float32, bfloat16 or float16 weights, not {dtype}")
    runs_on = RUNS_ON.get(method)
    if runs_on is not None and dtype not in runs_on.get(device.type, ()):
        supported = ", ".join(f"{name} ({', '.join(str(d).removeprefix('torch.') for d in dtypes)})"
                              for name, dtypes in runs_on.items())
        raise QuantizationError(f"{method} does not run with {str(dtype).removeprefix('torch.')} weights on "
                                f"{device.type}: it runs on {supported}")
    if method == "int8-dynamic" and not int8_matmul_exact():
        raise QuantizationError("int8-dynamic needs a CPU with AVX512-VNNI: without it torch's int8 "
                                "matmul (oneDNN's) adds products in 16 bits that saturate, giving wrong "
                                "sums; use int8")


def int8_matmul_exact() -> bool:
    """Whether this CPU's int8 x int8 matmul (torch._int_mm: oneDNN's) is known to sum exactly: with
    AVX512-VNNI (torchao's own test, `torch.cpu._is_vnni_supported`, guarded as torchao guards it). Without
    it, AVX2's pairwise 16-bit sums saturate (measured with oneDNN held to AVX2: wrong sums for random int8
    values; torchao's remedy, `reduce_range`, rounds to 7 bits instead); other CPUs (AVX-VNNI, Arm) are not
    checked, so refused too."""
    is_vnni_supported = getattr(torch.cpu, "_is_vnni_supported", None)
    return bool(is_vnni_supported and is_vnni_supported())


def quantize(model: nn.Module, method: str, vision: bool = False, empty: bool = False) -> nn.Module:
    """`model` (a VisionLanguageModel) with its language model's linear layers, and with `vision` its ViT's,
    quantized in place for inference (`method`: one of QUANTIZATIONS); returns the model. The token
    embedding stays in float, as in gpt-fast and torchao (a lookup reads one row a token), and so does an
    output head tied to it (transformers' torchao integration keeps a tied head: quantizing it would quantize
    the embedding too); an untied head is quantized like the other linears, as gpt-fast does. Merge adapters
    first (models/lora.py). With `empty`, the quantized weights are placeholders, to be loaded
    (`quantize_as`)."""
    from models.lora import has_adapters

    weight = next(model.language.parameters())
    check_supported(method, weight.device, weight.dtype)
    if has_adapters(model):
        raise QuantizationError("the model has LoRA adapters: merge them into its weights before quantizing "
                                "(models/lora.py merge_adapters), or train them on the float model")
    if describe(model):
        raise QuantizationError(f"the model is already quantized ({describe(model)})")
    shared = shared_parameters(model)
    for part in ("language", "vision") if vision else ("language",):
        quantize_linears(getattr(model, part), method, keep=shared, empty=empty)
    return model


def quantize_linears(module: nn.Module, method: str, keep: set[int] = frozenset(), empty: bool = False
                     ) -> None:
    """Every linear layer under `module` (any model's: transformers' too) quantized with `method`, in place,
    except those whose weight's id is in `keep` and those the int4 kernel cannot take; with `empty`, to be
    loaded: each weight a placeholder of no storage (its shape, dtype and device) whose state dict gives the
    shapes of the plain tensors to load (without packing zeros, or unpacking anything to learn them), and
    loading puts the torchao weight built from those tensors in its place."""
    quantize_, config_for = torchao_quantizer(method)
    for linear in module.modules():
        config = config_for(linear) if isinstance(linear, nn.Linear) else None
        if config is None or id(linear.weight) in keep:
            continue
        if empty:
            weight = linear.weight
            placeholder = torch.zeros((), dtype=weight.dtype, device=weight.device).expand(weight.shape)
            linear.weight = nn.Parameter(placeholder, requires_grad=False)
        else:
            quantize_(linear, config)
        linear.register_state_dict_post_hook(functools.partial(_save_plain, method))
        linear.register_load_state_dict_pre_hook(functools.partial(_load_plain, method))


def quantize_as(model: nn.Module, saved: dict[str, str]) -> nn.Module:
    """`model` quantized as `describe` said of a saved one (`{"language": "int4"}`: config.json's
    "quantization"), ready to load that model's weights."""
    methods, parts = set(saved.values()), set(saved)
    known = len(methods) == 1 and methods <= set(QUANTIZATIONS)
    if not known or not {"language"} <= parts <= {"language", "vision"}:
        raise QuantizationError(f"config.json's quantization {saved} is not one tinyvlm writes (the "
                                f"language model's linears, maybe the ViT's, in one of "
                                f"{', '.join(QUANTIZATIONS)})")
    method = methods.pop()
    if method == "int8-dynamic" and not int8_matmul_exact():  # its weights are int8's: they run weight-only
        warnings.warn("this checkpoint is int8-dynamic, which needs a CPU with AVX512-VNNI: its int8 weights "
                      "load as int8 (weight-only, the activations in float)", stacklevel=2)
        method = "int8"
    return quantize(model, method, vision="vision" in parts, empty=True)


def describe(model: nn.Module) -> dict[str, str]:
    """Each part of the model ("vision", "projector", "language") that has quantized weights, and how
    ("int8", "int4", "int8-dynamic"); empty for a float model."""
    found = {}
    for part, module in model.named_children():
        kinds = {kind(p) for p in module.parameters()} - {None}
        if kinds:
            found[part] = "+".join(sorted(kinds))
    return found


def kind(weight: Tensor) -> str | None:
    """How a weight is quantized (one of QUANTIZATIONS), or None for a float one."""
    found = KINDS.get(type(weight).__name__)
    if found == "int8" and getattr(weight, "act_quant_kwargs", None) is not None:  # it rounds its input too
        return "int8-dynamic"
    return found


def check_savable(model: nn.Module) -> None:
    """QuantizationError unless `save_pretrained` can write each of the model's quantized weights (`plain`):
    not torchao's CUDA int4 layout yet."""
    if any(type(p).__name__ == CUDA_INT4 for p in model.parameters()):
        raise QuantizationError(CUDA_INT4_UNSAVED)


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
    parts = ", ".join(f"{part} {method}" for part, method in quantized.items())
    return f"{stored:.1f} MiB ({parts}; {unquantized:.1f} MiB in {dtype})"


def load_quantized_language_model(source: str | Path, method: str, allow_pickle: bool = False) -> nn.Module:
    """`LanguageModel.from_pretrained(source)` for inference, fused and `method`-quantized as it loads; with
    int4, a GGUF file's Q4_1 matrices (4-bit values in blocks of 32 with a scale and a minimum) become int4
    weights as they are, not de-quantized and rounded again."""
    from models.fused_linear import fuse_projections
    from models.language_model import LanguageModel
    from models.llama import read_llama
    from models.weights import load_checked

    check_supported(method, torch.device("cpu"), torch.float32)
    config, weights = read_llama(source, allow_pickle, int4=method == "int4")
    model = LanguageModel(config)
    fuse_projections(model)
    quantize_linears(model, method, keep=shared_parameters(model), empty=True)
    load_checked(model, conform(model, weights, method), source)
    return model


def conform(model: nn.Module, weights: dict[str, Tensor], method: str) -> dict[str, Tensor]:
    """`weights` (float, or `plain` int4 ones read from a file: models/gguf.py) as the `method`-quantized
    `model`'s state dict holds them: a float weight of a quantized layer quantized, a plain one of a layer
    kept in float de-quantized."""
    expected = model.state_dict()
    weights = dict(weights)
    for key in [key for key in weights if f"{key}_scale" in expected or f"{key}_scale" in weights]:
        if f"{key}_scale" in expected and f"{key}_scale" not in weights:
            linear = nn.Linear(*reversed(weights[key].shape), bias=False)
            linear.weight = nn.Parameter(weights.pop(key), requires_grad=False)
            quantize_linears(linear, method)
            weights.update({key + suffix: tensor for suffix, tensor in plain(linear.weight).items()})
        elif f"{key}_scale" not in expected:
            weights[key] = _dequantized(*(weights.pop(key + suffix) for suffix in ("", "_scale", "_zero")))
    return weights


def _dequantized(packed: Tensor, scale: Tensor, zero: Tensor) -> Tensor:
    """The float weight a `plain` int4 weight stands for."""
    values = _unpacked(packed).to(scale.dtype)
    scale, zero = (t.repeat_interleave(INT4_GROUP_SIZE, dim=1) for t in (scale, zero))
    return (values - 8) * scale + zero


def _plain_shapes(method: str, rows: int, columns: int) -> dict[str, tuple[tuple[int, int], torch.dtype]]:
    """The shapes and dtypes of a [rows, columns] weight's plain tensors (the module docstring's), by suffix
    of the weight's key."""
    if method in INT8_WEIGHTS:
        return {"": ((rows, columns), torch.int8), "_scale": ((rows, 1), torch.float32)}
    groups = ((rows, columns // INT4_GROUP_SIZE), torch.float32)
    return {"": ((rows, columns // 2), torch.uint8), "_scale": groups, "_zero": groups}


def plain(weight: Tensor) -> dict[str, Tensor]:
    """A quantized weight's integers, scales and zero points as plain tensors whose rows are its rows, by
    suffix of the weight's key (the module docstring's layout)."""
    name = type(weight).__name__
    if name == "Int8Tensor":  # int8 and int8-dynamic; symmetric: its zero points are 0
        return {"": weight.qdata, "_scale": weight.scale}
    if name == "Int4OpaqueTensor":
        scale, zero = weight.scale_and_zero.transpose(0, 1).unbind(-1)
        values = _unpack_int4_cpu(weight.qdata, *weight.shape)
        return {"": values[:, 0::2] | values[:, 1::2] << 4, "_scale": scale.contiguous(),
                "_zero": zero.contiguous()}
    raise QuantizationError(CUDA_INT4_UNSAVED)


def from_plain(method: str, tensors: dict[str, Tensor], dtype: torch.dtype, device: torch.device) -> Tensor:
    """The torchao weight (as `quantize_linears` makes: torchao's Int8Tensor, or on a CPU Int4OpaqueTensor)
    of a `dtype` model on `device` that holds the `method`'s `plain` tensors, built from them as they are."""
    torchao_quantizer(method)  # torchao imported, or a one-line error
    from torchao.prototype.quantization.int4 import Int4OpaqueTensor
    from torchao.quantization import Int8Tensor, PerRow
    from torchao.quantization.quantize_.workflows import QuantizeTensorToInt8Kwargs

    values, scale = tensors[""].to(device), tensors["_scale"].to(device)
    if method in INT8_WEIGHTS:  # symmetric, a scale per row (torchao keeps zero points of 0, float32 scales)
        # int8-dynamic: Int8DynamicActivationInt8WeightConfig's rounding of the input (per token, symmetric)
        dynamic = QuantizeTensorToInt8Kwargs(granularity=PerRow()) if method == "int8-dynamic" else None
        return Int8Tensor(values, scale.float(), [1, values.shape[1]], dtype,
                          zero_point=torch.zeros_like(scale, dtype=torch.int8), act_quant_kwargs=dynamic)
    if device.type != "cpu":
        raise QuantizationError(f"int4 weights load on a CPU, not on {device.type}: load the float model and "
                                "quantize it there")
    # tinygemm's CPU packing of the values, and its [K/32, N, 2] scales and zeros
    values = _unpacked(values.int())
    scale_and_zero = torch.stack([scale, tensors["_zero"].to(device)], dim=-1).transpose(0, 1)
    return Int4OpaqueTensor(torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, 1),
                            scale_and_zero.to(dtype).contiguous(), [1, INT4_GROUP_SIZE], values.shape)


def _save_plain(method: str, linear: nn.Module, state: dict, prefix: str, _metadata) -> None:
    """State-dict hook of a `method`-quantized linear layer: its weight as `plain` tensors; for a placeholder
    not loaded yet (`quantize_linears`' `empty`), tensors of their shapes and dtypes on the meta device (no
    data: what `load_checked` compares a file's with)."""
    weight = state.pop(prefix + "weight")
    tensors = plain(weight) if type(weight).__name__ in KINDS else {
        suffix: torch.empty(shape, dtype=dtype, device="meta")
        for suffix, (shape, dtype) in _plain_shapes(method, *weight.shape).items()}
    state.update({f"{prefix}weight{suffix}": tensor for suffix, tensor in tensors.items()})


def _load_plain(method: str, linear: nn.Module, state: dict, prefix: str, *_) -> None:
    """Load hook of a `method`-quantized linear layer: its `plain` tensors, where the state dict holds them,
    built into the torchao weight they were, which takes the layer's weight's place (load_state_dict's copy
    of it into the layer's weight is then a copy onto itself: nothing)."""
    keys = [f"{prefix}weight{suffix}" for suffix in _plain_shapes(method, 1, INT4_GROUP_SIZE)]
    if all(key in state for key in keys) and state[keys[0]].dtype in (torch.int8, torch.uint8):
        tensors = {key.removeprefix(prefix + "weight"): state.pop(key) for key in keys}
        weight = from_plain(method, tensors, linear.weight.dtype, linear.weight.device)
        linear.weight = state[prefix + "weight"] = nn.Parameter(weight, requires_grad=False)


def _unpack_int4_cpu(packed: Tensor, rows: int, columns: int) -> Tensor:
    """The 4-bit values [rows, columns] (uint8) that tinygemm's CPU packing packed into `packed`."""
    values = torch.empty(rows * columns, dtype=torch.uint8)
    values[_int4_cpu_layout(rows, columns)] = _unpacked(packed.cpu()).flatten()
    return values.reshape(rows, columns)


@functools.lru_cache(maxsize=16)
def _int4_cpu_layout(rows: int, columns: int) -> Tensor:
    """For each 4-bit slot of tinygemm's CPU packing of a [rows, columns] weight, the index of the value it
    holds. ATen has no unpacking op and the layout depends on the CPU's vector width, so it is read off the
    packing op itself: values that spell out their own index, 4 bits a pass."""
    index = torch.arange(rows * columns)
    source = torch.zeros_like(index)
    for shift in range(0, max(rows * columns - 1, 1).bit_length(), 4):
        probe = (index >> shift & 15).reshape(rows, columns).int()
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, 1)
        source |= _unpacked(packed).flatten().long() << shift
    if not torch.bincount(source, minlength=len(index)).eq(1).all():
        raise QuantizationError("this torch's CPU int4 packing is not a rearrangement of the 4-bit values")
    return source


def _unpacked(packed: Tensor) -> Tensor:
    """The 4-bit halves [..., 2 * columns] of bytes (uint8, or their values in a wider integer dtype, kept),
    each byte's low half first."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2)


def shared_parameters(model: nn.Module) -> set[int]:
    """ids of the parameters that more than one module holds (a tied output head's weight)."""
    seen, shared = set(), set()
    for _, parameter in model.named_parameters(remove_duplicate=False):
        (shared if id(parameter) in seen else seen).add(id(parameter))
    return shared


@functools.cache  # from_plain asks for it once a weight
def torchao_quantizer(method: str):
    """torchao's `quantize_`, and a function from a linear layer to its torchao config (None: stays float),
    imported here so that everything else runs without torchao."""
    from models.lora import quiet_import

    try:
        quiet_import("torchao")
        from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig
        from torchao.quantization import (
            Int4WeightOnlyConfig,
            Int8DynamicActivationInt8WeightConfig,
            Int8WeightOnlyConfig,
            quantize_,
        )
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

    if method == "int4":
        return quantize_, int4
    int8 = (Int8DynamicActivationInt8WeightConfig if method == "int8-dynamic" else Int8WeightOnlyConfig)(
        set_inductor_config=False)
    return quantize_, lambda linear: int8
