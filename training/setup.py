"""The model and tokenizer a run trains: built from the config, or read from the checkpoint it resumes."""

from __future__ import annotations

from pathlib import Path

from data import (
    IMAGE_TOKEN,
    build_shapes_tokenizer,
    conversation_texts,
    marker_tokens,
    prepare_tokenizer,
    stop_token_ids,
    token_id,
)
from models import VisionLanguageModel, VLMConfig
from models.checkpoints import SHARDED
from models.loading import resolve
from training import distributed
from training.config import RunConfig


def build_tokenizer(config: RunConfig, train_dataset):
    """The configured Hugging Face tokenizer, or (none configured) a byte-level BPE trained on the training texts."""
    if config.tokenizer is None:
        return build_shapes_tokenizer(conversation_texts(train_dataset))
    from transformers import AutoTokenizer

    path = resolve(config.tokenizer)
    if path.suffix == ".gguf":
        return prepare_tokenizer(AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name))
    return prepare_tokenizer(AutoTokenizer.from_pretrained(path))


def build_model(config: RunConfig, tokenizer) -> VisionLanguageModel:
    """The VLM with its backbones loaded (where configured) and its vocabulary sized to the tokenizer."""
    # The image and stop tokens may be new to a pretrained LM's vocabulary: they are set once it is resized.
    settings = {"image_token_id": None, "stop_token_ids": ()}
    prepare_tokenizer(tokenizer, marker_tokens(config.model))  # image splitting's markers: random rows in a new LM
    if not config.model.language.pretrained:  # a pretrained LM brings its own vocabulary and EOS
        settings.update({"language.vocab_size": len(tokenizer), "language.eos_token_id": tokenizer.eos_token_id})
    model = VisionLanguageModel.from_backbones(config.model.replace(settings), config.train.allow_pickle)
    prepare_tokenizer(tokenizer, marker_tokens(model.config))  # a pretrained ViT may bring another tile size
    model.resize_token_embeddings(len(tokenizer), token_id(tokenizer, IMAGE_TOKEN))
    model.config = model.config.replace({"stop_token_ids": stop_token_ids(tokenizer)})
    return model


def load_for_resume(checkpoint: Path) -> tuple[VisionLanguageModel, object]:
    """The model and tokenizer of a checkpoint to resume; a sharded (FSDP2) one gets its weights from its shards
    later."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    if (checkpoint / SHARDED).is_dir():
        return VisionLanguageModel(VLMConfig.from_json(checkpoint / "config.json")), tokenizer
    return VisionLanguageModel.from_pretrained(checkpoint), tokenizer


def unsharded(model, config: RunConfig, checkpoint: Path, ranks: distributed.Ranks) -> VisionLanguageModel | None:
    """The trained model as one ordinary module on rank 0 (None elsewhere). An FSDP2 model is gathered from its
    shards (every rank takes part) and also saved in the `save_pretrained` layout into the final checkpoint."""
    if not distributed.is_sharded(model):
        return distributed.unwrap(model) if ranks.is_main else None
    weights = distributed.full_state_dict(model)
    if not ranks.is_main:
        return None
    plain = VisionLanguageModel(config.model)
    plain.load_state_dict(weights)
    plain.save_pretrained(checkpoint)
    return plain
