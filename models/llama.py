"""Hugging Face Llama checkpoints (safetensors, sharded or not, or a GGUF file) as tinyvlm's LanguageModel
config and weights: the architecture checked, the keys renamed."""

from __future__ import annotations

from pathlib import Path

from torch import Tensor

from models.config import LanguageConfig
from models.gguf import read_gguf
from models.weights import CheckpointError, read_json, read_weights, rename_keys, resolve, weight_patterns

HF_LLAMA_KEYS = [
    (r"^model\.embed_tokens\.", "token_embedding."),
    (r"^model\.layers\.(\d+)\.self_attn\.", r"blocks.\1.attn."),
    (r"^model\.layers\.(\d+)\.mlp\.", r"blocks.\1.mlp."),
    (r"^model\.layers\.(\d+)\.input_layernorm\.", r"blocks.\1.attn_norm."),
    (r"^model\.layers\.(\d+)\.post_attention_layernorm\.", r"blocks.\1.mlp_norm."),
    (r"^model\.norm\.", "norm."),
    (r"^lm_head\.", "head."),
]


def config_from_hf(hf: dict) -> LanguageConfig:
    """Our config for a Hugging Face Llama `config.json`; unsupported variants fail with a clear message."""
    if hf.get("model_type") not in ("llama", None):
        raise CheckpointError(f"model_type {hf.get('model_type')!r} is not supported (expected a Llama "
                              "checkpoint)")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    unsupported = {
        "hidden_act": hf.get("hidden_act", "silu") != "silu",
        "attention_bias": bool(hf.get("attention_bias")),
        "mlp_bias": bool(hf.get("mlp_bias")),
        "rope scaling": rope.get("rope_type", rope.get("type", "default")) != "default",
        "head_dim": (hf.get("head_dim",
                            hf["hidden_size"] // hf["num_attention_heads"]) * hf["num_attention_heads"]
                     != hf["hidden_size"]),
    }
    if bad := [name for name, flag in unsupported.items() if flag]:
        raise CheckpointError(f"unsupported Llama variant: {', '.join(bad)}")
    eos = hf.get("eos_token_id")
    return LanguageConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        eos_token_id=eos[0] if isinstance(eos, list) else eos,
    )


def read_llama(source: str | Path, allow_pickle: bool = False, int4: bool = False
               ) -> tuple[LanguageConfig, dict[str, Tensor]]:
    """The config and weights (our names) of a Llama checkpoint: a directory or hub id, or a `.gguf` file; the
    architecture is checked before any weights are read. `allow_pickle` also reads `.bin` weights; `int4`
    reads a GGUF file's Q4_1 matrices as int4 weights (models/gguf.py)."""
    path = resolve(source, allow_patterns=weight_patterns(allow_pickle))
    if path.suffix == ".gguf":
        hf_config, hf_weights = read_gguf(path, int4)
        config = config_from_hf(hf_config)
    else:
        config = config_from_hf(read_json(path / "config.json"))
        hf_weights = read_weights(path, allow_pickle)
    config = LanguageConfig.from_dict({**config.to_dict(), "pretrained": str(source)})
    return config, rename_keys(hf_weights, HF_LLAMA_KEYS, ignore=r"rotary_emb\.inv_freq$")
