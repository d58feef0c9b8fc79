"""Label-free pre-training of a from-scratch ViT on the training records' own questions and answers, for any
source.

A throwaway one-layer reader stands in for the language model: the question, as a bag of words, queries the
ViT's tokens with multi-head attention (so each token must hold what its place shows, and in a form a question
can find), and the pooled reading plus the question predict the answer's words (a bag of words: the softmax
cross-entropy against the answer's token distribution). It is the caption objective of CapPa / LocCa
(Tschannen et al. 2023, "Image Captioners Are Scalable Vision Learners Too") cut down to one decoder layer and
a bag of words, and needs no labels beyond the records' own texts. Contrasting images with their texts
(SigLIP's sigmoid loss) was tried first: with one-attribute texts ("What colour is it? pink"), most in-batch
negatives are true of the image too, and a zero-shot reading of the learned features was near chance for
shape. Only the ViT is kept: with `train.lr_vision: 0` it is then frozen while the projector and the LM learn
to read it, as with the synthetic data's supervised objective (training/vision_pretraining.py). Given the
VLM's projector, the reader reads the image tokens the LM will see (the projector held fixed), so what the ViT
learns survives the projector's map: with the tiny default's frozen random projector (9 tokens from 36
patches, 512 -> 128 wide), a ViT trained for its own tokens lost most of the shape on the way (issue 19).

Where the records carry a `question_type`, the types are drawn in proportion to their running loss squared
(`LossProportionalTypes`), so a type the ViT cannot read yet (shape, a fifth of the records) gets most of the
steps until it catches up; without the field, records are drawn uniformly.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from data.images import ImageProcessor
from models.modality_projector import ModalityProjector
from models.vision_transformer import VisionTransformer
from training.vision_pretraining import Pretraining, random_state, set_random_state
from typed_config import ConfigError

READER_HEADS = 4
LOSS_DECAY = 0.9  # a type's running loss averages the last ~10 batches that drew it
MAX_FAILED_DRAWS = 100  # a type none of whose first this many draws gave a usable turn is drawn no more


class AnswerReader(nn.Module):
    """(ViT tokens, question token ids) -> logits over the vocabulary for the answer's words."""

    def __init__(self, hidden_size: int, vocab_size: int, heads: int = READER_HEADS):
        super().__init__()
        self.question = nn.EmbeddingBag(vocab_size, hidden_size, mode="mean")
        self.attend = nn.MultiheadAttention(hidden_size, heads, batch_first=True)
        self.norm = nn.LayerNorm(hidden_size)
        self.out = nn.Sequential(nn.Linear(2 * hidden_size, 2 * hidden_size), nn.GELU(),
                                 nn.Linear(2 * hidden_size, vocab_size))

    def forward(self, tokens: torch.Tensor, question_ids: torch.Tensor,
                offsets: torch.Tensor) -> torch.Tensor:
        query = self.question(question_ids, offsets)  # [B, D]
        tokens = self.norm(tokens)
        read = self.attend(query[:, None], tokens, tokens, need_weights=False)[0][:, 0]
        return self.out(torch.cat([read, query], dim=-1))


