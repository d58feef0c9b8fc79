"""Fuzzing (hypothesis) the paths user input flows through, 1,800 cases in all: image bytes → `load_image` →
`ImageProcessor`, and text → prompts → collator → the VLM's image splice. Only the documented errors
(ImageLoadError, PromptError) may come out: no other exception, no crash, no hang."""

import io
import signal
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from data import (
    IM_END,
    IM_START,
    IMAGE_TOKEN,
    PAD_TOKEN,
    ImageLoadError,
    ImageProcessor,
    PromptError,
    VQACollator,
    encode_conversation,
    load_image,
    token_id,
)
from models import LanguageConfig, ProjectorConfig, VisionConfig, VisionLanguageModel, VLMConfig

TOKENS_PER_IMAGE = 4
SECONDS_PER_CASE = 10  # far above any real case (milliseconds): only a hang gets near it
FUZZ = settings(deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@contextmanager
def no_hang(seconds: int = SECONDS_PER_CASE):
    def give_up(signum, frame):
        raise TimeoutError(f"hung for more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, give_up)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def encoded(image: Image.Image, format: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=format, **options)
    return buffer.getvalue()


def _seed_files() -> list[bytes]:
    """Valid files of many formats and modes, which mutations turn into plausible corrupt ones."""
    rng = np.random.default_rng(0)
    rgb = Image.fromarray(rng.integers(0, 256, (12, 10, 3), dtype=np.uint8))
    frames = [Image.new("P", (6, 6), i) for i in range(3)]
    return [
        encoded(rgb, "PNG"), encoded(rgb.convert("RGBA"), "PNG"),
        encoded(rgb.convert("P"), "PNG", transparency=0), encoded(rgb.convert("LA"), "PNG"),
        encoded(Image.fromarray(rng.integers(0, 65535, (5, 7), dtype=np.uint16)), "PNG"),
        encoded(rgb, "JPEG", quality=80), encoded(rgb.convert("L"), "JPEG", progressive=True),
        encoded(rgb, "BMP"), encoded(rgb.convert("CMYK"), "TIFF"),
        encoded(rgb, "TIFF", compression="tiff_lzw"), encoded(rgb, "WEBP"), encoded(rgb, "GIF"),
        encoded(frames[0], "GIF", save_all=True, append_images=frames[1:]), encoded(rgb, "ICO"),
        encoded(rgb, "PPM"), encoded(rgb, "TGA"),
    ]


SEED_FILES = _seed_files()


@st.composite
def corrupted_files(draw) -> bytes:
    """A valid file, then a few edits: truncation, overwritten bytes, inserted bytes, a foreign header."""
    data = bytearray(draw(st.sampled_from(SEED_FILES)))
    for _ in range(draw(st.integers(1, 4))):
        edit = draw(st.sampled_from(["truncate", "overwrite", "insert", "graft"]))
        at = draw(st.integers(0, max(0, len(data) - 1)))
        if edit == "truncate":
            del data[at:]
        elif edit == "overwrite":
            chunk = draw(st.binary(min_size=1, max_size=8))
            data[at : at + len(chunk)] = chunk
        elif edit == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        else:
            data[:at] = draw(st.sampled_from(SEED_FILES))[:at]
    return bytes(data)


@pytest.fixture(scope="module")
def processor():
    return ImageProcessor(24)


@pytest.mark.filterwarnings("ignore::UserWarning")  # Pillow warns about the corrupt metadata it is fed here
@settings(FUZZ, max_examples=800)
@given(data=st.one_of(corrupted_files(), st.binary(max_size=512)))
def test_image_bytes_give_an_rgb_image_or_an_image_load_error(processor, data):
    with no_hang():
        try:
            image = load_from_bytes(data)
        except ImageLoadError as e:
            assert "\n" not in str(e) and str(e).startswith("<file object>: ")
            return
        assert image.mode == "RGB"
        pixels = processor(image)
    assert pixels.shape == (3, 24, 24) and torch.isfinite(pixels).all()


def load_from_bytes(data: bytes) -> Image.Image:
    return load_image(io.BytesIO(data))


def _writable(mode: str, format: str) -> bool:
    try:
        encoded(Image.new(mode, (2, 2)), format)
    except (OSError, ValueError, KeyError):
        return False
    return True


MODES_AND_FORMATS = [(m, f) for m in ("RGB", "RGBA", "L", "LA", "P", "CMYK", "I;16", "I", "1")
                     for f in ("PNG", "TIFF", "GIF", "BMP", "WEBP", "JPEG") if _writable(m, f)]


@settings(FUZZ, max_examples=300)
@given(mode_and_format=st.sampled_from(MODES_AND_FORMATS), width=st.integers(1, 40),
       height=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_every_valid_image_loads_as_rgb_of_its_size(mode_and_format, width, height, seed):
    mode, format = mode_and_format
    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 256, (height, width, 4), dtype=np.uint8), "RGBA").convert(mode)
    with no_hang():
        loaded = load_from_bytes(encoded(image, format))
    assert loaded.mode == "RGB" and loaded.size == (width, height)


SPECIAL_STRINGS = [IMAGE_TOKEN, IM_START, IM_END, PAD_TOKEN, "<|image", "|>", "user\n", "assistant\n", "\n"]
user_texts = st.lists(st.one_of(st.text(max_size=30), st.sampled_from(SPECIAL_STRINGS)),
                      max_size=8).map("".join)
# user texts, or any code points (lone surrogates included)
any_texts = st.one_of(user_texts, st.text(st.characters(codec=None, exclude_categories=()), max_size=20))


@pytest.fixture(scope="module")
def vlm(shapes_tokenizer):
    torch.manual_seed(0)
    config = VLMConfig(
        vision=VisionConfig(image_size=16, patch_size=8, hidden_size=16, intermediate_size=32, num_layers=1,
                            num_heads=2),
        projector=ProjectorConfig(pixel_shuffle_factor=1),
        language=LanguageConfig(vocab_size=len(shapes_tokenizer), hidden_size=32, intermediate_size=64,
                                num_layers=1, num_heads=2, num_kv_heads=1, max_position_embeddings=1024),
        image_token_id=token_id(shapes_tokenizer, IMAGE_TOKEN),
    )
    assert config.tokens_per_image == TOKENS_PER_IMAGE
    return VisionLanguageModel(config).eval()


@settings(FUZZ, max_examples=700)
@given(user=any_texts, answer=any_texts, num_images=st.integers(0, 2))
def test_user_text_never_becomes_image_placeholders(shapes_tokenizer, vlm, user, answer, num_images):
    turns = [{"user": user, "assistant": answer}]
    try:
        ids, targets = encode_conversation(shapes_tokenizer, turns, num_images, TOKENS_PER_IMAGE)
    except PromptError as e:
        assert "not valid UTF-8" in str(e)
        assert any(0xD800 <= ord(c) <= 0xDFFF for c in user + answer)
        return
    image_id = token_id(shapes_tokenizer, IMAGE_TOKEN)
    assert ids.count(image_id) == num_images * TOKENS_PER_IMAGE  # only the placeholders we put there
    collator = VQACollator(shapes_tokenizer, ImageProcessor(16), TOKENS_PER_IMAGE, max_length=4096)
    batch = collator([{"images": [Image.new("RGB", (5, 5))] * num_images, "texts": turns}])
    with no_hang(), torch.no_grad():
        logits, loss = vlm(**batch)
    assert logits.shape[:2] == batch["input_ids"].shape and torch.isfinite(loss)
