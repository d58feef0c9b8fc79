"""Low-rank adapters (LoRA, Hu et al. 2021) on a VisionLanguageModel, through peft: injected into the linear
layers whose names match, saved and read in peft's format (adapter_config.json, whose base_model_name_or_path
names the model the adapter belongs to, and adapter_model.safetensors, keys under `base_model.model.`, as
`PeftModel.save_pretrained` writes them), and merged into the weights for inference and export. Modules named
to train fully (peft's `modules_to_save`: a new head, the projector) train beside the adapters and are saved
whole in the adapter's file.

    add_adapters(model, rank=16, alpha=32, target_modules=LANGUAGE_PROJECTIONS)   # only the adapters train
    add_adapters(model, 16, 32, LANGUAGE_PROJECTIONS, modules_to_save="projector")       # and the projector
    save_adapter(model, "out", base="runs/tiny")
    load_adapter(base_model, "out"); merge_adapters(base_model)      # inference: plain weights again
    quantize_frozen(model, device); add_adapters(model, ...)           # QLoRA: a 4-bit frozen base
"""

from __future__ import annotations

import importlib
import json
import logging
import re
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

from models.weights import CheckpointError, atomic_write, read_json, rename_keys

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."  # where peft's own PeftModel keeps the model it wraps
# peft options this module does not reproduce when it loads an adapter (it would compute something else)
UNSUPPORTED = ("use_rslora", "use_dora", "rank_pattern", "alpha_pattern", "layers_to_transform")
LANGUAGE_PROJECTIONS = r"language\.blocks\.\d+\.(attn|mlp)\.\w+_proj"  # the LM's attention and MLP matrices


# Loggers that warn, at import, of nothing tinyvlm uses: bitsandbytes (imported by peft wherever it is
# installed) that the optional `kernels` package for a CPU 4-bit matmul is missing; torch's pytree that
# torchao (imported by peft and transformers wherever it is installed) registers enums as torch deprecates.
IMPORT_NOISE = ("bitsandbytes", "torch.utils._pytree")


def quiet_import(name: str) -> ModuleType:
    """`importlib.import_module(name)` without the import-time warnings of IMPORT_NOISE's loggers."""
    loggers = [logging.getLogger(noisy) for noisy in IMPORT_NOISE]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        return importlib.import_module(name)
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


class WholeModuleError(ValueError):
    """`modules_to_save` names no module, one that holds adapters, or one whose weight another module
    shares."""


def add_adapters(model: nn.Module, rank: int, alpha: float, target_modules: str | list[str],
                 dropout: float = 0.0, modules_to_save: str | list[str] = "") -> None:
    """Wrap the linear layers `target_modules` names (a regex over full module names, or a list of name
    endings) with LoRA adapters (B initialised to zero: the model's outputs are unchanged); the modules
    `modules_to_save` names (a regex over full module names, or a list of them) train whole; everything else
    is frozen."""
    peft = quiet_import("peft")
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules)
    peft.inject_adapter_in_model(config, model)
    config.modules_to_save = _whole_modules(model, modules_to_save)
    model.lora_config = config
    train_only_adapters(model)
    _refuse_tied(model)


# QLoRA (Dettmers et al. 2023): a frozen base's linear layers in 4-bit NormalFloat, adapters on top (peft's
# bnb).
def quantize_frozen(model: nn.Module, device: torch.device, compute_dtype: torch.dtype = torch.bfloat16,
                    blocks: str = r"(language|vision)\.blocks\.\d+\..*") -> int:
    """Replace every nn.Linear whose full name matches `blocks` (by default the LM's and ViT's blocks: nearly
    all of their weights) with a frozen bitsandbytes NF4 Linear4bit on `device` (double-quantized statistics,
    matmuls in `compute_dtype`), before `add_adapters` (ValueError after: the adapters would be quantized
    too, and peft's layers for a 4-bit base not used). Returns the number of layers quantized. Needs
    bitsandbytes."""
    if has_adapters(model):
        raise ValueError("quantize_frozen: the model has adapters; quantize its base before adding them")
    bnb = quiet_import("bitsandbytes")

    layers = [(name, module) for name, module in model.named_modules()
              if isinstance(module, nn.Linear) and re.fullmatch(blocks, name)]
    for name, linear in layers:
        quantized = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                      compute_dtype=compute_dtype, compress_statistics=True, quant_type="nf4")
        quantized.weight = bnb.nn.Params4bit(linear.weight.data.float().cpu(), requires_grad=False,
                                             compress_statistics=True, quant_type="nf4")
        if linear.bias is not None:
            quantized.bias = nn.Parameter(linear.bias.data, requires_grad=False)
        parent, _, child = name.rpartition(".")
        # quantized here
        setattr(model.get_submodule(parent) if parent else model, child, quantized.to(device))
    model.is_loaded_in_4bit = True  # peft then wraps these layers with its bitsandbytes LoRA layers
    return len(layers)


