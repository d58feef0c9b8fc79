"""A Llama GGUF file (llama.cpp's format; SmolLM2 ships as one) as a Hugging Face Llama config and state dict.

Read with the `gguf` package (what transformers' GGUF loader reads with too), without building a transformers model:
the weights are dequantized to float32 and renamed to Hugging Face's Llama names, and the query / key rows go back
from llama.cpp's rotary layout to Hugging Face's (llama.cpp's convert_hf_to_gguf.py permutes them).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from models.loading import CheckpointError

# llama.cpp's tensor names -> Hugging Face Llama's.
_NAMES = [
    (r"^token_embd\.", "model.embed_tokens."),
    (r"^output_norm\.", "model.norm."),
    (r"^output\.", "lm_head."),
    (r"^blk\.(\d+)\.attn_norm\.", r"model.layers.\1.input_layernorm."),
    (r"^blk\.(\d+)\.ffn_norm\.", r"model.layers.\1.post_attention_layernorm."),
    (r"^blk\.(\d+)\.attn_q\.", r"model.layers.\1.self_attn.q_proj."),
    (r"^blk\.(\d+)\.attn_k\.", r"model.layers.\1.self_attn.k_proj."),
    (r"^blk\.(\d+)\.attn_v\.", r"model.layers.\1.self_attn.v_proj."),
    (r"^blk\.(\d+)\.attn_output\.", r"model.layers.\1.self_attn.o_proj."),
    (r"^blk\.(\d+)\.ffn_gate\.", r"model.layers.\1.mlp.gate_proj."),
    (r"^blk\.(\d+)\.ffn_up\.", r"model.layers.\1.mlp.up_proj."),
    (r"^blk\.(\d+)\.ffn_down\.", r"model.layers.\1.mlp.down_proj."),
]


def read_gguf(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The Hugging Face `config.json` dict and float32 state dict of the Llama model in the GGUF file `path`."""
    try:
        from gguf import GGUFReader
        from gguf.quants import dequantize
    except ImportError:
        raise CheckpointError(f"{path}: reading GGUF files needs the gguf package (pip install -e '.[gguf]')") from None

    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as e:
        raise CheckpointError(f"{path}: not a readable GGUF file ({e})") from None

    def field(key: str, default: Any = None) -> Any:
        return reader.fields[key].contents() if key in reader.fields else default

    if (architecture := field("general.architecture")) != "llama":
        raise CheckpointError(f"{path}: GGUF architecture {architecture!r} is not supported (expected llama)")
    names = {tensor.name for tensor in reader.tensors}
    heads = field("llama.attention.head_count")
    kv_heads = field("llama.attention.head_count_kv", heads)
    scaling = field("llama.rope.scaling.type", "none")
    config = {
        "model_type": "llama",
        "vocab_size": field("llama.vocab_size", len(field("tokenizer.ggml.tokens", []))),
        "hidden_size": field("llama.embedding_length"),
        "intermediate_size": field("llama.feed_forward_length"),
        "num_hidden_layers": field("llama.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": field("llama.rope.dimension_count", field("llama.embedding_length") // heads),
        "max_position_embeddings": field("llama.context_length", 2048),
        "rope_theta": field("llama.rope.freq_base", 10000.0),
        "rope_scaling": {"rope_type": "default" if scaling == "none" else scaling},
        "rms_norm_eps": field("llama.attention.layer_norm_rms_epsilon", 1e-6),
        "tie_word_embeddings": "output.weight" not in names,
        "eos_token_id": field("tokenizer.ggml.eos_token_id"),
    }
    weights = {}
    for tensor in reader.tensors:
        name = tensor.name
        for pattern, replacement in _NAMES:
            name = re.sub(pattern, replacement, name)
        values = np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)  # a copy: not the mapped file
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            values = _unpermute(values, heads if "q_proj" in name else kv_heads)
        weights[name] = torch.from_numpy(values)
    return config, weights


def _unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary permutation of a q or k projection: within each head, its two interleaved halves."""
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)
