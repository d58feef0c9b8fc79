"""Conversations as model inputs, the way each kind of checkpoint was trained: one object per kind that both
training and inference use.

    model, processor = load_for_inference("HuggingFaceTB/SmolVLM-256M-Instruct", torch.device("cpu"))
    ids, pixels = processor.encode("What is in the picture?", [image])  # a prompt, the assistant turn opened
    turns = [Message("system", "Be brief."), Message("user", "What is it?", 1)]
    ids, pixels = processor.encode_chat(turns, [image])
    ids, targets, pixels = processor.encode_conversation(record["texts"], images)  # a training record
    ids, pixels = processor.encode("Which way?", [], video=read_video("clip.mp4", model.config.video))

- `ChatProcessor`: tinyvlm's own ChatML (data/prompts.py; nanoVLM's too), images split or not as the model's
  config says, a clip's frames one global image each in SmolVLM2's words (timestamps, duration);
- `CheckpointProcessor`: a released checkpoint's own transformers processor (SmolVLM / Idefics3): its chat
  template builds the conversation and its image processor splits the images.

Both are `ConversationEncoder`s: what `data.VQACollator` batches training records with. Targets are aligned
with the logits (`targets[t]` is `ids[t + 1]` where that token is part of an answer or the end-of-turn token
closing it, IGNORE_INDEX elsewhere); pixels are [tiles, 3, S, S] in placeholder order, or None without images.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from PIL import Image
from transformers import PreTrainedTokenizerBase

from data.image_splitting import ImageInputs, ImageSplitter
from data.prompts import IGNORE_INDEX, Message, PromptError, encode_chat, encode_conversation, encode_text
from data.tokenizer import IM_END, IM_START, IMAGE_TOKEN, token_id
from data.video import Clip, video_prompt
from models.config import ImagePosition, VLMConfig
from models.weights import CheckpointError

Turns = list[dict[str, str]]
FRAME = "\0"  # where video_prompt's text holds a frame, to be cut there
NO_IMAGES_BESIDE_A_VIDEO = "a video prompt holds the video's frames and no other images"


class ConversationEncoder(Protocol):
    """Training records and prompts as token ids, targets and pixels, in one checkpoint's format."""

    tokenizer: PreTrainedTokenizerBase
    image_token_id: int  # the placeholder the model writes image features over
    tokens_per_image: int  # placeholders per tile
    image_size: int  # the side of one tile

    def check(self) -> None:
        """Raise now (not at the first batch) if the tokenizer lacks a token the encoding needs."""

    def check_texts(self, turns: Turns) -> None:
        """Raise PromptError for a text this format cannot keep as text (training skips such a record)."""

    def encode(self, prompt: str, images: Sequence[Image.Image],
               video: Clip | None = None) -> tuple[list[int], torch.Tensor | None]:
        """One user turn with the assistant turn opened: (ids, pixels)."""

    def encode_chat(self, messages: Sequence[Message], images: Sequence[Image.Image],
                    video: Clip | None = None) -> tuple[list[int], torch.Tensor | None]:
        """A conversation (system, user and assistant messages; each user message's images, in order, or a
        video opening the first user message) with the assistant turn opened: (ids, pixels). One user message
        gives `encode`'s ids."""

    def encode_conversation(
        self, turns: Turns, images: Sequence[Image.Image], video: Clip | None = None
    ) -> tuple[list[int], list[int], torch.Tensor | None]:
        """A whole conversation ({"user", "assistant"} turns; the images, or a video's frames, in the first
        user turn, as `encode_chat` places them): (ids, targets, pixels)."""

    def save_pretrained(self, directory: Path) -> None:
        """Write what `load_for_inference` needs besides the model (tokenizer, processor files) into
        `directory`."""


# SmolVLM2's video processor (each frame resized to one square tile, not split), for any of our configs.
def frame_inputs(images: ImageInputs) -> ImageInputs:
    """How a clip's frames go in beside `images`: each one global image. An unsplit square resize as it is;
    splitting capped at one tile (`<fake_token_around_image><global-img>` + its tokens for the idefics3
    layout, `<|global_image|>` + its tokens for nanovlm's), with the layout's own filter and
    normalisation."""
    splitter = images.processor
    if not isinstance(splitter, ImageSplitter):
        return images
    one_tile = ImageSplitter(splitter.image_size, splitter.image_size, splitter.layout, splitter.resample,
                             splitter.mean.flatten().tolist(), splitter.std.flatten().tolist(),
                             splitter.backend)
    return ImageInputs(one_tile, images.tokens_per_image, images.tokenizer)