def _whole_modules(model: nn.Module, names: str | list[str]) -> list[str]:
    """The full names of the modules `names` selects (outermost matches only); ValueError for a pattern that
    matches none, or a module that holds adapters (it would train twice over)."""
    if not names:
        return []
    modules = dict(model.named_modules())
    chosen = [
        name for name in modules if (re.fullmatch(names, name) if isinstance(names, str) else name in names)
    ]
    chosen = [name for name in chosen if not any(name.startswith(outer + ".") for outer in chosen)]
    if not chosen:
        raise WholeModuleError(f"{names!r} matches no module")
    adapted = [name for name in chosen if any(".lora_" in key for key, _ in modules[name].named_parameters())]
    if adapted:
        raise WholeModuleError(f"{adapted[0]} holds adapters: it cannot also train whole")
    return chosen


def _refuse_tied(model: nn.Module) -> None:
    """ValueError where an adapted layer's weight, or a weight of a module trained whole, is another module's
    too (an output head tied to the token embedding): merging or training it would change both."""
    LoraLayer = quiet_import("peft").tuners.lora.LoraLayer  # noqa: N806 (a class)

    uses: dict[int, int] = {}
    for _, parameter in model.named_parameters(remove_duplicate=False):
        uses[id(parameter)] = uses.get(id(parameter), 0) + 1
    whole = [
        (name, model.get_submodule(name), WholeModuleError)
        for name in model.lora_config.modules_to_save or ()
    ]
    adapted = [(name, module.get_base_layer(), ValueError) for name, module in model.named_modules()
               if isinstance(module, LoraLayer)]
    for name, module, error in whole + adapted:
        if any(uses[id(parameter)] > 1 for parameter in module.parameters()):
            raise error(f"{name} shares its weight with another module (a tied output head?): an adapter "
                        f"there, or training it whole, would change both")


def train_only_adapters(model: nn.Module) -> None:
    """Gradients for the adapters and the modules to train whole (`model.lora_config.modules_to_save`)
    only."""
    whole = tuple(f"{name}." for name in model.lora_config.modules_to_save or ())
    for name, parameter in model.named_parameters():
        parameter.requires_grad = ".lora_" in name or name.startswith(whole)


def has_adapters(model: nn.Module) -> bool:
    return getattr(model, "lora_config", None) is not None


