"""Prompts and pixels for released checkpoints that ship their own transformers processor (SmolVLM / Idefics3): the
checkpoint's chat template builds the prompt and its image processor splits the images, so a model is asked exactly
the way it was trained."""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image

from models.loading import CheckpointError

PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")


def has_processor(path: Path) -> bool:
    """Whether the checkpoint directory ships a transformers (image) processor of its own."""
    return any((path / name).is_file() for name in PROCESSOR_FILES)


# transformers' Idefics3Processor (image splitting, `<row_R_col_C>` / `<global-img>` markers, the chat template).
class CheckpointProcessor:
    """`encode(prompt, images)` -> (token ids, pixels [tiles, 3, S, S] or None) through the checkpoint's processor."""

    def __init__(self, processor) -> None:
        self.processor = processor
        self.tokenizer = processor.tokenizer

    @classmethod
    def from_pretrained(cls, path: Path) -> CheckpointProcessor:
        from transformers import AutoProcessor

        try:
            return cls(AutoProcessor.from_pretrained(path))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{path}: its processor cannot be loaded ({type(e).__name__}: {e})") from None

    def encode(self, prompt: str, images: list[Image.Image]) -> tuple[list[int], torch.Tensor | None]:
        """The chat-formatted ids of one user turn (its images first, then `prompt`) with the assistant turn opened,
        and the pixels of the images' tiles in placeholder order (one prompt: no padding images)."""
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": prompt}]
        text = self.processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        inputs = self.processor(text=text, images=[images] if images else None, return_tensors="pt")
        ids = inputs["input_ids"][0].tolist()
        if not images:
            return ids, None
        return ids, inputs["pixel_values"][0]