# tinyvlm's ChatML (data/prompts.py) with nanoVLM's / Idefics3's image splitting (data/image_splitting.py).
class ChatProcessor:
    """tinyvlm's own models (and nanoVLM's): `<|im_start|>user\\n` + each image's placeholders + the text +
    `<|im_end|>\\n<|im_start|>assistant\\n` (images after the text with image_position="after_text"), answers
    closed by `<|im_end|>`; `images` (`ImageInputs`) splits them or not. A clip's frames go in as SmolVLM2
    writes them, each one global image (`encode_chat`'s `video`)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, images: ImageInputs,
                 image_position: ImagePosition = "before_text") -> None:
        self.tokenizer = tokenizer
        self.images = images
        self.frames = frame_inputs(images)
        self.image_position = image_position

    @classmethod
    def from_config(cls, config: VLMConfig, tokenizer: PreTrainedTokenizerBase) -> ChatProcessor:
        """As the model's config says: its image position, and its splitting (or one square per image)."""
        return cls(tokenizer, ImageInputs.from_config(config, tokenizer), config.image_position)

    @property
    def image_token_id(self) -> int:
        return token_id(self.tokenizer, IMAGE_TOKEN)

    @property
    def tokens_per_image(self) -> int:
        return self.images.tokens_per_image

    @property
    def image_size(self) -> int:
        return self.images.image_size

    def check(self) -> None:
        for token in (IM_START, IM_END):
            token_id(self.tokenizer, token)
        self.images.check_tokenizer()

    def check_texts(self, turns: Turns) -> None:
        """Raise PromptError where a text holds an image placeholder (`<|image|>`, or LLaVA's `<image>`):
        encoding would keep it as text (data/prompts.py), but a record's images belong in its "images", not in
        its texts."""
        for turn in turns:
            for text in turn.values():
                for placeholder in (IMAGE_TOKEN, "<image>"):
                    if placeholder in text:
                        raise PromptError(f"the text holds {placeholder}: a record's images go in its "
                                          "\"images\" (the prompt format places them), not in its texts: "
                                          f"{text[:60]!r}")

    def encode(self, prompt: str, images: Sequence[Image.Image],
               video: Clip | None = None) -> tuple[list[int], torch.Tensor | None]:
        return self.encode_chat([Message("user", prompt, len(images))], images, video)

    def encode_chat(self, messages: Sequence[Message], images: Sequence[Image.Image],
                    video: Clip | None = None) -> tuple[list[int], torch.Tensor | None]:
        """The conversation's ChatML ids (data/prompts.py `encode_chat`), the assistant turn opened, and the
        pixels in placeholder order. A `video` (no images beside it) takes the place of the first user
        message's images: SmolVLM2's text (frame count, duration, each frame's timestamp) around each frame's
        placeholders, each frame one global image (`frame_inputs`)."""
        if video is None:
            pixels, placeholders = self.images(images)
            ids = encode_chat(self.tokenizer, messages, self.image_position, placeholders=placeholders)
            return ids, pixels
        if images or any(message.images for message in messages):
            raise PromptError(NO_IMAGES_BESIDE_A_VIDEO)
        first_user = next((i for i, message in enumerate(messages) if message.role == "user"), None)
        if first_user is None:
            raise PromptError("a video needs a user message to go in")
        messages = [dataclasses.replace(message, images=int(i == first_user))
                    for i, message in enumerate(messages)]
        placeholder, pixels = self._video_inputs(video)
        return encode_chat(self.tokenizer, messages, self.image_position, placeholders=[placeholder]), pixels

    def _video_inputs(self, video: Clip) -> tuple[list[int], torch.Tensor]:
        """The clip as one placeholder (`video_prompt`'s text encoded as plain text, each frame's placeholder
        ids in their place) and its frames' pixels."""
        frame_ids = self.frames.placeholders(video.frames[:1])[0]  # alike for every frame: one global image
        texts = video_prompt(video, FRAME).split(FRAME)
        ids = encode_text(self.tokenizer, texts[0])
        for text in texts[1:]:
            ids += [*frame_ids, *encode_text(self.tokenizer, text)]
        return ids, self.frames.pixels(video.frames)

    def encode_conversation(
        self, turns: Turns, images: Sequence[Image.Image], video: Clip | None = None
    ) -> tuple[list[int], list[int], torch.Tensor | None]:
        """A training record's ids, targets and pixels; a `video` (no images beside it) goes in the first user
        turn as `encode_chat` places it, so that a record trains on the prompt inference builds."""
        if video is None:
            placeholders, pixels = self.images.placeholders(images), self.images.pixels(images)
        elif images:
            raise PromptError(NO_IMAGES_BESIDE_A_VIDEO)
        else:
            placeholder, pixels = self._video_inputs(video)
            placeholders = [placeholder]
        ids, targets = encode_conversation(self.tokenizer, turns, image_position=self.image_position,
                                           placeholders=placeholders)
        return ids, targets, pixels

    def save_pretrained(self, directory: Path) -> None:
        self.tokenizer.save_pretrained(directory)