def save_adapter(model: nn.Module, directory: Path, base: str) -> None:
    """The adapter's config (pointing at `base`) and weights, in peft's format: the modules trained whole
    under their own names, as peft saves `modules_to_save`."""
    from safetensors.torch import save_file

    get_peft_model_state_dict = quiet_import("peft").get_peft_model_state_dict

    config = model.lora_config.to_dict() | {"base_model_name_or_path": base}
    config["target_modules"] = sorted(config["target_modules"]) if isinstance(config["target_modules"], set) \
        else config["target_modules"]
    state = get_peft_model_state_dict(model)
    whole = tuple(f"{name}." for name in config["modules_to_save"] or ())
    state |= {name: value for name, value in model.named_parameters() if name.startswith(whole)}
    tensors = {PREFIX + key: value.detach().contiguous().cpu() for key, value in state.items()}
    directory.mkdir(parents=True, exist_ok=True)
    atomic_write(directory / ADAPTER_WEIGHTS, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    atomic_write(directory / ADAPTER_CONFIG, lambda tmp: tmp.write_text(json.dumps(config, indent=2) + "\n"))


def adapter_base(directory: Path) -> str | None:
    """The model an adapter directory's adapter belongs to; None where `directory` holds no adapter."""
    if not (directory / ADAPTER_CONFIG).is_file():
        return None
    base = read_json(directory / ADAPTER_CONFIG).get("base_model_name_or_path")
    if not base:
        raise CheckpointError(f"{directory}: {ADAPTER_CONFIG} names no base model (base_model_name_or_path)")
    return base


def load_adapter(model: nn.Module, directory: Path) -> None:
    """Inject the adapter saved in `directory` into `model` (a VisionLanguageModel, or a LanguageModel):
    written here, or by peft itself on transformers' Idefics3 (SmolVLM) or Llama, whose weight names are
    mapped to ours as the checkpoint loaders map them. The adapters go exactly on the layers the file holds
    adapters for."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    peft = quiet_import("peft")

    config = read_json(directory / ADAPTER_CONFIG)
    if config.get("peft_type", "LORA") != "LORA":
        raise CheckpointError(f"{directory}: a {config['peft_type']} adapter; only LoRA adapters load here")
    unsupported = [key for key in UNSUPPORTED if config.get(key)]
    if unsupported:
        raise CheckpointError(f"{directory}: the adapter uses {', '.join(unsupported)}, which tinyvlm does "
                              "not load")
    try:
        weights = load_file(directory / ADAPTER_WEIGHTS)
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"{directory}: unreadable {ADAPTER_WEIGHTS} ({type(e).__name__})") from None
    tensors = {_our_key(key.removeprefix(PREFIX), model): value for key, value in weights.items()}
    layers = sorted({key.split(".lora_")[0] for key in tensors if ".lora_" in key})
    whole = {key: value for key, value in tensors.items() if ".lora_" not in key}  # modules_to_save's weights
    _check_whole(model, whole, directory)
    saved = sorted({key.rpartition(".")[0] for key in whole})
    try:
        add_adapters(model, config["r"], config["lora_alpha"], layers, config.get("lora_dropout", 0.0), saved)
    except ValueError as e:  # no such layer here, or a tied one
        raise CheckpointError(f"{directory}: the adapter does not fit the model ({e})") from None
    model.lora_config = peft.LoraConfig(**{key: value for key, value in config.items()
                                           if key in peft.LoraConfig.__dataclass_fields__}
                                        | {"target_modules": layers, "modules_to_save": saved})
    with torch.no_grad():
        for key, value in whole.items():
            model.get_parameter(key).copy_(value)
    result = peft.set_peft_model_state_dict(model,
                                            {key: value for key, value in tensors.items() if ".lora_" in key})
    missing = [key for key in result.missing_keys if ".lora_" in key]
    if missing or result.unexpected_keys:
        raise CheckpointError(f"{directory}: the adapter does not fit the model (missing {missing[:2]}, "
                              f"unexpected {list(result.unexpected_keys)[:2]})")


def _check_whole(model: nn.Module, whole: dict[str, torch.Tensor], directory: Path) -> None:
    """CheckpointError unless every weight of a module trained whole is a parameter of `model`, of its
    shape."""
    parameters = dict(model.named_parameters())
    for key, value in whole.items():
        if key not in parameters or parameters[key].shape != value.shape:
            raise CheckpointError(f"{directory}: the adapter's {key} {tuple(value.shape)} fits no parameter "
                                  f"of the model")


def _our_key(key: str, model: nn.Module) -> str:
    """An adapter weight's name in tinyvlm's modules: transformers' names (model.layers...,
    model.text_model...) mapped as the Llama and Idefics3 loaders map them; our own kept."""
    from models.idefics3 import to_tinyvlm_key
    from models.llama import HF_LLAMA_KEYS

    if not key.startswith(("model.", "lm_head.")):
        return key
    if not hasattr(model, "language"):  # a language model alone (models/quantize.py imports this module)
        return next(iter(rename_keys({key: None}, HF_LLAMA_KEYS)))
    return to_tinyvlm_key(key)


@torch.no_grad()
def merge_adapters(model: nn.Module) -> nn.Module:
    """Fold each adapter into its layer's weight and put the plain layer back: the model computes what it did,
    with no adapter left (its state dict is a plain checkpoint's)."""
    LoraLayer = quiet_import("peft").tuners.lora.LoraLayer  # noqa: N806 (a class)

    for name, module in list(model.named_modules()):
        if isinstance(module, LoraLayer):
            module.merge()
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, module.get_base_layer())
    model.lora_config = None
    for parameter in model.parameters():
        parameter.requires_grad = True
    return model
