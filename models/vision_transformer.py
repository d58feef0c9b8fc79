"""A ViT image encoder that matches SigLIP / SigLIP2 at fixed resolution and loads their Hugging Face weights
(models/siglip.py converts them)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from models.config import VisionConfig
from models.errors import InputError
from models.fused_linear import project
from models.siglip import read_siglip
from models.weights import load_checked


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
                   for projected in project(self, x, "qkv_proj"))
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

    def forward(self, images: Tensor, checkpoint_activations: bool = False) -> Tensor:
        """Patch features [N, num_patches, hidden] for normalised images [N, channels, image_size,
        image_size]. checkpoint_activations: keep each block's input only, recomputing the block in the
        backward pass (the same gradients for less memory)."""
        expected = (self.config.num_channels, self.config.image_size, self.config.image_size)
        if tuple(images.shape[1:]) != expected:
            raise InputError(f"images must be [N, {', '.join(map(str, expected))}], got {list(images.shape)}")
        x = self.patch_embedding(images).flatten(2).transpose(1, 2) + self.position_embedding
        recompute = checkpoint_activations and torch.is_grad_enabled()
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if recompute else block(x)
        return self.norm(x)

    @classmethod
    def from_pretrained(cls, source: str | Path, allow_pickle: bool = False) -> VisionTransformer:
        """The vision tower of a SigLIP checkpoint (SiglipVisionModel or SiglipModel; directory or hub id;
        models/siglip.py). `allow_pickle` also reads `.bin` weights, with `torch.load(weights_only=True)`."""
        config, weights = read_siglip(source, allow_pickle)
        model = cls(config)
        load_checked(model, weights, source)
        return model