class TemplateError(CheckpointError):
    """A checkpoint's chat template or processor that breaks what answer-only targets rely on."""


# transformers' Idefics3Processor (image splitting, `<row_R_col_C>` / `<global-img>` markers, the chat
# template).
class CheckpointProcessor:
    """A checkpoint's own transformers processor (Idefics3Processor: SmolVLM's
    `User:<image>...<end_of_utterance>\\n Assistant: ...<end_of_utterance>\\n`), its chat template and its
    image processor."""

    def __init__(self, processor) -> None:
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.end_of_turn = getattr(processor, "end_of_utterance_token", None) or self.tokenizer.eos_token

    @classmethod
    def from_pretrained(cls, path: Path) -> CheckpointProcessor:
        from transformers import AutoProcessor

        try:
            return cls(AutoProcessor.from_pretrained(path))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(
                f"{path}: its processor cannot be loaded ({type(e).__name__}: {e})"
            ) from None

    @property
    def image_token_id(self) -> int:
        return self.processor.image_token_id

    @property
    def tokens_per_image(self) -> int:
        return self.processor.image_seq_len

    @property
    def image_size(self) -> int:
        return self.processor.image_processor.max_image_size["longest_edge"]

    def check(self) -> None:
        if self.tokenizer.pad_token_id is None:
            raise CheckpointError("the checkpoint's tokenizer has no pad token")
        token_id(self.tokenizer, self.end_of_turn)

    def encode(self, prompt: str, images: Sequence[Image.Image],
               video: Clip | None = None) -> tuple[list[int], torch.Tensor | None]:
        """The chat-formatted ids of one user turn (its images or video first, then `prompt`) with the
        assistant turn opened, and the pixels of the images' tiles (or the frames) in placeholder order."""
        return self.encode_chat([Message("user", prompt, len(images))], images, video)

    def encode_chat(self, messages: Sequence[Message], images: Sequence[Image.Image],
                    video: Clip | None = None) -> tuple[list[int], torch.Tensor | None]:
        """The conversation through the checkpoint's chat template (each user message's images first), the
        assistant turn opened, and the pixels of every image's tiles in placeholder order. A `video`
        (SmolVLM2: no images beside it) opens the first user message, each frame one global image."""
        if sum(message.images for message in messages) != len(images):
            raise PromptError(f"the messages hold {sum(m.images for m in messages)} images but {len(images)} "
                              f"were given")
        self.check_texts([{message.role: message.text} for message in messages])
        first_user = next((i for i, message in enumerate(messages) if message.role == "user"), None)
        template = [{"role": message.role,
                     "content": [{"type": "video"}] * (video is not None and i == first_user)
                     + [{"type": "image"}] * message.images + [{"type": "text", "text": message.text}]}
                    for i, message in enumerate(messages)]
        text = self._template(template, prompt=True)
        return self._process(text, images) if video is None else self._process_video(text, images, video)

    def encode_conversation(
        self, turns: Turns, images: Sequence[Image.Image], video: Clip | None = None
    ) -> tuple[list[int], list[int], torch.Tensor | None]:
        """The conversation as the chat template writes it, its images expanded by the processor (the ids and
        pixels `encode` gives a prompt), with targets on each answer's tokens and the end-of-turn token
        closing it.

        Where each answer lies is found on token ids: the template's text up to an answer (the assistant turn
        opened) and up to its end must tokenize to prefixes of the whole conversation's ids, or a
        TemplateError says which turn breaks this. Images are found the same way: the processor's ids equal
        the template's outside the `<image>` tokens it expands, all of which come before the first answer."""
        if not turns:
            raise ValueError("a conversation needs at least one user/assistant turn")
        if video is not None:
            raise PromptError("training on clips takes tinyvlm's own prompt format; this checkpoint's chat "
                              "template trains on images only")
        messages = self._messages(turns, len(images))
        text = self._template(messages, prompt=False)
        ids, pixels = self._process(text, images)
        plain = self._tokenize(text)  # each image still one <image> token
        image_at = [i for i, token in enumerate(plain) if token == self.image_token_id]
        if len(image_at) != len(images):
            raise TemplateError(f"the chat template wrote {len(image_at)} image tokens for {len(images)} "
                                "images")
        first, after_images = (image_at[0], image_at[-1] + 1) if image_at else (len(plain), 0)
        shift = len(ids) - len(plain)  # the tokens the images' expansion added
        if ids[:first] != plain[:first] or ids[after_images + shift:] != plain[after_images:]:
            raise TemplateError("the processor's ids differ from the chat template's outside the expanded "
                                "images")
        end_of_turn = token_id(self.tokenizer, self.end_of_turn)
        is_answer = [False] * len(ids)
        for turn in range(len(turns)):
            start = self._prefix_length(plain, messages[:2 * turn + 1], True, turn,
                                        "the assistant turn opened")
            stop = self._prefix_length(plain, messages[:2 * turn + 2], False, turn, "the answer")
            if start < after_images:
                raise TemplateError(f"turn {turn}: the answer starts before the images end")
            closing = [i for i in range(start, stop) if plain[i] == end_of_turn]
            if not closing:
                raise TemplateError(f"turn {turn}: the chat template does not close the answer with "
                                    f"{self.end_of_turn}")
            for i in range(start + shift, closing[0] + 1 + shift):
                is_answer[i] = True
        targets = [token if learn else IGNORE_INDEX for token, learn in zip(ids[1:], is_answer[1:])]
        return ids, targets + [IGNORE_INDEX], pixels

    def save_pretrained(self, directory: Path) -> None:
        """The whole processor (tokenizer, image processor settings, chat template): a checkpoint with these
        files is asked through this class again (`load_for_inference`)."""
        self.processor.save_pretrained(directory)

    def check_texts(self, turns: Turns) -> None:
        """Raise PromptError where a text holds the image placeholder (`<image>`): the processor would expand
        it."""
        for turn in turns:
            for text in turn.values():
                if self.processor.image_token in text:
                    raise PromptError(f"the text holds {self.processor.image_token}, which the chat template "
                                      f"would take for an image: {text[:60]!r}")

    def _messages(self, turns: list[dict[str, str]], num_images: int) -> list[dict]:
        """Chat-template messages for the turns (a turn without "assistant" is a user message alone), the
        images at the start of the first user message."""
        self.check_texts(turns)
        messages = []
        for i, turn in enumerate(turns):
            content = [{"type": "image"}] * (num_images if i == 0 else 0) + [
                {"type": "text", "text": turn["user"]}
            ]
            messages.append({"role": "user", "content": content})
            if "assistant" in turn:
                messages.append({"role": "assistant",
                                 "content": [{"type": "text", "text": turn["assistant"]}]})
        return messages

    def _template(self, messages: list[dict], prompt: bool) -> str:
        return self.processor.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=False)

    def _tokenize(self, text: str) -> list[int]:
        return self.tokenizer(text)["input_ids"]

    def _process(self, text: str, images: Sequence[Image.Image]) -> tuple[list[int], torch.Tensor | None]:
        inputs = self.processor(text=text, images=[list(images)] if images else None, return_tensors="pt")
        ids = inputs["input_ids"][0].tolist()
        return ids, inputs["pixel_values"][0] if images else None

    def _process_video(self, text: str, images: Sequence[Image.Image],
                       video: Clip) -> tuple[list[int], torch.Tensor]:
        """The template's text with its `<video>` written out in SmolVLM2's words, and the frames' pixels,
        each resized as the checkpoint's video processor resizes them."""
        processor = self.processor
        if getattr(processor, "video_processor", None) is None:
            raise PromptError("this checkpoint's processor takes no video (SmolVLM2's does)")
        if images:
            raise PromptError(NO_IMAGES_BESIDE_A_VIDEO)
        frame_text = (processor.fake_image_token + processor.global_image_token
                      + processor.image_token * processor.image_seq_len + processor.fake_image_token)
        text = text.replace(processor.video_token, video_prompt(video, frame_text), 1)
        frames = np.stack([np.asarray(frame) for frame in video.frames])
        pixels = processor.video_processor(videos=[frames], do_sample_frames=False, return_tensors="pt")
        return self._tokenize(text), pixels["pixel_values"][0]

    def _prefix_length(self, ids: list[int], messages: list[dict], prompt: bool, turn: int, what: str) -> int:
        """The length of the template's ids for `messages`, checked to be a prefix of the whole
        conversation's."""
        prefix = self._tokenize(self._template(messages, prompt))
        if ids[:len(prefix)] != prefix:
            raise TemplateError(f"turn {turn}: the chat template's text up to {what} does not tokenize to a "
                                "prefix of the whole conversation's ids, so the answer's tokens cannot be "
                                "told apart")
        return len(prefix)

