"""A whole VLM checkpoint's config and weights, whatever its format: tinyvlm's own (`save_pretrained`:
config.json + model.safetensors), a transformers Idefics3 / SmolVLM / SmolVLM2 one (models/idefics3.py), or
nanoVLM's published format (models/nanovlm.py), told apart by config.json."""

from __future__ import annotations

from pathlib import Path

from torch import Tensor

from models.config import VLMConfig
from models.idefics3 import read_idefics3
from models.nanovlm import read_nanovlm
from models.weights import CheckpointError, read_json, read_weights, resolve, weight_patterns

QUANTIZATION = "quantization"  # config.json's record of a quantized model's quantization (models/quantize.py)


def read_checkpoint(source: str | Path, allow_pickle: bool = False
                    ) -> tuple[VLMConfig, dict[str, Tensor], Path]:
    """The config, the weights (our names) and the directory of a checkpoint directory or hub id. With
    `allow_pickle`, a `pytorch_model.bin` read by `torch.load(weights_only=True)` will also do."""
    path = resolve(source, allow_patterns=weight_patterns(allow_pickle))
    if not path.is_dir():
        raise CheckpointError(f"{source}: expected a checkpoint directory with config.json and "
                              "model.safetensors")
    hf_config = read_json(path / "config.json")
    if hf_config.get("model_type") in ("idefics3", "smolvlm"):
        return (*read_idefics3(path, hf_config, allow_pickle), path)
    if "model_type" in hf_config:
        raise CheckpointError(f"{path}: model_type {hf_config['model_type']!r} is not supported (tinyvlm "
                              f"loads its own checkpoints, Idefics3 / SmolVLM / SmolVLM2 and nanoVLM)")
    if "vit_hidden_dim" in hf_config:
        return (*read_nanovlm(path, hf_config, allow_pickle), path)
    config = VLMConfig.from_dict({key: value for key, value in hf_config.items() if key != QUANTIZATION})
    return config, read_weights(path, allow_pickle), path