def bag(token_lists: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists as EmbeddingBag input: the ids concatenated and each list's offset."""
    lengths = torch.tensor([len(ids) for ids in token_lists])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
    return torch.tensor([i for ids in token_lists for i in ids]).to(device), offsets.to(device)


def answer_losses(logits: torch.Tensor, answers: Sequence[Sequence[int]]) -> torch.Tensor:
    """Each row's cross-entropy against its answer's token distribution (its words, equally), [B]."""
    rows = torch.tensor([row for row, ids in enumerate(answers) for _ in ids], device=logits.device)
    words = torch.tensor([i for ids in answers for i in ids], device=logits.device)
    shares = torch.tensor([1 / len(ids) for ids in answers for _ in ids], device=logits.device,
                          dtype=logits.dtype)
    # accumulate: a word the answer repeats counts twice
    targets = torch.zeros_like(logits).index_put_((rows, words), shares, accumulate=True)
    return -(targets * logits.log_softmax(-1)).sum(-1)


class LossProportionalTypes:
    """Draws records by question type, each type with probability proportional to its running loss squared (an
    exponential moving average of its rows' answer losses; every type starts equal), then a record of that
    type uniformly; with no types given, every record uniformly. The squared loss gives a type the ViT reads
    worst most of the draws while it lags (a fifth of the records asking about shape is otherwise too little
    signal in the time). The weighting is per type, whatever its number of records. A type that gives no
    usable turn in its first MAX_FAILED_DRAWS draws (its records all bad or without an image) is dropped: its
    loss would never fall."""

    def __init__(self, num_records: int, question_types: Sequence[str | None] | None, rng: random.Random):
        if question_types is not None and len(question_types) != num_records:
            raise ValueError(f"{len(question_types)} question types for {num_records} records")
        self.rng, self.num_records = rng, num_records
        self.groups: dict[str | None, list[int]] = {}
        for index, kind in enumerate(question_types or ()):
            self.groups.setdefault(kind, []).append(index)
        self.running_loss = dict.fromkeys(self.groups, 1.0)
        # draws without a usable turn, until the type's first success
        self._failed = dict.fromkeys(self.groups, 0)

    def draw(self) -> tuple[int, str | None]:
        """A record's index and its type (None without types)."""
        if not self.groups:
            return self.rng.randrange(self.num_records), None
        kinds = list(self.groups)
        kind = self.rng.choices(kinds, weights=[self.running_loss[k] ** 2 for k in kinds])[0]
        return self.rng.choice(self.groups[kind]), kind

    def drew(self, kind: str | None, usable: bool) -> None:
        """Whether the record drawn for `kind` gave a usable turn; a type that never does is dropped."""
        if kind not in self._failed:
            return
        if usable:
            del self._failed[kind]
        else:
            self._failed[kind] += 1
            if self._failed[kind] >= MAX_FAILED_DRAWS and len(self.groups) > 1:
                del self.groups[kind], self._failed[kind]

    def update(self, kinds: Sequence[str | None], losses: Sequence[float]) -> None:
        """Fold one batch's per-row losses into the running loss of each type it drew."""
        for kind in set(kinds):
            mean = sum(loss for k, loss in zip(kinds, losses) if k == kind) / kinds.count(kind)
            self.running_loss[kind] = LOSS_DECAY * self.running_loss[kind] + (1 - LOSS_DECAY) * mean

    def state_dict(self) -> dict[str, Any]:
        """What draws next, as JSON: the random state, the types still drawn, their running losses and failed
        draws."""
        return {"rng": random_state(self.rng), "kinds": list(self.groups),
                "running_loss": list(self.running_loss.items()), "failed": list(self._failed.items())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_random_state(self.rng, state["rng"])
        self.groups = {kind: self.groups[kind] for kind in state["kinds"]}
        self.running_loss = {kind: loss for kind, loss in state["running_loss"]}
        self._failed = {kind: count for kind, count in state["failed"]}


def read_question_types(dataset: Sequence[dict]) -> list[str] | None:
    """An Arrow dataset's `question_type` column, read without decoding its images; None when it has none."""
    if "question_type" not in (getattr(dataset, "column_names", None) or ()):
        return None
    return list(dataset.with_format(None)["question_type"])


def pretraining_on_answers(vision: VisionTransformer, processor: ImageProcessor,
                           records: Sequence[dict | None], encode: Callable[[str], Sequence[int]],
                           vocab_size: int, steps: int, batch_size: int, lr: float, seed: int,
                           device: torch.device, question_types: Sequence[str | None] | None = None,
                           projector: ModalityProjector | None = None) -> Pretraining:
    """A pre-training (`Pretraining.run` trains it) of `vision` in place to answer the records' questions
    through an `AnswerReader`; `encode` turns a text into token ids. Records are drawn at random (seeded) from
    `records` (the training split: a CheckedRecords, where a bad record reads as None), one turn each; records
    without an image, and bad ones, are passed over; `question_types` (one per record) draws them as
    `LossProportionalTypes` does. Training needs only the ViT afterwards. With a `projector` (ViT tokens ->
    image tokens of `projector.proj.out_features`), the reader reads its tokens; a copy of it, never trained
    here."""
    width = vision.config.hidden_size if projector is None else projector.proj.out_features
    reader = AnswerReader(width, vocab_size).to(device)
    fixed = nn.Identity() if projector is None else copy.deepcopy(projector).requires_grad_(False)
    drawing = LossProportionalTypes(len(records), question_types, random.Random(f"answer-pretraining:{seed}"))

    def batch_loss() -> torch.Tensor:
        pixels, questions, answers, kinds = _batch(records, processor, encode, batch_size, drawing)
        losses = answer_losses(reader(fixed(vision(pixels.to(device))), *bag(questions, device)), answers)
        if drawing.groups:
            drawing.update(kinds, losses.tolist())  # a host sync per step: pre-training only
        return losses.mean()

    return Pretraining.start(batch_loss, vision, reader, drawing, steps, lr)


def _batch(records: Sequence[dict | None], processor: ImageProcessor, encode: Callable[[str], Sequence[int]],
           batch_size: int, drawing: LossProportionalTypes
           ) -> tuple[torch.Tensor, list[list[int]], list[list[int]], list[str | None]]:
    """`batch_size` records with an image, as `drawing` draws them, one turn of each: first images [B, 3, H,
    W], questions' and answers' token ids (a turn whose question or answer encodes to nothing is passed over),
    types."""
    pixels = []
    questions = []
    answers = []
    kinds = []
    for _ in range(100 * batch_size):
        index, kind = drawing.draw()
        record = records[index]
        if record is None or not record["images"]:
            drawing.drew(kind, usable=False)
            continue
        turn = drawing.rng.choice(record["texts"])
        question, answer = list(encode(turn["user"])), list(encode(turn["assistant"]))
        drawing.drew(kind, usable=bool(question and answer))
        if question and answer:
            pixels.append(processor(record["images"][0]))
            questions.append(question)
            answers.append(answer)
            kinds.append(kind)
            if len(answers) == batch_size:
                return torch.stack(pixels), questions, answers, kinds
    raise ConfigError(f"vision pre-training found {len(answers)} records with an image and a question in "
                      f"{100 * batch_size} draws; set train.vision_pretrain_steps to 0 for data without "
                      "images")
