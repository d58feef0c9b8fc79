"""Batches: answer-only targets aligned with the logits, image tokens and images in order, padding,
dropping."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from data import (
    IGNORE_INDEX,
    IMAGE_TOKEN,
    ImageProcessor,
    VQACollator,
    encode_conversation,
    left_pad,
    make_shapes_dataset,
    token_id,
)

TOKENS_PER_IMAGE = 4


def solid(value: int) -> Image.Image:
    return Image.new("RGB", (16, 16), (value, 255 - value, 7))


def records_with_images(counts: list[int]) -> list[dict]:
    """Records holding `counts[i]` images each; every image a distinct solid colour, numbered in reading
    order."""
    records, value = [], 0
    for i, count in enumerate(counts):
        images = [solid(value + k) for k in range(count)]
        value += count
        texts = [{"user": f"question {i}?", "assistant": f"answer {i}" + " yes" * i}]
        records.append({"images": images, "texts": texts})
    return records


@pytest.fixture
def collator(shapes_tokenizer):
    return VQACollator(shapes_tokenizer, ImageProcessor(16), TOKENS_PER_IMAGE, max_length=512)


def answer_runs(targets: torch.Tensor) -> list[list[int]]:
    """The target tokens in contiguous runs (one run per answer)."""
    runs, current = [], []
    for token in targets.tolist() + [IGNORE_INDEX]:
        if token != IGNORE_INDEX:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return runs


def test_only_answers_and_their_end_token_are_targets(collator, shapes_tokenizer):
    records = list(make_shapes_dataset("train", 8, seed=0, turns=4))
    batch = collator(records)
    for row, record in enumerate(records):
        decoded = [shapes_tokenizer.decode(run) for run in answer_runs(batch["targets"][row])]
        assert decoded == [turn["assistant"] + "<|im_end|>" for turn in record["texts"]]


def test_targets_are_the_next_input_token(collator):
    batch = collator(list(make_shapes_dataset("train", 8, seed=1, turns=3)))
    ids, targets = batch["input_ids"], batch["targets"]
    where = targets != IGNORE_INDEX
    assert torch.equal(targets[:, :-1][where[:, :-1]], ids[:, 1:][where[:, :-1]])
    assert not where[:, -1].any() and not where[batch["attention_mask"] == 0].any()


def test_image_tokens_and_images_follow_reading_order(collator, shapes_tokenizer):
    counts = [2, 0, 1, 3]
    records = records_with_images(counts)
    batch = collator(records)
    image_id = token_id(shapes_tokenizer, IMAGE_TOKEN)
    assert (batch["input_ids"] == image_id).sum(1).tolist() == [TOKENS_PER_IMAGE * c for c in counts]
    assert batch["images"].shape == (6, 3, 16, 16) and batch["images"].dtype == torch.float32
    expected = torch.stack([ImageProcessor(16)(solid(v)) for v in range(6)])
    torch.testing.assert_close(batch["images"], expected)


@pytest.mark.parametrize("side, image_position",
                         [("left", "before_text"), ("right", "before_text"), ("right", "after_text")])
def test_padding_keeps_each_row_intact(shapes_tokenizer, side, image_position):
    records = records_with_images([1, 0, 2])
    collator = VQACollator(shapes_tokenizer, ImageProcessor(16), TOKENS_PER_IMAGE, 512, padding_side=side,
                           image_position=image_position)
    batch = collator(records)
    pad_id, length = shapes_tokenizer.pad_token_id, batch["input_ids"].shape[1]
    for row, record in enumerate(records):
        ids, targets = encode_conversation(
            shapes_tokenizer, record["texts"], len(record["images"]), TOKENS_PER_IMAGE, image_position
        )
        real = slice(0, len(ids)) if side == "right" else slice(length - len(ids), length)
        padding = torch.ones(length, dtype=torch.bool)
        padding[real] = False
        assert (
            batch["input_ids"][row, real].tolist() == ids and batch["targets"][row, real].tolist() == targets
        )
        assert (batch["input_ids"][row, padding] == pad_id).all()
        assert (batch["targets"][row, padding] == IGNORE_INDEX).all()
        assert batch["attention_mask"][row].tolist() == (~padding).long().tolist()
    assert batch["attention_mask"].dtype == torch.long and batch["input_ids"].dtype == torch.long
    assert (batch["attention_mask"].sum(1) == length).any()  # the longest row is not padded


def test_too_long_records_are_dropped_and_counted(shapes_tokenizer):
    short, long = records_with_images([1, 0])[0], records_with_images([0, 3])[1]
    limit = len(encode_conversation(shapes_tokenizer, short["texts"], 1, TOKENS_PER_IMAGE)[0])
    collator = VQACollator(shapes_tokenizer, ImageProcessor(16), TOKENS_PER_IMAGE, max_length=limit)
    batch, too_long = collator.collate([short, long, short])
    assert batch["input_ids"].shape == (2, limit) and batch["images"].shape[0] == 2 and too_long == [1]
    empty, too_long = collator.collate([None, long])  # None: a bad record, skipped upstream
    assert empty["input_ids"].tolist() == [[shapes_tokenizer.pad_token_id]]
    assert empty["targets"].tolist() == [[IGNORE_INDEX]]
    assert empty["images"].shape == (0, 3, 16, 16) and too_long == [1]


def test_left_pad_for_generation():
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_collator_rejects_bad_settings(shapes_tokenizer, plain_tokenizer):
    with pytest.raises(ValueError, match="padding_side"):
        VQACollator(shapes_tokenizer, ImageProcessor(16), 4, 64, padding_side="middle")
    with pytest.raises(ValueError, match="prepare_tokenizer"):
        VQACollator(plain_tokenizer, ImageProcessor(16), 4, 64)


pieces = [*"ab <|>\n_é", "<|image|>", "<|im_end|>", "<|im_start|>", " circle"]
texts = st.lists(st.sampled_from(pieces), max_size=12).map("".join)


@settings(max_examples=60, deadline=None)
@given(turns=st.lists(st.tuples(texts, texts), min_size=1, max_size=3), num_images=st.integers(0, 3))
def test_conversation_invariants(shapes_tokenizer, turns, num_images):
    turns = [{"user": user, "assistant": assistant} for user, assistant in turns]
    ids, targets = encode_conversation(shapes_tokenizer, turns, num_images, TOKENS_PER_IMAGE)
    assert len(ids) == len(targets) and targets[-1] == IGNORE_INDEX
    assert ids.count(token_id(shapes_tokenizer, IMAGE_TOKEN)) == num_images * TOKENS_PER_IMAGE
    assert all(t == IGNORE_INDEX or t == ids[i + 1] for i, t in enumerate(targets))
    runs = answer_runs(torch.tensor(targets))
    assert [shapes_tokenizer.decode(run) for run in runs] == [t["assistant"] + "<|im_end|>" for t in turns]


def test_ensure_image_adds_a_placeholder_row_only_to_batches_without_images(shapes_tokenizer):
    collator = VQACollator(shapes_tokenizer, ImageProcessor(16), TOKENS_PER_IMAGE, max_length=512,
                           ensure_image=True)
    text_only = records_with_images([0, 0])
    batch = collator(text_only)
    image_id = token_id(shapes_tokenizer, IMAGE_TOKEN)
    assert batch["input_ids"].shape[0] == 3 and batch["images"].shape == (1, 3, 16, 16)
    assert batch["input_ids"][2, :TOKENS_PER_IMAGE].tolist() == [image_id] * TOKENS_PER_IMAGE
    assert (batch["targets"][2] == IGNORE_INDEX).all() and not batch["images"].any()
    assert collator(records_with_images([1, 0]))["input_ids"].shape[0] == 2  # has an image: unchanged


def test_packing_keeps_every_record_whole_with_its_images(shapes_tokenizer):
    """Packed rows hold the records' exact ids and targets, numbered 1, 2, ... in the mask, and the images
    follow their placeholders in reading order."""
    records = records_with_images([1, 0, 2, 0, 8, 0, 1, 0])  # the 8-image record is twice as long as most
    processor = ImageProcessor(16)
    plain = VQACollator(shapes_tokenizer, processor, TOKENS_PER_IMAGE, 512)(records)
    packed = VQACollator(shapes_tokenizer, processor, TOKENS_PER_IMAGE, 512, pack=True)(records)
    assert (
        packed["input_ids"].shape[0] < len(records)
        and packed["input_ids"].shape[1] == plain["input_ids"].shape[1]
    )
    encoded = [encode_conversation(shapes_tokenizer, r["texts"], len(r["images"]),
                                   TOKENS_PER_IMAGE) for r in records]
    found, images = [], []
    rows = zip(packed["input_ids"].tolist(), packed["targets"].tolist(), packed["attention_mask"].tolist())
    for ids, targets, sequences in rows:
        count = max(sequences)
        # 1, 1, ..., 2, ..., then padding (0)
        assert sequences == sorted(sequences, key=lambda n: n or count + 1)
        for n in range(1, count + 1):
            piece = ([i for i, s in zip(ids, sequences) if s == n],
                     [t for t, s in zip(targets, sequences) if s == n])
            record = encoded.index(piece)
            found.append(record)
            images += records[record]["images"]
    assert sorted(found) == list(range(len(records)))
    torch.testing.assert_close(packed["images"], torch.stack([processor(image) for image in images]))
    assert int((packed["attention_mask"] > 0).sum()) == int(plain["attention_mask"].sum())


def test_null_images_collate_like_no_images(collator):
    """A record with "images": None is batched exactly like the same record with an empty list."""
    texts = [{"user": "question?", "assistant": "answer"}]
    batch, expected = collator([{"images": None, "texts": texts}]), collator([{"images": [], "texts": texts}])
    assert batch.keys() == expected.keys() and all(torch.equal(batch[k], expected[k]) for k in expected)
