"""Held-out answers are asked the way the model was trained: prompts with the image tokens where its config
puts them; the prediction grid keeps every title readable."""

import pytest
import torch
from PIL import Image

from data import (
    IMAGE_TOKEN,
    ImageProcessor,
    build_shapes_tokenizer,
    encode_prompt,
    make_shapes_dataset,
    token_id,
)
from models import VisionLanguageModel
from tests.models.helpers import tiny_vlm_config
from training.evaluate import answer, save_prediction_grid


@pytest.mark.parametrize("image_position", ["before_text", "after_text"])
def test_answer_prompts_with_the_models_image_position(image_position, monkeypatch):
    tokenizer = build_shapes_tokenizer(["What color is the circle?", "How many shapes are there?", "red",
                                        "2"])
    config = tiny_vlm_config(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    model = VisionLanguageModel(config.replace({"image_token_id": str(token_id(tokenizer, IMAGE_TOKEN)),
                                                "image_position": image_position}))
    records = [{"images": [Image.new("RGB", (32, 32), "red")],
                "texts": [{"user": question, "assistant": "?"}]}
               for question in ("What color is the circle?", "How many shapes are there?")]
    prompts = []

    def generate(input_ids, images, attention_mask, **settings):
        prompts.extend(row[mask.bool()].tolist() for row, mask in zip(input_ids, attention_mask))
        return torch.full((len(input_ids), 1), tokenizer.eos_token_id)

    monkeypatch.setattr(model, "generate", generate)
    answer(model, tokenizer, ImageProcessor(32), records, torch.device("cpu"))
    assert prompts == [encode_prompt(tokenizer, r["texts"][0]["user"], 1, config.tokens_per_image,
                                     image_position)
                       for r in records]
    assert prompts != [encode_prompt(tokenizer, r["texts"][0]["user"], 1, config.tokens_per_image,
                                     "after_text" if image_position == "before_text" else "before_text")
                       for r in records]


def apart(a, b) -> bool:
    """Two bounding boxes that do not overlap."""
    return a.x1 <= b.x0 or b.x1 <= a.x0 or a.y1 <= b.y0 or b.y1 <= a.y0


def test_prediction_grid_titles_never_overlap(tmp_path, monkeypatch):
    """Captions (~150 characters) and long wrong predictions: every title stays inside the figure and clear of
    the other cells' titles and images."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = list(make_shapes_dataset("validation", 12, seed=0, image_size=48,
                                       question_types=("caption", "color")))
    predictions = [r["texts"][0]["assistant"] if i % 3 else "a large purple diamond " * (1 + i % 4)
                   for i, r in enumerate(records)]
    figures, savefig = [], Figure.savefig
    monkeypatch.setattr(Figure, "savefig",
                        lambda self, *args, **kwargs: (figures.append(self), savefig(self, *args, **kwargs)))
    save_prediction_grid(records, predictions, tmp_path / "predictions.png")
    assert (tmp_path / "predictions.png").is_file() and len(figures) == 1
    figure = figures[0]
    canvas = FigureCanvasAgg(figure)  # the closed figure, drawn again as it was saved
    canvas.draw()
    renderer, page = canvas.get_renderer(), figure.bbox
    cells = [(ax.title.get_window_extent(renderer),
              ax.get_window_extent(renderer)) for ax in figure.axes if ax.images]
    assert len(cells) == len(records)
    for i, (title, _) in enumerate(cells):
        assert page.x0 <= title.x0 and title.x1 <= page.x1 and page.y0 <= title.y0 and title.y1 <= page.y1, i
        for j, (other_title, other_image) in enumerate(cells):
            assert i == j or (apart(title, other_title) and apart(title, other_image)), (i, j)


def test_dollar_signs_in_titles_are_text(tmp_path):
    """Regression: a "$" in a question, answer or prediction (chartqa's "$5", a random model's bytes) made
    matplotlib parse the title as mathtext and the run's results failed (ParseException) after training."""
    image = Image.new("RGB", (32, 32), "red")
    records = [{"images": [image], "texts": [{"user": "What did it cost in $?", "assistant": "$5"}]},
               {"images": [image], "texts": [{"user": "What did it cost?", "assistant": "5"}]}]
    save_prediction_grid(records, ["$4", "ci$B^$he"], tmp_path / "predictions.png")
    assert (tmp_path / "predictions.png").is_file()
