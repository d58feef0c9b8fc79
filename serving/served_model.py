"""The narrow interface through which the serving engine and its runner run a VisionLanguageModel: embed
tokens (and splice image features), run the blocks over a paged KV layout, logits from hidden states, the KV
shape, and the few facts of the model's config a request is checked against. The only module of serving/ that
reads the model's attributes; a model of another build would plug in by giving the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from data.chat_processors import ChatProcessor
from models import LanguageModel, VisionLanguageModel, kv_cache_bytes
from models.kv_cache import Layout, with_layout
from serving.packed_linear import packed_copy


@dataclass(frozen=True)
class KVShape:
    """The model's attention as a paged KV pool holds it: per layer, keys and values of `kv_heads` heads of
    `head_dim` in `dtype`; `heads` query heads read them."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    token_bytes: int  # the KV cache a token takes: every layer's keys and values


class ServedModel:
    """A VisionLanguageModel (put in eval mode) as the engine runs it; its blocks and head are `language`'s
    where given (a copy on the same parameters: `with_packed_linears`)."""

    def __init__(self, model: VisionLanguageModel, language: LanguageModel | None = None) -> None:
        self._model = model.eval()
        self._language = language or model.language
        config, language = model.config, model.language.config
        weight = model.language.token_embedding.weight
        self.device = weight.device
        self.kv = KVShape(language.num_layers, language.num_heads, language.num_kv_heads, language.head_dim,
                          weight.dtype, kv_cache_bytes(language, batch=1, tokens=1, dtype=weight.dtype))
        self.context = language.max_position_embeddings  # the most tokens a sequence holds
        self.vocab_size = model.language.head.out_features  # the logits' width
        self.stop_ids: list[int] = config.stop_ids
        self.image_token_id: int | None = config.image_token_id
        self.tokens_per_image = config.tokens_per_image

    def chat_processor(self, tokenizer) -> ChatProcessor:
        """tinyvlm's ChatML processor around `tokenizer`, with the model's image position and splitting."""
        return ChatProcessor.from_config(self._model.config, tokenizer)

    def check_image_tokens(self, num_slots: int, num_features: int) -> None:
        """InputError unless a prompt's `num_slots` image placeholders are one per image feature."""
        self._model.check_image_tokens(num_slots, num_features)

    def image_features(self, images: Tensor) -> Tensor:
        """The LM-space embeddings of `images` [N, C, H, W], one row per image token: [N x tokens, hidden].
        Pinned pixels go to the device without the host waiting for it (Engine.prepare pins them)."""
        return self._model.image_features(images.to(self.device, non_blocking=True)).flatten(0, 1)

    def embed_tokens(self, tokens: Tensor) -> Tensor:
        """Token embeddings [1, N, hidden] of one packed row of N token ids (a decode step's: no images)."""
        return self._model.language.token_embedding(tokens)[None]

    def embed(self, tokens: Tensor, features: Tensor | None, slots: Tensor) -> Tensor:
        """Embeddings [1, N, hidden] of one packed row of N token ids with image `features` (rows of
        `image_features`) written at `slots` (their indices among the N); InputError if they do not fit."""
        return self._model.embed(tokens[None], features=features, slots=slots)

    def hidden_states(self, embeddings: Tensor, pools: list[dict[str, Tensor]], layout: Layout) -> Tensor:
        """The final hidden states [N, hidden] of one packed row of embeddings [1, N, hidden], every block
        writing and reading its pool ({"key", "value"}, one per layer) through `layout`."""
        hidden, _ = self._language(embeddings, kv_cache=with_layout(pools, layout))
        return hidden[0]

    def logits(self, hidden: Tensor) -> Tensor:
        """The logits [N, vocab] of hidden states [N, hidden]."""
        return self._language.head(hidden)

    def with_packed_linears(self) -> ServedModel:
        """This model with its language model's linears through oneDNN on prepacked weights (a copy on the
        same parameters: serving/packed_linear.py); the model itself is unchanged."""
        return ServedModel(self._model, packed_copy(self._model.language))
