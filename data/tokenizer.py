"""Tokenizers for tinyvlm: ChatML + image special tokens, a small BPE for the shapes data, and adapting any HF
tokenizer."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from models.errors import TinyVLMError

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
IMAGE_TOKEN = "<|image|>"  # one per image embedding; the VLM splices image features in at these positions
PAD_TOKEN = "<|pad|>"


class TokenizerError(TinyVLMError, ValueError):
    """A tokenizer that lacks a token tinyvlm needs."""


CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_shapes_tokenizer(texts: Iterable[str], vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on `texts` (plus the ChatML role headers), with ChatML, image and pad special
    tokens.

    Byte-level, so any string encodes; trained on the small synthetic corpus, so its words are mostly one
    token each. Training is deterministic. The vocabulary may end up smaller than `vocab_size` when the corpus
    runs out of merges.
    """
    specials = [PAD_TOKEN, IM_START, IM_END, IMAGE_TOKEN]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False
    )
    bpe.train_from_iterator([*texts, "user\n", "assistant\n"], trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        extra_special_tokens=[IM_START, IMAGE_TOKEN],
        chat_template=CHAT_TEMPLATE,
    )


def prepare_tokenizer(tokenizer: PreTrainedTokenizerBase,
                      extra_tokens: Iterable[str] = ()) -> PreTrainedTokenizerBase:
    """Add `<|image|>` (and ChatML tokens and a pad token where missing) as special tokens, in place; return
    it. `extra_tokens` are added too where missing: image splitting's marker tokens
    (`data.marker_tokens(config)`).

    The caller then resizes the LM's embeddings to `len(tokenizer)`.
    """
    missing = [
        t
        for t in dict.fromkeys((IM_START, IM_END, IMAGE_TOKEN, *extra_tokens))
        if not has_token(tokenizer, t)
    ]
    if missing:
        tokenizer.add_special_tokens({"extra_special_tokens": missing}, replace_extra_special_tokens=False)
    if tokenizer.pad_token is None:
        tokenizer.add_special_tokens({"pad_token": PAD_TOKEN})
    return tokenizer


def has_token(tokenizer: PreTrainedTokenizerBase, token: str) -> bool:
    token_id = tokenizer.convert_tokens_to_ids(token)
    return token_id is not None and tokenizer.convert_ids_to_tokens(token_id) == token


def token_id(tokenizer: PreTrainedTokenizerBase, token: str) -> int:
    """The id of a special token such as `IMAGE_TOKEN`; ValueError if the tokenizer lacks it."""
    if not has_token(tokenizer, token):
        raise TokenizerError(f"the tokenizer has no {token} token; call data.prepare_tokenizer(tokenizer) "
                             "first")
    return tokenizer.convert_tokens_to_ids(token)


def stop_token_ids(tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """The tokens that end an answer: `<|im_end|>` (training closes every answer with it) and the tokenizer's
    EOS, which a base tokenizer sets to another token (`<|endoftext|>`, `</s>`)."""
    ids = [token_id(tokenizer, IM_END), tokenizer.eos_token_id]
    return tuple(dict.fromkeys(i for i in ids if i is not None))


def conversation_texts(dataset: Iterable[dict]) -> Iterator[str]:
    """Every user and assistant string of the records (a tokenizer corpus); a Dataset's images are not even
    decoded."""
    for record in _texts_only(dataset):
        for turn in record["texts"]:
            yield turn["user"]
            yield turn["assistant"]


def text_lengths(dataset: Iterable[dict]) -> list[int]:
    """Characters of conversation text per record, a cheap stand-in for its token count (images are not
    decoded; malformed texts count 0 and are reported when the record is read)."""
    def chars(turns) -> int:
        if not isinstance(turns, list):
            return 0
        return sum(len(text) for turn in turns if isinstance(turn, dict)
                   for text in turn.values() if isinstance(text, str))

    return [chars(record.get("texts")) for record in _texts_only(dataset)]


def _texts_only(dataset: Iterable[dict]) -> Iterable[dict]:
    if isinstance(dataset, Dataset):
        return dataset.with_format(None).select_columns(["texts"])  # also skips transforms that open images
    return dataset
