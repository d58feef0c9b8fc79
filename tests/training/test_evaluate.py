"""Held-out answers are asked the way the model was trained: prompts with the image tokens where its config puts them."""

import pytest
import torch
from PIL import Image

from data import IMAGE_TOKEN, ImageProcessor, build_shapes_tokenizer, encode_prompt, token_id
from models import VisionLanguageModel
from tests.models.helpers import tiny_vlm_config
from training.evaluate import answer


@pytest.mark.parametrize("image_position", ["before_text", "after_text"])
def test_answer_prompts_with_the_models_image_position(image_position, monkeypatch):
    tokenizer = build_shapes_tokenizer(["What color is the circle?", "How many shapes are there?", "red", "2"])
    config = tiny_vlm_config(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    model = VisionLanguageModel(config.replace({"image_token_id": str(token_id(tokenizer, IMAGE_TOKEN)),
                                                "image_position": image_position}))
    records = [{"images": [Image.new("RGB", (32, 32), "red")], "texts": [{"user": question, "assistant": "?"}]}
               for question in ("What color is the circle?", "How many shapes are there?")]
    prompts = []

    def generate(input_ids, images, attention_mask, **settings):
        prompts.extend(row[mask.bool()].tolist() for row, mask in zip(input_ids, attention_mask))
        return torch.full((len(input_ids), 1), tokenizer.eos_token_id)

    monkeypatch.setattr(model, "generate", generate)
    answer(model, tokenizer, ImageProcessor(32), records, torch.device("cpu"))
    assert prompts == [encode_prompt(tokenizer, r["texts"][0]["user"], 1, config.tokens_per_image, image_position)
                       for r in records]
    assert prompts != [encode_prompt(tokenizer, r["texts"][0]["user"], 1, config.tokens_per_image,
                                     "after_text" if image_position == "before_text" else "before_text") for r in records]
