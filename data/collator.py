"""Batching: cauldron records → padded (optionally packed) token ids, attention mask, answer-only targets and
stacked image tensors."""

from __future__ import annotations

from typing import Literal

import torch
from transformers import PreTrainedTokenizerBase

from data.bad_records import record_images
from data.chat_processors import ChatProcessor, ConversationEncoder
from data.image_splitting import ImageInputs, as_image_inputs
from data.images import ImageProcessor
from data.packing import pack_rows
from data.prompts import IGNORE_INDEX
from models.config import ImagePosition

Side = Literal["left", "right"]
# A record encoded: its ids, answer-only targets and image tensors ([tiles, 3, S, S] each)
Sample = tuple[list[int], list[int], list[torch.Tensor]]


def pad(sequences: list[list[int]], value: int, side: Side = "right") -> tuple[torch.Tensor, torch.Tensor]:
    """Stack ragged sequences into a LongTensor [B, T] padded with `value`, and the mask (1 real, 0 pad)."""
    length = max(map(len, sequences), default=0)
    ids = torch.full((len(sequences), length), value, dtype=torch.long)
    mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        cols = slice(0, len(sequence)) if side == "right" else slice(length - len(sequence), length)
        ids[row, cols] = torch.tensor(sequence, dtype=torch.long)
        mask[row, cols] = 1
    return ids, mask


def left_pad(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched generation prompts: left padding, so every row's next token goes at the same position."""
    return pad(sequences, pad_id, "left")


class VQACollator:
    """Records {"images": [PIL], "texts": [{"user", "assistant"}]} (or a "video" Clip in place of the images,
    prompted as inference prompts it) → a batch dict of tensors.

    input_ids, attention_mask, targets: LongTensor [B, T]; images: FloatTensor [N, 3, H, W], in the order
    their placeholders appear (row by row). Each record is encoded by a conversation encoder
    (`data.chat_processors`: `encode_conversation(turns, images)` -> ids, answer-only targets, pixels): built
    here, tinyvlm's ChatML (`ChatProcessor`) with `processor`, an `ImageProcessor` (one square of
    `tokens_per_image` tokens per image) or `ImageInputs` (`ImageInputs.from_config(model_config, tokenizer)`:
    split images when the config says so, each tile one of the N images); or any encoder given to
    `VQACollator.for_encoder` (a checkpoint's own chat template and image processor: `CheckpointProcessor`).
    With `pack`, a row holds several records (see `data.packing`) and the attention mask numbers them 1, 2,
    ... (0 for padding); otherwise a row is one record and the mask is 1 or 0.

    A record whose ids exceed `max_length` is dropped, never truncated (`collate` also says which); None
    records (bad ones that `CheckedRecords` skipped) are left out. A batch that loses every record holds one
    padding row with no targets, so that training still runs its forward and backward. With `ensure_image`, a
    batch without any image gets a placeholder row (one black image, no targets), so the vision tower runs
    too: every rank of a DDP / FSDP2 job must use the same parameters at every step.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, processor: ImageProcessor | ImageInputs,
                 tokens_per_image: int, max_length: int, padding_side: Side = "right",
                 ensure_image: bool = False, image_position: ImagePosition = "before_text",
                 pack: bool = False):
        encoder = ChatProcessor(tokenizer, as_image_inputs(processor, tokens_per_image, tokenizer),
                                image_position)
        self._setup(encoder, max_length, padding_side, ensure_image, pack)

    @classmethod
    def for_encoder(cls, encoder: ConversationEncoder, max_length: int, padding_side: Side = "right",
                    ensure_image: bool = False, pack: bool = False) -> VQACollator:
        """A collator whose records `encoder` encodes (e.g. `ChatProcessor.from_config(config, tokenizer)`, or
        a checkpoint's `CheckpointProcessor`)."""
        collator = cls.__new__(cls)
        collator._setup(encoder, max_length, padding_side, ensure_image, pack)
        return collator

    def _setup(self, encoder: ConversationEncoder, max_length: int, padding_side: Side, ensure_image: bool,
               pack: bool) -> None:
        if padding_side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
        if encoder.tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer has no pad token; call data.prepare_tokenizer(tokenizer) first")
        self.encoder, self.tokenizer = encoder, encoder.tokenizer
        self.encoder.check()  # fail now, not at the first batch
        self.max_length = max_length
        self.padding_side = padding_side
        self.ensure_image = ensure_image
        self.pack = pack

    def __call__(self, records: list[dict | None]) -> dict[str, torch.Tensor]:
        return self.collate(records)[0]

    def collate(self, records: list[dict | None]) -> tuple[dict[str, torch.Tensor], list[int]]:
        """The batch, and the positions in `records` of the records dropped for exceeding `max_length`."""
        samples, too_long = [], []
        for position, record in enumerate(records):
            if record is None:
                continue
            sample = self.encode(record)
            if len(sample[0]) > self.max_length:
                too_long.append(position)
                continue
            samples.append(sample)
        return self.assemble(samples), too_long

    def encode(self, record: dict) -> Sample:
        """A record's ids, answer-only targets and image tensors ([tiles, 3, S, S] each; none without an
        image), whatever its length."""
        ids, targets, pixels = self.encoder.encode_conversation(record["texts"], record_images(record),
                                                                record.get("video"))
        return ids, targets, [] if pixels is None else [pixels]

    def assemble(self, samples: list[Sample], rows: list[list[int]] | None = None) -> dict[str, torch.Tensor]:
        """The batch of `rows` (lists of positions in `samples`; by default every sample, packed into rows as
        long as the longest with `pack`, else a row each)."""
        samples = list(samples)
        chosen = range(len(samples)) if rows is None else [i for row in rows for i in row]
        size, per_image = self.encoder.image_size, self.encoder.tokens_per_image
        if self.ensure_image and not any(samples[i][2] for i in chosen):
            image_ids = [self.encoder.image_token_id] * per_image
            samples.append((image_ids, [IGNORE_INDEX] * per_image, [torch.zeros(1, 3, size, size)]))
            rows = None if rows is None else [*rows, [len(samples) - 1]]
        if not samples or rows == []:
            samples, rows = [([self.tokenizer.pad_token_id], [IGNORE_INDEX], [])], [[0]]
        if rows is None:
            lengths = [len(ids) for ids, _, _ in samples]
            rows = pack_rows(lengths) if self.pack else [[i] for i in range(len(samples))]
        id_rows = []
        target_rows = []
        sequence_rows = []
        images = []
        for row in rows:
            id_rows.append([token for i in row for token in samples[i][0]])
            target_rows.append([target for i in row for target in samples[i][1]])
            sequence_rows.append([n for n, i in enumerate(row, 1) for _ in samples[i][0]])
            images += [image for i in row for image in samples[i][2]]
        input_ids, _ = pad(id_rows, self.tokenizer.pad_token_id, self.padding_side)
        attention_mask, _ = pad(sequence_rows, 0, self.padding_side)
        targets, _ = pad(target_rows, IGNORE_INDEX, self.padding_side)
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "targets": targets,
            "images": torch.cat(images) if images else torch.empty(0, 3, size, size),
        }
