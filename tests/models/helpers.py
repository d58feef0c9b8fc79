"""Small random models for tests: reference checkpoints built with transformers, and a tiny VLM of ours."""

from __future__ import annotations

from pathlib import Path

import torch

from models import LanguageConfig, VisionConfig, VisionLanguageModel, VLMConfig


def save_tiny_llama(directory: Path, tie: bool, vocab_size: int = 128, seed: int = 0):
    """A random GQA LlamaForCausalLM saved as a Hugging Face checkpoint; returns the transformers model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256,
                         rope_theta=5000.0, rms_norm_eps=1e-5, tie_word_embeddings=tie, eos_token_id=3)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # bigger weights than the default init, so outputs vary strongly from token to token
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    model.save_pretrained(directory)
    return model


def tiny_vlm_config(**language) -> VLMConfig:
    lang = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4, num_kv_heads=2,
                max_position_embeddings=128, eos_token_id=2)
    return VLMConfig(
        vision=VisionConfig(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64, num_layers=2,
                            num_heads=4),
        language=LanguageConfig(**{**lang, **language}),
        image_token_id=95,
    )


def tiny_vlm(seed: int = 0, **language) -> VisionLanguageModel:
    """A random tiny VLM whose weights are large enough that greedy decoding wanders through the vocabulary."""
    torch.manual_seed(seed)
    model = VisionLanguageModel(tiny_vlm_config(**language)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    return model


def base_tokenizer():
    """A base-model tokenizer: its EOS is `</s>`; prepare_tokenizer adds the ChatML, image and pad tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from data import prepare_tokenizer

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(["what colour is the sky? blue, the sky is blue"] * 10, trainer)
    return prepare_tokenizer(PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="</s>"))


def chat_vlm(tokenizer, seed: int = 5, **language) -> VisionLanguageModel:
    """A random tiny VLM for `tokenizer` (its image token, and stop tokens <|im_end|> and EOS), context 512."""
    from data import IMAGE_TOKEN, stop_token_ids, token_id

    model = tiny_vlm(seed=seed, vocab_size=len(tokenizer), max_position_embeddings=512, **language)
    model.config = model.config.replace({"image_token_id": token_id(tokenizer, IMAGE_TOKEN),
                                         "stop_token_ids": stop_token_ids(tokenizer)})
    return model
