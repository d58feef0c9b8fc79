"""A Llama-style decoder (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU) with a per-block dict
KV cache. Weights load from Hugging Face Llama checkpoints and GGUF files (models/llama.py). Every block maps
`(x, kv_cache)` to `(x, kv_cache)`; positions come from `start_pos` and, for padded batches, from the mask,
so each row's (or each packed sequence's) rotary positions start at 0 at its first real token.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask
from torch.utils.checkpoint import checkpoint

from models.config import LanguageConfig
from models.fused_linear import project
from models.kv_cache import KVCache, allocate, layout_of
from models.llama import read_llama
from models.weights import load_checked


# Root-mean-square LayerNorm (Zhang & Sennrich, 2019), as transformers' LlamaRMSNorm computes it (in float32),
# through F.rms_norm: one fused kernel on a GPU where the formula written out is five.
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        normed = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        return self.weight * normed.to(x.dtype)


# Rotary position embeddings (RoFormer, Su et al. 2021) in Hugging Face Llama's half-rotation layout.
class RotaryEmbedding(nn.Module):
    """cos/sin computed in float32 for each call's positions, as transformers' Llama does: no stored table, so
    no `model.to(bfloat16)` can round it for good."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.theta = head_dim, theta

    def forward(self, positions: Tensor, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
        """cos and sin [batch, 1, seq, head_dim] for `positions` [batch, seq] in `dtype` (cast once a forward,
        not per layer), sin's first half negated: rotate_half's sign (`apply_rotary`)."""
        exponents = torch.arange(0, self.head_dim, 2, device=positions.device).float() / self.head_dim
        angles = positions.float()[..., None] * (1.0 / self.theta**exponents)
        angles = torch.cat([angles, angles], dim=-1)
        half, sin = self.head_dim // 2, angles.sin()
        sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
        return angles.cos().unsqueeze(1).to(dtype), sin.unsqueeze(1).to(dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Llama's x * cos + [-x2, x1] * sin with the sign in sin: [x2, x1] * [-s, s], exactly; one roll where
    rotate_half's negation and cat are two kernels."""
    return x * cos.to(x.dtype) + x.roll(x.shape[-1] // 2, -1) * sin.to(x.dtype)


# Grouped-query attention (Ainslie et al. 2023) over any cache layout (models/kv_cache.py).
class Attention(nn.Module):
    def __init__(self, config: LanguageConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | BlockMask | None,
                kv_cache: KVCache | None, start_pos: int | Tensor) -> tuple[Tensor, KVCache]:
        batch, seq, _ = x.shape
        q, k, v = project(self, x, "qkv_proj")
        q = q.view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out, kv_cache = layout_of(kv_cache).attend(q, k, v, mask, kv_cache, start_pos)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1)), kv_cache


# SwiGLU feed-forward (Shazeer, 2020), as in Llama.
class MLP(nn.Module):
    def __init__(self, config: LanguageConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = project(self, x, "gate_up_proj")
        return self.down_proj(F.silu(gate) * up)


# A pre-norm Llama decoder block.
class Block(nn.Module):
    def __init__(self, config: LanguageConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None = None,
                kv_cache: KVCache | None = None, start_pos: int | Tensor = 0) -> tuple[Tensor, KVCache]:
        """`mask` [B or 1, 1, T, S] bool, or a FlexAttention BlockMask (None: causal). Without a cache,
        returns a new one holding this call's K/V; with one, writes K/V at slots start_pos .. start_pos + T
        and attends over the cache."""
        attended, kv_cache = self.attn(self.attn_norm(x), cos, sin, mask, kv_cache, start_pos)
        x = x + attended
        return x + self.mlp(self.mlp_norm(x)), kv_cache


# The decoder (Llama 2, Touvron et al. 2023; SmolLM2-compatible).
class LanguageModel(nn.Module):
    def __init__(self, config: LanguageConfig) -> None:
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        if config.tie_word_embeddings:
            self.head.weight = self.token_embedding.weight

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)

    def tied_weight_keys(self) -> list[str]:
        return ["head.weight"] if self.config.tie_word_embeddings else []

    def forward(self, embeddings: Tensor, attention_mask: Tensor | None = None,
                kv_cache: list[KVCache] | None = None,
                start_pos: int | Tensor = 0, *, checkpoint_activations: bool = False,
                flex_attention: bool = False) -> tuple[Tensor, list[KVCache]]:
        """The final-normed hidden states of `embeddings` [B, T, C] at slots start_pos .. start_pos + T (an
        int, or a 0-dim tensor for a shape-static cache), and the cache; logits are `head(hidden)`.
        attention_mask [B, L]: 1 real, 0 padding over slots 0 .. L-1, or 1, 2, ... for the sequences packed
        in a row (data/packing.py). kv_cache: one dict per block (`allocate_kv_cache`), or None; its "layout"
        says how it is written and read, and may carry the positions itself (models/kv_cache.py).
        Training without a cache: checkpoint_activations keeps each block's input only (the block recomputed
        in the backward pass); flex_attention takes packed or padded rows through FlexAttention, its fully
        masked tiles skipped (compiled, on a GPU: it has no backward pass on a CPU)."""
        batch, seq, _ = embeddings.shape
        caches = kv_cache if kv_cache is not None else [None] * len(self.blocks)
        flex = flex_attention and kv_cache is None and isinstance(start_pos, int) and start_pos == 0
        positions, mask = layout_of(caches[0]).positions_and_mask(caches[0], attention_mask, start_pos, batch,
                                                                  seq, embeddings.device, flex)
        cos, sin = self.rotary(positions, embeddings.dtype)  # autocast's bf16 q, k cast them per layer
        x, new_caches = embeddings, []
        if checkpoint_activations and kv_cache is None and torch.is_grad_enabled():
            for block in self.blocks:  # no cache to return: nothing of a block is kept but its input
                x = checkpoint(lambda x, block=block: block(x, cos, sin, mask, None, start_pos)[0], x,
                               use_reentrant=False)
            return self.norm(x), []
        for block, cache in zip(self.blocks, caches):
            x, cache = block(x, cos, sin, mask, cache, start_pos)
            new_caches.append(cache)
        return self.norm(x), new_caches

    def allocate_kv_cache(self, batch: int, capacity: int, dtype: torch.dtype | None = None,
                          device: torch.device | None = None, shape_static: bool = False) -> list[KVCache]:
        """One preallocated {"key", "value", "layout"} dict per block, [batch, kv_heads, capacity, head_dim]
        each."""
        c, weight = self.config, self.token_embedding.weight
        return [allocate(batch, c.num_kv_heads, capacity, c.head_dim, dtype or weight.dtype,
                         device or weight.device, shape_static) for _ in range(c.num_layers)]

    def resize_token_embeddings(self, vocab_size: int) -> None:
        """Grow (or shrink) the vocabulary; new rows start at the mean of the old embeddings."""
        old_embedding, old_head = self.token_embedding.weight.data, self.head.weight.data
        keep = min(vocab_size, old_embedding.shape[0])

        def resized(old: Tensor) -> nn.Parameter:
            new = old.mean(0, keepdim=True).repeat(vocab_size, 1)
            new[:keep] = old[:keep]
            return nn.Parameter(new)

        self.token_embedding.weight = resized(old_embedding)
        self.head.weight = (
            self.token_embedding.weight if self.config.tie_word_embeddings else resized(old_head)
        )
        self.token_embedding.num_embeddings = self.head.out_features = vocab_size
        self.config = LanguageConfig.from_dict({**self.config.to_dict(), "vocab_size": vocab_size})

    @classmethod
    def from_pretrained(cls, source: str | Path, allow_pickle: bool = False) -> LanguageModel:
        """A Hugging Face Llama checkpoint (directory or hub id, safetensors) or a `.gguf` file, as our model
        (models/llama.py). `allow_pickle` also reads `.bin` weights, with `torch.load(weights_only=True)`.
        Quantized as it loads: models/quantize.py `load_quantized_language_model`."""
        config, weights = read_llama(source, allow_pickle)
        model = cls(config)
        load_checked(model, weights, source)
        return model
