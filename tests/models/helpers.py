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


IDEFICS3_TOKENS = ["<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>",
                   *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7))]
# SmolVLM-Instruct's chat template: "User:<image>question<end_of_utterance>\nAssistant:".
SMOLVLM_CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def save_tiny_idefics3(directory: Path, seed: int = 0, tie: bool = False, split: bool = True):
    """A random Idefics3ForConditionalGeneration (SmolVLM's layout, tiny: 32 px tiles of 4 tokens, images split up to
    96 px) with its processor (tokenizer, image processor, chat template), saved as a transformers checkpoint;
    returns the transformers model and processor."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessor,
        Idefics3Processor,
        PreTrainedTokenizerFast,
    )

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", *IDEFICS3_TOKENS],
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(["User: what colour is the sky? Assistant: blue, the sky is blue"] * 10, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<end_of_utterance>",
                                        bos_token="<|im_start|>", pad_token="<|endoftext|>")
    image_processor = Idefics3ImageProcessor(do_image_splitting=split, size={"longest_edge": 96},
                                             max_image_size={"longest_edge": 32})
    processor = Idefics3Processor(image_processor, tokenizer, image_seq_len=4, chat_template=SMOLVLM_CHAT_TEMPLATE)
    torch.manual_seed(seed)
    config = Idefics3Config(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=32, patch_size=8),
        text_config=dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                         max_position_embeddings=512, rope_theta=5000.0, rms_norm_eps=1e-5,
                         eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=tie),
        scale_factor=2, image_token_id=tokenizer.convert_tokens_to_ids("<image>"), tie_word_embeddings=tie)
    model = Idefics3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # larger than the default init, so greedy decoding wanders through the vocabulary
        for name, p in model.named_parameters():
            if p.dim() > 1 and "embeddings" not in name:
                p.normal_(0, 0.2)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return model, processor
