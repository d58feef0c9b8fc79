"""Label-free vision pre-training: the answer loss against a float64 reference, a ViT that learns from
records' own questions and answers what their images show (colour and place), for data with no scene labels,
also when read through the VLM's fixed projector, and the drawing of question types by their running loss."""

import json
import random

import pytest
import torch
from PIL import Image, ImageDraw

from data.images import ImageProcessor
from data.sources import load_jsonl
from models.config import LanguageConfig, ProjectorConfig, VisionConfig, VLMConfig
from models.modality_projector import ModalityProjector
from models.vision_transformer import VisionTransformer
from training.answer_pretraining import (
    MAX_FAILED_DRAWS,
    LossProportionalTypes,
    _batch,
    answer_losses,
    bag,
    pretraining_on_answers,
    read_question_types,
)
from typed_config import ConfigError

COLOURS = {"red": (220, 30, 30), "green": (30, 160, 50), "blue": (40, 80, 230), "black": (20, 20, 20)}
SIDES = ("left", "right")
QUESTIONS = {"colour": "what colour is the disc ?", "side": "on which side is the disc ?"}
WORDS = sorted({*COLOURS, *SIDES, *" ".join(QUESTIONS.values()).split()})


def _encode(text: str) -> list[int]:
    return [WORDS.index(word) for word in text.split()]


def test_answer_loss_equals_a_float64_reference():
    """Each row: the cross-entropy against its answer's words, equally weighted (a repeated word counts
    twice)."""
    torch.manual_seed(0)
    logits, answers = torch.randn(3, 10), [[4], [1, 2, 3], [7, 7, 2]]
    log_probs = logits.double().log_softmax(-1)
    expected = [-sum(log_probs[row, i].item() for i in ids) / len(ids) for row, ids in enumerate(answers)]
    assert answer_losses(logits, answers).tolist() == pytest.approx(expected, rel=1e-6)


def test_bag_gives_embedding_bag_offsets():
    ids, offsets = bag([[3, 4], [5], [6, 7, 8]], torch.device("cpu"))
    assert ids.tolist() == [3, 4, 5, 6, 7, 8] and offsets.tolist() == [0, 2, 3]


def _record(colour: str, side: str, rng: random.Random) -> dict:
    image = Image.new("RGB", (48, 48), (235, 235, 235))
    x, y = (12 if side == "left" else 36) + rng.randint(-3, 3), 24 + rng.randint(-8, 8)
    ImageDraw.Draw(image).ellipse((x - 8, y - 8, x + 8, y + 8), fill=COLOURS[colour])
    kind = rng.choice(list(QUESTIONS))
    return {"images": [image],
            "texts": [{"user": QUESTIONS[kind], "assistant": colour if kind == "colour" else side}]}


def _kind(record: dict | None) -> str | None:
    """A record's question type, as a JSONL line would carry it (a bad record still has its line's type)."""
    question = (record or {"texts": [{"user": QUESTIONS["side"]}]})["texts"][0]["user"]
    return next(kind for kind, text in QUESTIONS.items() if text == question)


def _vision(layers: int = 2, patch_size: int = 16) -> VisionTransformer:
    return VisionTransformer(VisionConfig(image_size=48, patch_size=patch_size, hidden_size=32,
                                          intermediate_size=64, num_layers=layers, num_heads=2))


def _projector(vision: VisionTransformer) -> ModalityProjector:
    """The VLM's projector for this ViT: a 2x2 pixel shuffle of its 6x6 patches into 9 tokens, 48 wide."""
    config = VLMConfig(vision=vision.config, projector=ProjectorConfig(pixel_shuffle_factor=2),
                       language=LanguageConfig(vocab_size=len(WORDS), hidden_size=48, intermediate_size=96,
                                               num_layers=1, num_heads=2, num_kv_heads=1))
    return ModalityProjector(config)


@pytest.mark.parametrize(("through_projector", "typed"), [(False, False), (True, True)])
def test_the_vit_learns_what_the_answers_say_about_its_images(through_projector, typed):
    """After pre-training on records alone, the reader answers held-out images' colour and side questions
    (chance: 1 in 4 and 1 in 2); it reads only the ViT's tokens (or the fixed projector's, which stays as it
    was and trainable for the VLM), so they carry both; also with the records drawn by their question type's
    loss."""
    torch.manual_seed(0)
    rng = random.Random(0)
    records = [_record(rng.choice(list(COLOURS)), rng.choice(SIDES), rng) for _ in range(400)]
    records[5] = None  # a bad record, passed over
    records[6] = {**records[7], "images": []}  # a text-only record, passed over
    vision, processor = _vision(patch_size=8 if through_projector else 16), ImageProcessor(48)
    projector = _projector(vision) if through_projector else None
    before = {k: v.clone() for k, v in projector.state_dict().items()} if projector else {}
    kinds = [_kind(record) for record in records] if typed else None
    pretraining = pretraining_on_answers(vision, processor, records, _encode, len(WORDS), steps=150,
                                         batch_size=32, lr=3e-3, seed=0, device=torch.device("cpu"),
                                         question_types=kinds, projector=projector)
    assert pretraining.run(report=lambda _: None)
    reader, losses = pretraining.head, pretraining.loss_history()
    assert len(losses) == 150 and sum(losses[-10:]) < 0.2 * sum(losses[:10])
    if projector is not None:
        assert all(torch.equal(before[k], v) for k, v in projector.state_dict().items())
        assert all(p.grad is None and p.requires_grad for p in projector.parameters())
        vision = torch.nn.Sequential(vision, projector)

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
        pretraining_on_answers(_vision(1), ImageProcessor(48), records, lambda t: [0], 4, steps=1,
                               batch_size=2, lr=1e-3, seed=0, device=torch.device("cpu")).run()


