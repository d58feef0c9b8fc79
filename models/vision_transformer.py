"""A ViT image encoder that matches SigLIP / SigLIP2 at fixed resolution and loads their Hugging Face
weights."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from models.config import VisionConfig
from models.errors import InputError
from models.fused_linear import fuse, project
from models.weights import (
    CheckpointError,
    load_checked,
    read_json,
    read_weights,
    rename_keys,
    resolve,
    weight_patterns,
)

QKV = ("q_proj", "k_proj", "v_proj")


# Multi-head self-attention over all patches (no mask), as in transformers' SiglipAttention.
class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.out_proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        batch, seq, width = x.shape
        q, k, v = (projected.view(batch, seq, self.num_heads, -1).transpose(1, 2)
                   for projected in project(self, x, "qkv_proj", QKV))
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(batch, seq, width))


# Pre-LayerNorm transformer block with a tanh-GELU MLP (SigLIP's encoder layer).
class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attn = VisionAttention(config)
        self.mlp_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.fc2(F.gelu(self.fc1(self.mlp_norm(x)), approximate="tanh"))


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


# Vision Transformer (Dosovitskiy et al. 2020) in SigLIP's layout (Zhai et al. 2023).
class VisionTransformer(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embedding = nn.Conv2d(config.num_channels, config.hidden_size, config.patch_size,
                                         stride=config.patch_size)
        self.position_embedding = nn.Parameter(torch.randn(config.num_patches, config.hidden_size)
                                               / config.hidden_size**0.5)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.num_layers))
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.activation_checkpointing = False  # recompute each block in the backward pass (see LanguageModel)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        """SigLIP's initialisation: LeCun-normal patch embedding, Xavier-uniform projections, zero biases."""
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, nonlinearity="linear")
        elif isinstance(module, nn.Linear):
            nn.init.xavier_uniform_(module.weight)
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            nn.init.zeros_(module.bias)

    def forward(self, images: Tensor) -> Tensor:
        """Patch features [N, num_patches, hidden] for normalised images [N, channels, image_size,
        image_size]."""
        expected = (self.config.num_channels, self.config.image_size, self.config.image_size)
        if tuple(images.shape[1:]) != expected:
            raise InputError(f"images must be [N, {', '.join(map(str, expected))}], got {list(images.shape)}")
        x = self.patch_embedding(images).flatten(2).transpose(1, 2) + self.position_embedding
        recompute = self.activation_checkpointing and torch.is_grad_enabled()
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if recompute else block(x)
        return self.norm(x)

    def fuse_projections(self) -> None:
        """Each block's q/k/v projections as one matmul (models/fused_linear.py): for inference; the state
        dict keeps the separate tensors."""
        for block in self.blocks:
            fuse(block.attn, "qkv_proj", QKV)

    @classmethod
    def from_pretrained(cls, source: str | Path, allow_pickle: bool = False) -> VisionTransformer:
        """The vision tower of a SigLIP checkpoint (SiglipVisionModel or SiglipModel; directory or hub id).
        `allow_pickle` also reads `.bin` weights, with `torch.load(weights_only=True)`."""
        path = resolve(source, allow_patterns=weight_patterns(allow_pickle))
        preprocessor = path / "preprocessor_config.json"
        config = config_from_hf(read_json(path / "config.json"),
                                read_json(preprocessor) if preprocessor.is_file() else None)
        model = cls(VisionConfig.from_dict({**config.to_dict(), "pretrained": str(source)}))
        load_checked(model,
                     rename_keys(read_weights(path, allow_pickle), HF_SIGLIP_KEYS, ignore=HF_SIGLIP_UNUSED),
                     source)
        return model
