"""Label-free pre-training of a from-scratch ViT on the training records' own questions and answers, for any source.

A throwaway one-layer reader stands in for the language model: the question, as a bag of words, queries the ViT's
tokens with multi-head attention (so each token must hold what its place shows, and in a form a question can find),
and the pooled reading plus the question predict the answer's words (a bag of words: the softmax cross-entropy
against the answer's token distribution). It is the caption objective of CapPa / LocCa (Tschannen et al. 2023,
"Image Captioners Are Scalable Vision Learners Too") cut down to one decoder layer and a bag of words, and needs no
labels beyond the records' own texts. Contrasting images with their texts (SigLIP's sigmoid loss) was tried first:
with one-attribute texts ("What colour is it? pink"), most in-batch negatives are true of the image too, and a
zero-shot reading of the learned features was near chance for shape. Only the ViT is kept: with `train.lr_vision: 0`
it is then frozen while the projector and the LM learn to read it, as with the synthetic data's supervised objective
(training/vision_pretraining.py).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import torch
from torch import nn

from data.processors import ImageProcessor
from models.config import ConfigError
from models.vision_transformer import VisionTransformer
from training.vision_pretraining import optimize

READER_HEADS = 4


class AnswerReader(nn.Module):
    """(ViT tokens, question token ids) -> logits over the vocabulary for the answer's words."""

    def __init__(self, hidden_size: int, vocab_size: int, heads: int = READER_HEADS):
        super().__init__()
        self.question = nn.EmbeddingBag(vocab_size, hidden_size, mode="mean")
        self.attend = nn.MultiheadAttention(hidden_size, heads, batch_first=True)
        self.norm = nn.LayerNorm(hidden_size)
        self.out = nn.Sequential(nn.Linear(2 * hidden_size, 2 * hidden_size), nn.GELU(),
                                 nn.Linear(2 * hidden_size, vocab_size))

    def forward(self, tokens: torch.Tensor, question_ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        query = self.question(question_ids, offsets)  # [B, D]
        tokens = self.norm(tokens)
        read = self.attend(query[:, None], tokens, tokens, need_weights=False)[0][:, 0]
        return self.out(torch.cat([read, query], dim=-1))


def bag(token_lists: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists as EmbeddingBag input: the ids concatenated and each list's offset."""
    lengths = torch.tensor([len(ids) for ids in token_lists])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
    return torch.tensor([i for ids in token_lists for i in ids]).to(device), offsets.to(device)


def answer_loss(logits: torch.Tensor, answers: Sequence[Sequence[int]]) -> torch.Tensor:
    """Mean over the batch of the cross-entropy against each answer's token distribution (its words, equally)."""
    rows = torch.tensor([row for row, ids in enumerate(answers) for _ in ids], device=logits.device)
    words = torch.tensor([i for ids in answers for i in ids], device=logits.device)
    shares = torch.tensor([1 / len(ids) for ids in answers for _ in ids], device=logits.device, dtype=logits.dtype)
    # accumulate: a word the answer repeats counts twice
    targets = torch.zeros_like(logits).index_put_((rows, words), shares, accumulate=True)
    return -(targets * logits.log_softmax(-1)).sum(-1).mean()


def pretrain_vision_on_answers(vision: VisionTransformer, processor: ImageProcessor, records: Sequence[dict | None],
                               encode: Callable[[str], Sequence[int]], vocab_size: int, steps: int, batch_size: int,
                               lr: float, seed: int, device: torch.device,
                               report: Callable[[str], None] = print) -> tuple[AnswerReader, list[float]]:
    """Train `vision` in place for `steps` AdamW steps (constant `lr`) to answer the records' questions through an
    `AnswerReader`; `encode` turns a text into token ids. Records are drawn at random (seeded) from `records` (the
    training split: a CheckedRecords, where a bad record reads as None), one turn each; records without an image, and
    bad ones, are passed over. Returns the reader and the losses; training needs only the ViT afterwards."""
    reader = AnswerReader(vision.config.hidden_size, vocab_size).to(device)
    rng = random.Random(f"answer-pretraining:{seed}")

    def batch_loss() -> torch.Tensor:
        pixels, questions, answers = _batch(records, processor, encode, batch_size, rng)
        return answer_loss(reader(vision(pixels.to(device)), *bag(questions, device)), answers)

    vision.train()
    return reader, optimize(batch_loss, [*vision.parameters(), *reader.parameters()], steps, lr, report)


def _batch(records: Sequence[dict | None], processor: ImageProcessor, encode: Callable[[str], Sequence[int]],
           batch_size: int, rng: random.Random) -> tuple[torch.Tensor, list[list[int]], list[list[int]]]:
    """`batch_size` records with an image, drawn at random, one turn of each: first images [B, 3, H, W], questions'
    and answers' token ids (a turn whose question or answer encodes to nothing is passed over)."""
    pixels, questions, answers = [], [], []
    for _ in range(100 * batch_size):
        record = records[rng.randrange(len(records))]
        if record is None or not record["images"]:
            continue
        turn = rng.choice(record["texts"])
        question, answer = list(encode(turn["user"])), list(encode(turn["assistant"]))
        if question and answer:
            pixels.append(processor(record["images"][0]))
            questions.append(question)
            answers.append(answer)
            if len(answers) == batch_size:
                return torch.stack(pixels), questions, answers
    raise ConfigError(f"vision pre-training found {len(answers)} records with an image and a question in "
                      f"{100 * batch_size} draws; set train.vision_pretrain_steps to 0 for data without images")
