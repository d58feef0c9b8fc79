"""Incremental detokenization against decoding everything at once, on tokenizers whose output depends on
context."""

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from data.detokenizer import IncrementalDetokenizer

TEXT = "Über café naïve 😀 — 東京 is big. Hello world!\nA second line, ünïcödé again 🙂🙃."


def sentencepiece_like() -> PreTrainedTokenizerFast:
    """A BPE with SentencePiece's "▁" word marks and byte fallback (Llama's scheme): a word's leading space
    exists only in context, and a character outside the vocabulary is cut into byte tokens."""
    bpe = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Metaspace()
    bpe.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "</s>", *bytes_],
                                  show_progress=False)
    bpe.train_from_iterator(["hello world, a big line again"] * 10, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="</s>", unk_token="<unk>")


@pytest.fixture(params=["byte-level", "sentencepiece-like", "shapes"])
def tokenizer(request, plain_tokenizer, shapes_tokenizer):
    return {"byte-level": plain_tokenizer, "sentencepiece-like": sentencepiece_like(),
            "shapes": shapes_tokenizer}[request.param]


def test_pieces_add_up_to_the_whole_decoding(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    # a special token mid-stream is skipped, as in a whole decoding
    ids.insert(len(ids) // 2, tokenizer.eos_token_id)
    expected = tokenizer.decode(ids, skip_special_tokens=True)
    rng = random.Random(0)
    for _ in range(5):  # one token at a time, and in random chunks (the engine's steps may bring several)
        detokenizer, pieces, i = IncrementalDetokenizer(tokenizer), [], 0
        while i < len(ids):
            step = 1 if not pieces else rng.randint(1, 3)
            pieces.append(detokenizer.add(ids[i : i + step]))
            i += step
        pieces.append(detokenizer.finish())
        assert "".join(pieces) == detokenizer.text == expected
        assert not any("\ufffd" in piece for piece in pieces)


def test_a_cut_character_waits_and_a_dangling_one_is_kept_at_the_end(plain_tokenizer):
    ids = plain_tokenizer.encode("a😀", add_special_tokens=False)
    assert len(ids) >= 3  # "a" and the emoji's bytes
    detokenizer = IncrementalDetokenizer(plain_tokenizer)
    assert detokenizer.add(ids[:1]) == "a"
    assert [detokenizer.add([i]) for i in ids[1:-1]] == [""] * (len(ids) - 2)
    assert detokenizer.add(ids[-1:]) == "😀"
    truncated = IncrementalDetokenizer(plain_tokenizer)
    assert truncated.add(ids[:-1]) == ""  # "a" and a cut emoji: all of it waits
    # as a whole decoding: "a\ufffd"
    assert truncated.finish() == truncated.text == plain_tokenizer.decode(ids[:-1])


def test_each_step_decodes_a_few_tokens_not_all_of_them(plain_tokenizer):
    decoded = []
    decode = plain_tokenizer.decode
    plain_tokenizer.decode = lambda ids, **kwargs: decoded.append(len(ids)) or decode(ids, **kwargs)
    ids = plain_tokenizer.encode("hello world " * 200, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(plain_tokenizer)
    for token in ids:
        detokenizer.add([token])
    assert detokenizer.text == decode(ids)
    assert sum(decoded) < 6 * len(ids)  # decoding everything each step: len(ids)**2 / 2
