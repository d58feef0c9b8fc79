"""A Llama GGUF file (llama.cpp's format; SmolLM2 ships as one) as a Hugging Face Llama config and state dict.

Read with the `gguf` package (what transformers' GGUF loader reads with too), without building a transformers
model: the weights are dequantized to float32 and renamed to Hugging Face's Llama names, and the query / key
rows go back from llama.cpp's rotary layout to Hugging Face's (llama.cpp's convert_hf_to_gguf.py permutes
them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from models.weights import CheckpointError, rename_keys

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
_REQUIRED = ["llama.block_count", "llama.embedding_length", "llama.feed_forward_length",
             "llama.attention.head_count"]


def read_gguf(path: Path, int4: bool = False) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The Hugging Face `config.json` dict and float32 state dict of the Llama model in the GGUF file
    `path`. With `int4`, each Q4_1 matrix but the embedding is read as tinyvlm's int4 weight (`_q4_1`)."""
    try:
        from gguf import GGMLQuantizationType, GGUFReader
        from gguf.quants import dequantize
    except ImportError:
        raise CheckpointError(
            f"{path}: reading GGUF files needs the gguf package (pip install -e '.[gguf]')"
        ) from None

    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as e:
        raise CheckpointError(f"{path}: not a readable GGUF file ({e})") from None
    config = _hf_config(reader, path)
    # llama.cpp's names
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    weights = {}
    for tensor in reader.tensors:
        projection = tensor.name.removesuffix(".weight").rpartition(".")[2]
        if int4 and tensor.tensor_type == GGMLQuantizationType.Q4_1 and projection != "token_embd":
            weights.update(_q4_1(tensor.name, tensor.data, heads.get(projection)))
            continue
        try:
            # a copy, not the map
            values = np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
            if projection in heads:
                values = _unpermute(values, heads[projection])
        except (NotImplementedError, ValueError) as e:  # a quantization gguf cannot dequantize, odd shapes
            kind = tensor.tensor_type.name
            raise CheckpointError(f"{path}: cannot read tensor {tensor.name} ({kind}: {e})") from None
        weights[tensor.name] = torch.from_numpy(values)
    return config, rename_keys(weights, _NAMES)


def _q4_1(name: str, blocks: np.ndarray, heads: int | None) -> dict[str, torch.Tensor]:
    """A Q4_1 matrix [N, K] (`blocks`: each row's blocks of 32 weights, 20 bytes each: a float16 scale d, a
    float16 minimum m, then 16 bytes of 4-bit q, the block's first 16 in the low halves; w = d * q + m) as
    tinyvlm's saved int4 weight (models/quantize.py): the q as they are, two a byte; each block's scale d; its
    zero m + 8 d (tinygemm's grid: w = (q - 8) * scale + zero)."""
    rows = blocks.shape[0]
    blocks = blocks.reshape(rows, -1, 20)
    scale, minimum = (blocks[..., i:i + 2].copy().view(np.float16)[..., 0].astype(np.float32) for i in (0, 2))
    q = np.concatenate([blocks[..., 4:] & 15, blocks[..., 4:] >> 4], axis=-1).reshape(rows, -1)
    tensors = {"": q[:, 0::2] | q[:, 1::2] << 4, "_scale": scale, "_zero": minimum + 8 * scale}
    if heads is not None:
        tensors = {suffix: _unpermute(values, heads) for suffix, values in tensors.items()}
    return {f"{name}{suffix}": torch.from_numpy(np.ascontiguousarray(values))
            for suffix, values in tensors.items()}


def _field(reader, key: str, default: Any = None) -> Any:
    return reader.fields[key].contents() if key in reader.fields else default


def _hf_config(reader, path: Path) -> dict[str, Any]:
    """The metadata of a Llama GGUF file as a Hugging Face Llama `config.json` dict (as transformers maps
    it)."""
    if (architecture := _field(reader, "general.architecture")) != "llama":
        raise CheckpointError(f"{path}: GGUF architecture {architecture!r} is not supported (expected llama)")
    if missing := [key for key in _REQUIRED if key not in reader.fields]:
        raise CheckpointError(f"{path}: not a complete Llama GGUF file (no {', '.join(missing)} in its "
                              "metadata)")
    tensors = {tensor.name for tensor in reader.tensors}
    heads, hidden = _field(reader, "llama.attention.head_count"), _field(reader, "llama.embedding_length")
    # Rope scaling comes as a type, an older linear factor, or (Llama 3.1+) a rope_freqs tensor:
    # config_from_hf refuses it ("rope scaling") rather than the model loading without it.
    scaling = _field(reader, "llama.rope.scaling.type", "none")
    if scaling == "none" and ("rope_freqs.weight" in tensors or "llama.rope.scale_linear" in reader.fields):
        scaling = "llama3" if "rope_freqs.weight" in tensors else "linear"
    return {
        # transformers reads a "llama" file named Mistral as Mistral (its sliding window is not in the
        # metadata)
        "model_type": "mistral" if "mistral" in str(_field(reader, "general.name", "")).lower() else "llama",
        "vocab_size": _field(reader, "llama.vocab_size", len(_field(reader, "tokenizer.ggml.tokens", []))),
        "hidden_size": hidden,
        "intermediate_size": _field(reader, "llama.feed_forward_length"),
        "num_hidden_layers": _field(reader, "llama.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _field(reader, "llama.attention.head_count_kv", heads),
        "head_dim": _field(reader, "llama.rope.dimension_count", hidden // heads),
        "max_position_embeddings": _field(reader, "llama.context_length", 2048),
        "rope_theta": _field(reader, "llama.rope.freq_base", 10000.0),
        "rope_scaling": {"rope_type": "default" if scaling == "none" else scaling},
        "rms_norm_eps": _field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-6),
        "tie_word_embeddings": "output.weight" not in tensors,
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }


def _unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary permutation of a q or k projection: within each head, its two interleaved
    halves."""
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)
