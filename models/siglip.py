"""SigLIP / SigLIP2 (fixed resolution) checkpoints in Hugging Face's format as tinyvlm's VisionTransformer
config and weights."""

from __future__ import annotations

from pathlib import Path

from torch import Tensor

from models.config import VisionConfig
from models.weights import CheckpointError, read_json, read_weights, rename_keys, resolve, weight_patterns

HF_SIGLIP_KEYS = [
    (r"^(?:vision_model\.)?embeddings\.patch_embedding\.", "patch_embedding."),
    (r"^(?:vision_model\.)?embeddings\.position_embedding\.weight$", "position_embedding"),
    (r"^(?:vision_model\.)?encoder\.layers\.(\d+)\.layer_norm1\.", r"blocks.\1.attn_norm."),
    (r"^(?:vision_model\.)?encoder\.layers\.(\d+)\.self_attn\.", r"blocks.\1.attn."),
    (r"^(?:vision_model\.)?encoder\.layers\.(\d+)\.layer_norm2\.", r"blocks.\1.mlp_norm."),
    (r"^(?:vision_model\.)?encoder\.layers\.(\d+)\.mlp\.", r"blocks.\1."),
    (r"^(?:vision_model\.)?post_layernorm\.", "norm."),
]
# Keys carry a `vision_model.` prefix in SiglipModel and transformers-4 SiglipVisionModel checkpoints, none in
# v5. SiglipModel's text tower and contrastive scalars, and the vision tower's attention-pooling head, are not
# used.
HF_SIGLIP_UNUSED = r"^(text_model\.|logit_scale|logit_bias|(vision_model\.)?head\.)"


def config_from_hf(hf: dict, preprocessor: dict | None = None) -> VisionConfig:
    """Our config for a SiglipVisionModel / SiglipModel `config.json` (and its preprocessor_config.json).
    SigLIP2's fixed-resolution checkpoints are SigLIP models too. Fields a hub config leaves out (older SigLIP
    repos list only what differs) take transformers' SiglipVisionConfig defaults, as transformers itself
    does."""
    from transformers import SiglipVisionConfig

    model_type = hf.get("model_type")
    if model_type not in (None, "siglip", "siglip_vision_model"):
        raise CheckpointError(f"model_type {model_type!r} is not supported as a vision tower (expected "
                              "SigLIP)")
    vision = {**SiglipVisionConfig().to_dict(), **hf.get("vision_config", hf)}
    if vision.get("hidden_act", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_new"):
        raise CheckpointError(f"unsupported SigLIP variant: hidden_act {vision['hidden_act']!r}")
    preprocessor = preprocessor or {}
    return VisionConfig(
        image_size=vision["image_size"], patch_size=vision["patch_size"], hidden_size=vision["hidden_size"],
        intermediate_size=vision["intermediate_size"], num_layers=vision["num_hidden_layers"],
        num_heads=vision["num_attention_heads"], num_channels=vision.get("num_channels", 3),
        layer_norm_eps=float(vision.get("layer_norm_eps", 1e-6)),
        image_mean=tuple(preprocessor.get("image_mean", (0.5, 0.5, 0.5))),
        image_std=tuple(preprocessor.get("image_std", (0.5, 0.5, 0.5))),
    )


def read_siglip(source: str | Path, allow_pickle: bool = False) -> tuple[VisionConfig, dict[str, Tensor]]:
    """The config and weights (our names) of a SiglipVisionModel or SiglipModel's vision tower: a directory or
    hub id. `allow_pickle` also reads `.bin` weights."""
    path = resolve(source, allow_patterns=weight_patterns(allow_pickle))
    preprocessor = path / "preprocessor_config.json"
    config = config_from_hf(read_json(path / "config.json"),
                            read_json(preprocessor) if preprocessor.is_file() else None)
    config = VisionConfig.from_dict({**config.to_dict(), "pretrained": str(source)})
    return config, rename_keys(read_weights(path, allow_pickle), HF_SIGLIP_KEYS, ignore=HF_SIGLIP_UNUSED)
