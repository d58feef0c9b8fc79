"""Shared fixtures for the data tests: the shapes tokenizer (built once) and a tokenizer with no
ChatML/image/pad tokens."""

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from data import build_shapes_tokenizer, conversation_texts, make_shapes_dataset


@pytest.fixture(scope="session")
def shapes_tokenizer():
    return build_shapes_tokenizer(conversation_texts(make_shapes_dataset("train", 600, seed=0, turns=6)))


@pytest.fixture
def plain_tokenizer():
    """A byte-level BPE with an EOS token only, like many base-model tokenizers."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["</s>"], initial_alphabet=alphabet,
                                  show_progress=False)
    bpe.train_from_iterator(["hello world"] * 10, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="</s>")
