"""Label-free vision pre-training: the answer loss against a float64 reference, and a ViT that learns from records'
own questions and answers what their images show (colour and place), for data with no scene labels."""

import random

import pytest
import torch
from PIL import Image, ImageDraw

from data.processors import ImageProcessor
from models.config import ConfigError, VisionConfig
from models.vision_transformer import VisionTransformer
from training.answer_pretraining import answer_loss, bag, pretrain_vision_on_answers

COLOURS = {"red": (220, 30, 30), "green": (30, 160, 50), "blue": (40, 80, 230), "black": (20, 20, 20)}
SIDES = ("left", "right")
QUESTIONS = {"colour": "what colour is the disc ?", "side": "on which side is the disc ?"}
WORDS = sorted({*COLOURS, *SIDES, *" ".join(QUESTIONS.values()).split()})


def _encode(text: str) -> list[int]:
    return [WORDS.index(word) for word in text.split()]


def test_answer_loss_equals_a_float64_reference():
    """Each row: the cross-entropy against its answer's words, equally weighted (a repeated word counts twice)."""
    torch.manual_seed(0)
    logits, answers = torch.randn(3, 10), [[4], [1, 2, 3], [7, 7, 2]]
    log_probs = logits.double().log_softmax(-1)
    expected = sum(-sum(log_probs[row, i].item() for i in ids) / len(ids) for row, ids in enumerate(answers)) / 3
    assert answer_loss(logits, answers).item() == pytest.approx(expected, rel=1e-6)


def test_bag_gives_embedding_bag_offsets():
    ids, offsets = bag([[3, 4], [5], [6, 7, 8]], torch.device("cpu"))
    assert ids.tolist() == [3, 4, 5, 6, 7, 8] and offsets.tolist() == [0, 2, 3]


def _record(colour: str, side: str, rng: random.Random) -> dict:
    image = Image.new("RGB", (48, 48), (235, 235, 235))
    x, y = (12 if side == "left" else 36) + rng.randint(-3, 3), 24 + rng.randint(-8, 8)
    ImageDraw.Draw(image).ellipse((x - 8, y - 8, x + 8, y + 8), fill=COLOURS[colour])
    kind = rng.choice(list(QUESTIONS))
    return {"images": [image], "texts": [{"user": QUESTIONS[kind], "assistant": colour if kind == "colour" else side}]}


def _vision(layers: int = 2) -> VisionTransformer:
    return VisionTransformer(VisionConfig(image_size=48, patch_size=16, hidden_size=32, intermediate_size=64,
                                          num_layers=layers, num_heads=2))


def test_the_vit_learns_what_the_answers_say_about_its_images():
    """After pre-training on records alone, the reader answers held-out images' colour and side questions (chance: 1
    in 4 and 1 in 2); it reads only the ViT's tokens, so they carry both."""
    torch.manual_seed(0)
    rng = random.Random(0)
    records = [_record(rng.choice(list(COLOURS)), rng.choice(SIDES), rng) for _ in range(400)]
    records[5] = None  # a bad record, passed over
    records[6] = {**records[7], "images": []}  # a text-only record, passed over
    vision, processor = _vision(), ImageProcessor(48)
    reader, losses = pretrain_vision_on_answers(vision, processor, records, _encode, len(WORDS), steps=150,
                                                batch_size=32, lr=3e-3, seed=0, device=torch.device("cpu"),
                                                report=lambda _: None)
    assert len(losses) == 150 and sum(losses[-10:]) < 0.2 * sum(losses[:10])

    scenes = [(colour, side) for colour in COLOURS for side in SIDES for _ in range(8)]
    held_out = [_record(colour, side, random.Random(100 + k)) for k, (colour, side) in enumerate(scenes)]
    for kind, question in QUESTIONS.items():
        truth = [colour if kind == "colour" else side for colour, side in scenes]
        with torch.no_grad():
            tokens = vision.eval()(torch.stack([processor(r["images"][0]) for r in held_out]))
            logits = reader(tokens, *bag([_encode(question)] * len(held_out), torch.device("cpu")))
        choices = list(COLOURS) if kind == "colour" else list(SIDES)
        predicted = [choices[i] for i in logits[:, [WORDS.index(c) for c in choices]].argmax(-1)]
        accuracy = sum(p == t for p, t in zip(predicted, truth)) / len(truth)
        assert accuracy >= 0.9, (kind, accuracy)


def test_data_without_images_is_a_one_line_error():
    records = [{"images": [], "texts": [{"user": "hi", "assistant": "hello"}]}] * 4
    with pytest.raises(ConfigError, match="set train.vision_pretrain_steps to 0"):
        pretrain_vision_on_answers(_vision(1), ImageProcessor(48), records, lambda t: [0], 4, steps=1, batch_size=2,
                                   lr=1e-3, seed=0, device=torch.device("cpu"), report=lambda _: None)
