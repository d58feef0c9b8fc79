"""nanoVLM's published checkpoint format (huggingface/nanoVLM; `lusxvr/nanoVLM-*` on the hub) as tinyvlm
models.

    # dispatched here: its config has vit_hidden_dim
    model = VisionLanguageModel.from_pretrained("lusxvr/nanoVLM-460M-8k")
    tokenizer = nanovlm_tokenizer(hf_config)                               # the tokenizer it was trained with

A nanoVLM checkpoint is `config.json` (nanoVLM's `VLMConfig` dataclass through `asdict`) and
`model.safetensors` (its state dict through `safetensors.torch.save_model`). The model is a SigLIP-layout ViT,
a pixel-shuffle projector and a Llama decoder: tinyvlm's own three modules, so loading is a mapping of config
fields and weight names plus three reshapes (the ViT's fused q/k/v projection is split, the ViT position
embedding loses its batch axis, and a tied head, which `save_model` stores once as `decoder.head.weight`,
becomes the token embedding).

What the format fixes, and how it maps (nanoVLM's models/*.py, data/images.py, data/custom_transforms.py):
- images are not normalised (ToTensor only: pixels in [0, 1]), so image_mean 0 and image_std 1;
- the ViT has tanh-GELU MLPs and pre-LayerNorm blocks (fixed in code, no config field); `qkv_proj` is
  cat(q, k, v) along the output axis; with `vit_cls_flag` it prepends a CLS token and returns only that
  (refused);
- the decoder is Llama (RMSNorm, half-rotation RoPE with inv_freq = 1 / lm_re_base ** (2i / head_dim), GQA,
  SwiGLU, no biases); `lm_attn_scaling` multiplies RoPE's cos and sin (only 1 is supported); RoPE's `inv_freq`
  buffer is saved in the checkpoint and is checked against `lm_re_base`;
- `vlm_extra_tokens` are added to the base tokenizer as named special tokens, in the dict's order, so the i-th
  gets id lm_base_vocab_size + i (none is in the SmolLM2 vocabulary; `nanovlm_tokenizer` checks this);
- a prompt is `lm_chat_template` (ChatML) with the image string at the start of the first user message; older
  configs without `max_img_size` resize each image to a square (bilinear) and use
  `<|image|>` x mp_image_token_length; configs with it split images: see `splitting_from_nanovlm`.
Fields used only in training (dropouts, lm_max_length, backbone ids, checkpoint paths) are ignored.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from models.config import LanguageConfig, ProjectorConfig, VisionConfig, VLMConfig
from models.split_config import SplitConfig
from models.weights import CheckpointError, read_weights, rename_keys
from typed_config import ConfigError, one_line

# nanoVLM (huggingface/nanoVLM, models/vision_transformer.py, modality_projector.py, language_model.py) is the
# reference for these names. The fused `vision.blocks.N.attn.qkv_proj.*` is split by `split_fused_qkv`
# afterwards.
NANOVLM_KEYS = [
    (r"^vision_encoder\.patch_embedding\.conv\.", "vision.patch_embedding."),
    (r"^vision_encoder\.patch_embedding\.position_embedding$", "vision.position_embedding"),
    (r"^vision_encoder\.blocks\.(\d+)\.ln1\.", r"vision.blocks.\1.attn_norm."),
    (r"^vision_encoder\.blocks\.(\d+)\.attn\.", r"vision.blocks.\1.attn."),
    (r"^vision_encoder\.blocks\.(\d+)\.ln2\.", r"vision.blocks.\1.mlp_norm."),
    (r"^vision_encoder\.blocks\.(\d+)\.mlp\.", r"vision.blocks.\1."),
    (r"^vision_encoder\.layer_norm\.", "vision.norm."),
    (r"^MP\.proj\.", "projector.proj."),
    (r"^decoder\.token_embedding\.", "language.token_embedding."),
    (r"^decoder\.blocks\.(\d+)\.attn\.out_proj\.", r"language.blocks.\1.attn.o_proj."),
    (r"^decoder\.blocks\.(\d+)\.attn\.", r"language.blocks.\1.attn."),
    (r"^decoder\.blocks\.(\d+)\.mlp\.", r"language.blocks.\1.mlp."),
    (r"^decoder\.blocks\.(\d+)\.norm1\.", r"language.blocks.\1.attn_norm."),
    (r"^decoder\.blocks\.(\d+)\.norm2\.", r"language.blocks.\1.mlp_norm."),
    (r"^decoder\.norm\.", "language.norm."),
    (r"^decoder\.head\.", "language.head."),
]
# a persistent buffer: saved, and loaded by nanoVLM's load_model
INV_FREQ_KEY = "decoder.rotary_embd.inv_freq"

# Special-token ids of the SmolLM2 tokenizers (the cosmo2 vocabulary, 49152 tokens), which nanoVLM's published
# checkpoints use. Stop tokens can be named without downloading the tokenizer only for these.
SMOLLM2_IDS = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
SMOLLM2_TOKENIZERS = re.compile(r"^HuggingFaceTB/(SmolLM2-[\w.-]+|cosmo2-tokenizer)$")
END_OF_TURN = "<|im_end|>"  # what nanoVLM's ChatML chat template writes after every message


def _refuse(field: str, value: Any, why: str) -> CheckpointError:
    """The one-line error for a config field tinyvlm cannot represent (the value as config.json writes it)."""
    return CheckpointError(one_line(f"unsupported nanoVLM config: {field} {json.dumps(value, default=str)} "
                                    f"({why})"))


def extra_token_ids(hf: dict) -> dict[str, int]:
    """The id each of `vlm_extra_tokens` gets, by its attribute name: nanoVLM passes the dict to the tokenizer
    as `extra_special_tokens`, which appends the tokens to the base vocabulary in the dict's order."""
    extra = hf.get("vlm_extra_tokens") or {}
    if not extra:
        return {}
    base = hf.get("lm_base_vocab_size", hf["lm_vocab_size"] - len(extra))
    return {name: base + i for i, name in enumerate(extra)}


