"""ChatML token ids built piece by piece (never by tokenizing special-token strings), with answer-only
targets."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from data.tokenizer import IM_END, IM_START, IMAGE_TOKEN, token_id
from models.config import ImagePosition
from models.errors import TinyVLMError
from models.linear_cross_entropy import IGNORE_INDEX  # targets at positions that carry no loss

CAPTION_PROMPT = "Describe the image."  # the user turn of caption samples; generate.py's default prompt
ROLES = ("system", "user", "assistant")


@dataclasses.dataclass(frozen=True)
class Message:
    """One message of a conversation to answer: its role, its text, and how many of the conversation's images
    (in order) it holds (user messages only)."""

    role: str
    text: str
    images: int = 0

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise PromptError(f"a message's role must be one of {ROLES}, got {self.role!r}")
        if self.images and self.role != "user":
            raise PromptError(f"only user messages hold images, not a {self.role} message")


class PromptError(TinyVLMError, ValueError):
    """Text that cannot be encoded: not a string, or not valid Unicode (e.g. invalid UTF-8 bytes from a
    command line)."""


def encode_text(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Plain text: no BOS/EOS, and special-token strings a user typed (a literal "<|image|>") stay ordinary
    text."""
    if not isinstance(text, str):
        raise PromptError(f"expected text, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # Python decodes undecodable argv bytes to lone surrogates
        raise PromptError(f"the text is not valid UTF-8 (undecodable bytes at character {e.start})") from None
    return list(_encode(tokenizer, len(tokenizer), text))


@functools.lru_cache(maxsize=4096)
def _encode(tokenizer: PreTrainedTokenizerBase, vocab_size: int, text: str) -> tuple[int, ...]:
    """Memoised: every record repeats the chat pieces ("user\\n", "assistant\\n"), and a templated dataset its
    questions; a record costs 6 encodes (~30 us each on a 2-core CPU, ~5 ms a training batch). `vocab_size` in
    the key: a token added to the tokenizer later can change how a text encodes."""
    return tuple(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))


def encode_prompt(tokenizer: PreTrainedTokenizerBase, user_text: str, num_images: int = 0,
                  tokens_per_image: int = 0, image_position: ImagePosition = "before_text", *,
                  placeholders: Sequence[Sequence[int]] | None = None) -> list[int]:
    """`<|im_start|>user\\n` + images + text + `<|im_end|>\\n<|im_start|>assistant\\n`; with
    image_position="after_text" the images follow the text instead.

    The images are each image's placeholder ids, in order: `placeholders` (from `data.ImageInputs` /
    `data.prepare_images`, which split images when the model's config says so), or else `num_images` unsplit
    images of `<|image|>` x tokens_per_image each."""
    if placeholders is not None and (num_images or tokens_per_image):
        raise ValueError("give the images as placeholders or as num_images and tokens_per_image, not both")
    if placeholders is None:
        images = [token_id(tokenizer, IMAGE_TOKEN)] * (num_images * tokens_per_image)
    else:
        images = [token for placeholder in placeholders for token in placeholder]
    return encode_chat(tokenizer, [Message("user", user_text, 1 if images else 0)], image_position,
                       placeholders=[images] if images else [])


def encode_chat(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message],
                image_position: ImagePosition = "before_text", *,
                placeholders: Sequence[Sequence[int]]) -> list[int]:
    """A conversation's ChatML ids with the assistant turn opened: each message as
    `<|im_start|>` + role + `\\n` + content + `<|im_end|>\\n`, a user message's content being its images'
    placeholder ids (the next `message.images` of `placeholders`, in order) before its text (or after, with
    image_position="after_text"); then `<|im_start|>assistant\\n`. A turn's prompt, its answer and
    `<|im_end|>\n` are the start of the next turn's prompt, so the engine's prefix cache reuses them."""
    if image_position not in ("before_text", "after_text"):
        raise ValueError(f"image_position must be 'before_text' or 'after_text', got {image_position!r}")
    if sum(message.images for message in messages) != len(placeholders):
        raise PromptError(f"the messages hold {sum(m.images for m in messages)} images but "
                          f"{len(placeholders)} were given")
    start = token_id(tokenizer, IM_START)
    end = token_id(tokenizer, IM_END)
    newline = encode_text(tokenizer, "\n")
    ids, next_image = [], 0
    for message in messages:
        images = [token for placeholder in placeholders[next_image : next_image + message.images]
                  for token in placeholder]
        next_image += message.images
        text = encode_text(tokenizer, message.text)
        content = images + text if image_position == "before_text" else text + images
        ids += [start, *encode_text(tokenizer, f"{message.role}\n"), *content, end, *newline]
    return [*ids, start, *encode_text(tokenizer, "assistant\n")]


def encode_conversation(
    tokenizer: PreTrainedTokenizerBase, turns: list[dict[str, str]], num_images: int = 0,
    tokens_per_image: int = 0, image_position: ImagePosition = "before_text", *,
    placeholders: Sequence[Sequence[int]] | None = None,
) -> tuple[list[int], list[int]]:
    """ChatML ids for `turns` ({"user", "assistant"} dicts; the images go in the first user turn, given as in
    `encode_prompt`) and their targets.

    Targets are aligned with the logits: `targets[t]` is `input_ids[t + 1]` where that token is part of an
    answer or the `<|im_end|>` closing one, and IGNORE_INDEX everywhere else (the last position included).
    """
    if not turns:
        raise ValueError("a conversation needs at least one user/assistant turn")
    end, newline = token_id(tokenizer, IM_END), encode_text(tokenizer, "\n")
    input_ids: list[int] = []
    is_answer: list[bool] = []
    for i, turn in enumerate(turns):
        if i == 0:
            prompt = encode_prompt(tokenizer, turn["user"], num_images, tokens_per_image, image_position,
                                   placeholders=placeholders)
        else:
            prompt = encode_prompt(tokenizer, turn["user"], image_position=image_position)
        answer = [*encode_text(tokenizer, turn["assistant"]), end]
        input_ids += prompt + answer + newline
        is_answer += [False] * len(prompt) + [True] * len(answer) + [False] * len(newline)
    targets = [token if learn else IGNORE_INDEX for token, learn in zip(input_ids[1:], is_answer[1:])]
    return input_ids, targets + [IGNORE_INDEX]
