"""One user turn (text and images) as model inputs, the way each kind of checkpoint was trained: `encode(prompt,
images)` -> (token ids with the assistant turn opened, pixels [tiles, 3, S, S] or None).

    model, processor = load_for_inference("HuggingFaceTB/SmolVLM-256M-Instruct", torch.device("cpu"))
    ids, pixels = processor.encode("What is in the picture?", [image])

- `ChatProcessor`: tinyvlm's own ChatML prompts (nanoVLM's too), images split or not as the model's config says;
- `CheckpointProcessor`: a released checkpoint's own transformers processor (SmolVLM / Idefics3): its chat template
  builds the prompt and its image processor splits the images.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from PIL import Image
from transformers import PreTrainedTokenizerBase

from data.image_splitting import ImageInputs
from data.prompts import encode_prompt
from models.checkpoints import RUNS, load_checkpoint, locate
from models.config import VLMConfig
from models.loading import CheckpointError


# tinyvlm's ChatML (data/prompts.py) with nanoVLM's / Idefics3's image splitting (data/image_splitting.py).
class ChatProcessor:
    """`encode(prompt, images)` for tinyvlm's own models (and nanoVLM's): `<|im_start|>user\n` + each image's
    placeholders + the prompt + `<|im_end|>\n<|im_start|>assistant\n`, images split when `config.splitting` says."""

    def __init__(self, config: VLMConfig, tokenizer: PreTrainedTokenizerBase) -> None:
        self.config, self.tokenizer = config, tokenizer
        self.images = ImageInputs.from_config(config, tokenizer)

    def encode(self, prompt: str, images: Sequence[Image.Image]) -> tuple[list[int], torch.Tensor | None]:
        pixels, placeholders = self.images(images)
        return encode_prompt(self.tokenizer, prompt, image_position=self.config.image_position,
                             placeholders=placeholders), pixels


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

    def encode(self, prompt: str, images: Sequence[Image.Image]) -> tuple[list[int], torch.Tensor | None]:
        """The chat-formatted ids of one user turn (its images first, then `prompt`) with the assistant turn opened,
        and the pixels of the images' tiles in placeholder order (one prompt: no padding images)."""
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": prompt}]
        text = self.processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        inputs = self.processor(text=text, images=[list(images)] if images else None, return_tensors="pt")
        ids = inputs["input_ids"][0].tolist()
        if not images:
            return ids, None
        return ids, inputs["pixel_values"][0]


def load_for_inference(checkpoint: str | Path | None, device: torch.device, allow_pickle: bool = False,
                       runs: Path = RUNS):
    """Model (eval mode, on `device`) and its chat processor (`encode(prompt, images)`, `.tokenizer`) for a checkpoint:
    tinyvlm's own, a SmolVLM / Idefics3 or a nanoVLM one; a directory, a hub id, or None for the newest under `runs`."""
    path = locate(checkpoint, runs, allow_pickle)
    model, tokenizer = load_checkpoint(path, device, allow_pickle)
    if tokenizer is None:  # the checkpoint ships its own processor
        return model, CheckpointProcessor.from_pretrained(path)
    return model, ChatProcessor(model.config, tokenizer)