def _stop_tokens(hf: dict) -> tuple[int | None, tuple[int, ...]]:
    """(EOS id, stop ids) for a SmolLM2-family `lm_tokenizer`; (None, ()) for any other, whose ids are unknown
    without the tokenizer. nanoVLM stops at the tokenizer's EOS (<|im_end|> for Instruct tokenizers,
    <|endoftext|> for base ones); a chat template's end of turn (<|im_end|>) also ends an answer."""
    name = hf.get("lm_tokenizer") or ""
    if not SMOLLM2_TOKENIZERS.match(name):
        return None, ()
    eos = SMOLLM2_IDS[END_OF_TURN if name.endswith("-Instruct") else "<|endoftext|>"]
    template = hf.get("lm_chat_template") or ""
    stops = [SMOLLM2_IDS[END_OF_TURN]] if END_OF_TURN in template else []
    return eos, tuple(dict.fromkeys([*stops, eos]))


def splitting_from_nanovlm(hf: dict) -> SplitConfig:
    """nanoVLM's image splitting for this config (data/images.py, data/custom_transforms.py).

    Without `max_img_size` (configs before July 2025): no splitting, one square bilinear resize to
    `vit_img_size`.
    With it: the image is resized (bicubic) so that its longer side is `max_img_size`
    (`resize_to_max_side_len`) and its shorter side is rounded up to a multiple of `vit_img_size`, then cut
    into tiles of `vit_img_size`; unless the grid is 1x1, a global image (the resized image scaled down to one
    tile) goes first. Prompt: global_image_token + image tokens, then for each tile row by row
    `<row_R_col_C>` + image tokens. Only the layout with a global image and the resize to the full
    `max_img_size` are representable; the others are refused."""
    extra, tile = hf.get("vlm_extra_tokens") or {}, hf["vit_img_size"]
    if "max_img_size" not in hf:
        return SplitConfig(enabled=False, max_image_size=tile, layout="nanovlm", resample="bilinear")
    size = hf["max_img_size"]
    if "global_image_token" not in extra:
        raise _refuse("vlm_extra_tokens", "without global_image_token",
                      "splitting without a global_image_token: nanoVLM's July 2025 layout, not tinyvlm's "
                      "'nanovlm'")
    if not hf.get("resize_to_max_side_len", True):
        raise _refuse("resize_to_max_side_len", False,
                      "nanoVLM then rounds the longer side up to whole tiles, at "
                      "most max_img_size; tinyvlm's splitting always scales it to max_image_size")
    if not isinstance(size, int) or size < tile or size % tile:
        raise _refuse("max_img_size", size, f"must be a whole multiple of vit_img_size {tile}")
    grid = size // tile
    missing = [
        f"r{r}c{c}" for r in range(1, grid + 1) for c in range(1, grid + 1) if f"r{r}c{c}" not in extra
    ]
    if grid > 1 and missing:
        raise _refuse("vlm_extra_tokens", f"without {missing[0]}",
                      f"a {grid}x{grid} grid of tiles needs a row/column token for each")
    return SplitConfig(enabled=True, max_image_size=size, layout="nanovlm", resample="bicubic")


