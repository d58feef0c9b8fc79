"""The model and chat processor (tokenizer and conversation format) a run trains: built from the config,
loaded from the pretrained VLM it starts from (`init_from`), or read from the checkpoint it resumes."""

from __future__ import annotations

import itertools
from pathlib import Path

import torch

from data import (
    IMAGE_TOKEN,
    build_shapes_tokenizer,
    conversation_texts,
    marker_tokens,
    prepare_tokenizer,
    stop_token_ids,
    token_id,
)
from data.chat_processors import ChatProcessor, CheckpointProcessor, ConversationEncoder
from data.video import video_wording
from loading import PROCESSOR_FILES, SHARDED, find_checkpoint, load_with_processor
from models import VisionLanguageModel, VLMConfig
from models.lora import adapter_base
from models.weights import CheckpointError, resolve
from training import distributed
from training.config import RunConfig


def build_tokenizer(config: RunConfig, train_dataset):
    """The configured Hugging Face tokenizer, or (none configured) a byte-level BPE trained on the training
    texts."""
    if config.tokenizer is None:
        texts = conversation_texts(train_dataset)
        if "video" in getattr(train_dataset, "column_names", ()):  # clips: SmolVLM2's wording, once a record
            texts = itertools.chain(texts, [video_wording(config.model.video)] * len(train_dataset))
        return build_shapes_tokenizer(texts)
    from transformers import AutoTokenizer

    path = resolve(config.tokenizer)
    if path.suffix == ".gguf":
        return prepare_tokenizer(AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name))
    return prepare_tokenizer(AutoTokenizer.from_pretrained(path))


def build_model(config: RunConfig, tokenizer) -> VisionLanguageModel:
    """The VLM with its backbones loaded (where configured) and its vocabulary sized to the tokenizer."""
    # The image and stop tokens may be new to a pretrained LM's vocabulary: they are set once it is resized.
    settings = {"image_token_id": None, "stop_token_ids": ()}
    # image splitting's markers: random rows in a new LM
    prepare_tokenizer(tokenizer, marker_tokens(config.model))
    if not config.model.language.pretrained:  # a pretrained LM brings its own vocabulary and EOS
        settings.update({"language.vocab_size": len(tokenizer),
                         "language.eos_token_id": tokenizer.eos_token_id})
    model = VisionLanguageModel.from_backbones(config.model.replace(settings), config.train.allow_pickle)
    prepare_tokenizer(tokenizer, marker_tokens(model.config))  # a pretrained ViT may bring another tile size
    model.resize_token_embeddings(len(tokenizer), token_id(tokenizer, IMAGE_TOKEN))
    model.config = model.config.replace({"stop_token_ids": stop_token_ids(tokenizer)})
    return model


def load_pretrained(config: RunConfig) -> tuple[VisionLanguageModel, ConversationEncoder]:
    """The model and chat processor `config.init_from` names (see `load_start`); with train.lora, its place is
    resolved once, here, for the adapters' checkpoints to name (`model.lora_base`)."""
    model, processor = load_start(config.init_from, config.train.allow_pickle)
    if config.train.lora.rank:
        model.lora_base = adapted_checkpoint(config.init_from)
    return model, processor


def adapted_checkpoint(init_from: str) -> str:
    """Where an adapter's base model is: a local start as the absolute path of its very checkpoint (a run
    directory goes on training: its newest checkpoint would change), a hub id as it is."""
    path = Path(init_from).expanduser()
    return str(find_checkpoint(path).resolve()) if path.exists() else init_from


def load_start(source: str, allow_pickle: bool = False) -> tuple[VisionLanguageModel, ConversationEncoder]:
    """A whole VLM to train from, and its chat processor, loaded as inference loads them but unfused
    (`load_with_processor`): tinyvlm's own checkpoint with its tokenizer, a nanoVLM one with the tokenizer it
    was trained with, a SmolVLM / Idefics3 one with its own processor (chat template, image processor). The
    model keeps its vocabulary: the tokenizer must fit it."""
    model, processor = load_with_processor(source, torch.device("cpu"), allow_pickle)
    model.train()
    vocab, tokens = model.config.language.vocab_size, len(processor.tokenizer)
    if tokens > vocab:
        raise CheckpointError(f"{source}: its tokenizer has {tokens} tokens, more than the model's {vocab} "
                              "embeddings")
    expected = (model.config.image_token_id, model.config.tokens_per_image)
    if (processor.image_token_id, processor.tokens_per_image) != expected:
        raise CheckpointError(f"{source}: its processor writes {processor.tokens_per_image} image tokens of "
                              f"id {processor.image_token_id} per tile, the model expects {expected[1]} of "
                              f"id {expected[0]}")
    # Backbones a tinyvlm checkpoint was once built from are history here: the run starts from this
    # checkpoint.
    settings: dict = {"vision.pretrained": None, "language.pretrained": None}
    # answers end with <|im_end|>
    if not model.config.stop_token_ids and isinstance(processor, ChatProcessor):
        settings["stop_token_ids"] = stop_token_ids(processor.tokenizer)
    model.config = model.config.replace(settings)
    return model, processor


def load_for_resume(checkpoint: Path) -> tuple[VisionLanguageModel, ConversationEncoder]:
    """The model and chat processor of a checkpoint to resume (its own processor files when it has them, else
    its tokenizer with tinyvlm's ChatML); a sharded (FSDP2) one gets its weights from its shards later."""
    from transformers import AutoTokenizer

    base = adapter_base(checkpoint)
    # a LoRA run's checkpoint: the model it adapts, loaded as the run loaded it (the run puts the
    # checkpoint's adapters back on it after quantizing it if it did: training/run.py _adapt)
    if base is not None:
        model, _ = load_start(base)
        model.lora_base = base
    elif (checkpoint / SHARDED).is_dir():
        model = VisionLanguageModel(VLMConfig.from_json(checkpoint / "config.json"))
    else:
        model = VisionLanguageModel.from_pretrained(checkpoint)
    if any((checkpoint / name).is_file() for name in PROCESSOR_FILES):
        return model, CheckpointProcessor.from_pretrained(checkpoint)
    return model, ChatProcessor.from_config(model.config, AutoTokenizer.from_pretrained(checkpoint))


def unsharded(model, config: RunConfig, checkpoint: Path,
              ranks: distributed.Ranks) -> VisionLanguageModel | None:
    """The trained model as one ordinary module on rank 0 (None elsewhere). An FSDP2 model is gathered from
    its shards (every rank takes part) and also saved in the `save_pretrained` layout into the final
    checkpoint."""
    if not distributed.is_sharded(model):
        return distributed.unwrap(model) if ranks.is_main else None
    weights = distributed.full_state_dict(model)
    if not ranks.is_main:
        return None
    plain = VisionLanguageModel(config.model)
    plain.load_state_dict(weights)
    plain.save_pretrained(checkpoint)
    return plain


def model_and_processor(config: RunConfig, resume: Path | None,
                        train_dataset) -> tuple[VisionLanguageModel, ConversationEncoder]:
    """What a run trains and how it encodes records: the checkpoint it resumes, the VLM it starts from
    (init_from), or a model built from the config with a tokenizer (trained on `train_dataset`'s texts if none
    is configured)."""
    if resume:
        return load_for_resume(resume)  # its own checkpoint: never init_from again
    if config.init_from:
        return load_pretrained(config)
    tokenizer = build_tokenizer(config, train_dataset)
    model = build_model(config, tokenizer)
    # split if config.model.splitting says so
    return model, ChatProcessor.from_config(model.config, tokenizer)