def test_types_are_drawn_in_proportion_to_their_running_loss_squared():
    drawing = LossProportionalTypes(6, ["a", "b", "a", "c", "b", "a"], random.Random(0))
    drawing.running_loss = {"a": 2.0, "b": 1.0, "c": 1.0}  # shares 4 : 1 : 1
    draws = [drawing.draw() for _ in range(12000)]
    shares = {kind: sum(k == kind for _, k in draws) / len(draws) for kind in "abc"}
    assert shares == pytest.approx({"a": 4 / 6, "b": 1 / 6, "c": 1 / 6}, abs=0.02)
    # then a record of the type, uniformly
    for kind, indices in {"a": [0, 2, 5], "b": [1, 4], "c": [3]}.items():
        drawn = [index for index, k in draws if k == kind]
        assert [drawn.count(i) / len(drawn) for i in indices] == pytest.approx(
            [1 / len(indices)] * len(indices), abs=0.03
        )


def test_running_losses_fold_in_each_types_batch_mean():
    drawing = LossProportionalTypes(3, ["a", "b", "c"], random.Random(0))
    drawing.update(["a", "a", "b"], [3.0, 1.0, 0.5])
    assert drawing.running_loss == pytest.approx({"a": 0.9 + 0.1 * 2.0, "b": 0.9 + 0.1 * 0.5, "c": 1.0})


def test_question_types_are_read_from_the_jsonl_column_without_opening_images(tmp_path):
    (tmp_path / "broken.png").write_bytes(b"not an image")  # reading a record would fail on it
    lines = [{"images": ["broken.png"], "texts": [{"user": "q", "assistant": "a"}], "question_type": kind}
             for kind in ("colour", "shape")]
    (tmp_path / "typed.jsonl").write_text("\n".join(json.dumps(line) for line in lines))
    # no image is opened
    assert read_question_types(load_jsonl(tmp_path / "typed.jsonl")) == ["colour", "shape"]
    (tmp_path / "plain.jsonl").write_text(
        json.dumps({k: v for k, v in lines[0].items() if k != "question_type"})
    )
    assert read_question_types(load_jsonl(tmp_path / "plain.jsonl")) is None
    assert read_question_types([{"images": [], "texts": []}]) is None


def test_without_types_records_are_drawn_as_before():
    """Untyped data keeps the drawing of the first version: a record uniformly, then one of its turns, on one
    seeded generator (so runs measured before the drawing by type are reproduced)."""
    rng = random.Random(3)
    records = [_record(rng.choice(list(COLOURS)), rng.choice(SIDES), rng) for _ in range(50)]
    drawing = LossProportionalTypes(len(records), None, random.Random("answer-pretraining:7"))
    _, questions, answers, kinds = _batch(records, ImageProcessor(48), _encode, 16, drawing)
    reference = random.Random("answer-pretraining:7")
    expected = []
    for _ in range(16):
        turn = reference.choice(records[reference.randrange(len(records))]["texts"])
        expected.append((_encode(turn["user"]), _encode(turn["assistant"])))
    assert list(zip(questions, answers)) == expected and kinds == [None] * 16


def test_a_type_without_a_usable_record_is_dropped():
    """Its loss would stay at its start while the others fall, and it would take nearly every draw."""
    rng = random.Random(0)
    # the "broken" type: all bad records
    records = [_record("red", "left", rng) for _ in range(20)] + [None] * 20
    drawing = LossProportionalTypes(40, ["fine"] * 20 + ["broken"] * 20, random.Random(0))
    drawing.running_loss = {"fine": 0.01, "broken": 1.0}
    for _ in range(3):
        _, _, _, kinds = _batch(records, ImageProcessor(48), _encode, 32, drawing)
        assert kinds == ["fine"] * 32
    assert list(drawing.groups) == ["fine"]


def test_a_type_that_once_worked_is_kept_and_the_last_type_is_never_dropped():
    drawing = LossProportionalTypes(2, ["a", "b"], random.Random(0))
    drawing.drew("a", usable=True)
    for _ in range(MAX_FAILED_DRAWS):
        drawing.drew("a", usable=False)
        drawing.drew("b", usable=False)
    assert list(drawing.groups) == ["a"]
    lone = LossProportionalTypes(1, ["a"], random.Random(0))
    for _ in range(MAX_FAILED_DRAWS):
        lone.drew("a", usable=False)
    assert list(lone.groups) == ["a"]  # the batch's own check then reports data without usable records


def test_one_question_type_per_record():
    with pytest.raises(ValueError, match="3 question types for 2 records"):
        LossProportionalTypes(2, ["a", "b", "c"], random.Random(0))