def config_from_nanovlm(hf: dict) -> VLMConfig:
    """Our config for a nanoVLM `config.json`; CheckpointError (one line, naming the field) for what tinyvlm
    cannot run exactly as nanoVLM does."""
    required = ("vit_hidden_dim", "vit_inter_dim", "vit_patch_size", "vit_img_size", "vit_n_heads",
                "vit_n_blocks", "lm_hidden_dim", "lm_inter_dim", "lm_vocab_size", "lm_n_heads",
                "lm_n_kv_heads", "lm_n_blocks", "mp_pixel_shuffle_factor")
    if missing := [name for name in required if name not in hf]:
        raise CheckpointError(f"nanoVLM config.json: missing field {missing[0]}")
    if hf.get("vit_cls_flag", False):
        raise _refuse("vit_cls_flag", hf["vit_cls_flag"], "a CLS token, and a ViT that returns only it")
    if float(hf.get("lm_attn_scaling", 1.0)) != 1.0:
        raise _refuse("lm_attn_scaling", hf["lm_attn_scaling"],
                      "RoPE cos and sin scaled; only 1.0 is supported")
    extra = hf.get("vlm_extra_tokens")
    if not isinstance(extra, dict) or "image_token" not in extra:
        raise _refuse("vlm_extra_tokens", extra,
                      "no image_token: a nanoVLM v0.1 checkpoint such as nanoVLM-222M, "
                      "which prepends image embeddings without placeholder tokens")
    ids = extra_token_ids(hf)
    if max(ids.values()) >= hf["lm_vocab_size"]:
        raise _refuse("lm_vocab_size", hf["lm_vocab_size"],
                      f"smaller than lm_base_vocab_size + len(vlm_extra_tokens) = {max(ids.values()) + 1}")
    eos, stops = _stop_tokens(hf)
    try:
        vision = VisionConfig(
            image_size=hf["vit_img_size"], patch_size=hf["vit_patch_size"], hidden_size=hf["vit_hidden_dim"],
            intermediate_size=hf["vit_inter_dim"], num_layers=hf["vit_n_blocks"], num_heads=hf["vit_n_heads"],
            num_channels=3, layer_norm_eps=float(hf.get("vit_ln_eps", 1e-6)),
            image_mean=(0.0, 0.0, 0.0), image_std=(1.0, 1.0, 1.0))
        language = LanguageConfig(
            vocab_size=hf["lm_vocab_size"], hidden_size=hf["lm_hidden_dim"],
            intermediate_size=hf["lm_inter_dim"], num_layers=hf["lm_n_blocks"], num_heads=hf["lm_n_heads"],
            num_kv_heads=hf["lm_n_kv_heads"],
            max_position_embeddings=hf.get("lm_max_position_embeddings", 8192),
            rope_theta=float(hf.get("lm_re_base", 100000)), rms_norm_eps=float(hf.get("lm_rms_eps", 1e-5)),
            tie_word_embeddings=bool(hf.get("lm_tie_weights", True)), eos_token_id=eos)
        config = VLMConfig(vision=vision,
                           projector=ProjectorConfig(pixel_shuffle_factor=hf["mp_pixel_shuffle_factor"]),
                           language=language, splitting=splitting_from_nanovlm(hf),
                           image_token_id=ids["image_token"], image_position="before_text",
                           stop_token_ids=stops)
    except ConfigError as e:
        raise CheckpointError(one_line(f"nanoVLM config.json does not make a valid model: {e}")) from None
    length = hf.get("mp_image_token_length", config.tokens_per_image)
    if length != config.tokens_per_image:
        raise _refuse("mp_image_token_length", length,
                      f"the projector gives {config.tokens_per_image} tokens per "
                      f"image ({vision.grid_size}x{vision.grid_size} patches, pixel shuffle "
                      f"{config.projector.pixel_shuffle_factor})")
    return config


def split_fused_qkv(weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """`vision.blocks.N.attn.qkv_proj.{weight,bias}` (nanoVLM's fused projection: q, k, v concatenated along
    the output axis) as `q_proj`, `k_proj` and `v_proj`; other keys as they are."""
    split = {}
    for key, value in weights.items():
        fused = re.fullmatch(r"(vision\.blocks\.\d+\.attn\.)qkv_proj\.(weight|bias)", key)
        if not fused:
            split[key] = value
            continue
        if value.shape[0] % 3:
            raise CheckpointError(
                f"{key}: fused q/k/v with {value.shape[0]} output rows, not a multiple of 3"
            )
        for name, part in zip(("q_proj", "k_proj", "v_proj"), value.chunk(3, dim=0)):
            split[f"{fused[1]}{name}.{fused[2]}"] = part
    return split


def _check_inv_freq(inv_freq: Tensor, config: LanguageConfig, source: str | Path) -> None:
    """nanoVLM loads RoPE's frequencies from the checkpoint: they must be the ones tinyvlm computes."""
    expected = 1.0 / config.rope_theta ** (torch.arange(0, config.head_dim, 2).float() / config.head_dim)
    if inv_freq.shape != expected.shape or not torch.allclose(inv_freq.float(),
                                                              expected.to(inv_freq.dtype).float(), rtol=1e-3,
                                                              atol=0):
        raise CheckpointError(f"{source}: {INV_FREQ_KEY} is not 1 / lm_re_base ** (2i / head_dim) for "
                              f"lm_re_base {config.rope_theta:g} and head_dim {config.head_dim} (a RoPE "
                              "variant tinyvlm lacks)")


def to_tinyvlm_weights(weights: dict[str, Tensor], config: VLMConfig,
                       source: str | Path = "checkpoint") -> dict[str, Tensor]:
    """A nanoVLM state dict under tinyvlm's names and shapes (keys that match no rule are kept, so that
    `load_checked` reports them)."""
    weights = dict(weights)
    if (inv_freq := weights.pop(INV_FREQ_KEY, None)) is not None:
        _check_inv_freq(inv_freq, config.language, source)
    weights = split_fused_qkv(rename_keys(weights, NANOVLM_KEYS))
    position = weights.get("vision.position_embedding")
    if position is not None and position.dim() == 3 and position.shape[0] == 1:  # [1, N, C] -> [N, C]
        weights["vision.position_embedding"] = position[0]
    if config.language.tie_word_embeddings and "language.token_embedding.weight" not in weights:
        # save_model keeps one name of a shared tensor, the first in sorted order: decoder.head.weight.
        if "language.head.weight" in weights:
            weights["language.token_embedding.weight"] = weights.pop("language.head.weight")
    return weights


def read_nanovlm(
    path: Path, hf_config: dict, allow_pickle: bool = False
) -> tuple[VLMConfig, dict[str, Tensor]]:
    """The tinyvlm config and weights (tinyvlm's names) of the nanoVLM checkpoint directory `path`."""
    config = config_from_nanovlm(hf_config)
    return config, to_tinyvlm_weights(read_weights(path, allow_pickle), config, path)


def nanovlm_tokenizer(hf_config: dict):
    """The tokenizer a nanoVLM checkpoint is used with, built as nanoVLM builds it (data/images.py): the base
    tokenizer `lm_tokenizer` (hub id or local directory) with `vlm_extra_tokens` as named special tokens (so
    `tokenizer.image_token` etc. exist), `lm_chat_template` as its chat template, and its EOS as pad token.
    CheckpointError if the tokenizer cannot be had, or gives the extra tokens other ids than the config
    expects."""
    from transformers import AutoTokenizer

    kwargs: dict[str, Any] = {"use_fast": True}
    if hf_config.get("vlm_extra_tokens") is not None:
        kwargs["extra_special_tokens"] = dict(hf_config["vlm_extra_tokens"])
    if hf_config.get("lm_chat_template") is not None:
        kwargs["chat_template"] = hf_config["lm_chat_template"]
    name = hf_config.get("lm_tokenizer")
    if not name:
        raise CheckpointError("nanoVLM config.json: missing field lm_tokenizer")
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, **kwargs)
    except (OSError, ValueError) as e:
        raise CheckpointError(one_line(f"{name}: the tokenizer could not be loaded ({type(e).__name__}: {e})",
                                       300)) from None
    tokenizer.pad_token = tokenizer.eos_token
    extra = hf_config.get("vlm_extra_tokens") or {}
    for attribute, expected in extra_token_ids(hf_config).items():
        got = tokenizer.convert_tokens_to_ids(extra[attribute])
        if got != expected:
            raise CheckpointError(f"{name}: {extra[attribute]} got id {got}, but the checkpoint's embeddings "
                                  f"expect {expected} (lm_base_vocab_size + its place in vlm_extra_tokens)")
    return tokenizer
