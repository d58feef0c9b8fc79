"""Images in: `load_image` (any file → RGB PIL, typed errors) and `ImageProcessor` (PIL → normalised tensor,
SigLIP-style)."""

from __future__ import annotations

import io
import os
import warnings
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from models.config import VisionConfig
from models.errors import TinyVLMError
from typed_config import one_line

MAX_IMAGE_PIXELS = 8192 * 8192  # larger images are refused as likely decompression bombs
_WIDE_GREY_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")  # 16-bit greyscale as PIL reads it


class ImageLoadError(TinyVLMError, ValueError):
    """A missing, empty, unreadable, corrupt or oversized image file."""


def load_image(source: str | os.PathLike | BinaryIO, max_pixels: int = MAX_IMAGE_PIXELS) -> Image.Image:
    """Open an image file (path or binary file object) as RGB; the first frame of an animation.

    Raises ImageLoadError with a one-line message naming the file for anything that is not a readable image,
    or that would decode to more than `max_pixels` pixels.
    """
    name = (
        os.fspath(source)
        if isinstance(source, (str, os.PathLike))
        else getattr(source, "name", "<file object>")
    )
    try:
        data = Path(source).read_bytes() if isinstance(source, (str, os.PathLike)) else source.read()
    except FileNotFoundError:
        raise ImageLoadError(f"{name}: no such file") from None
    except OSError as e:
        raise ImageLoadError(f"{name}: cannot read ({e.strerror or e})") from None
    if not data:
        raise ImageLoadError(f"{name}: empty file (0 bytes)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            if image.width * image.height > max_pixels:
                raise Image.DecompressionBombError
            image.load()
    except (Image.DecompressionBombWarning, Image.DecompressionBombError):
        raise ImageLoadError(f"{name}: more than {max_pixels} pixels (a decompression bomb?)") from None
    except UnidentifiedImageError:
        raise ImageLoadError(f"{name}: not an image file (or a format Pillow cannot read)") from None
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise ImageLoadError(f"{name}: corrupt or truncated image ({one_line(e)})") from None
    return to_rgb(image)


def to_rgb(image: Image.Image) -> Image.Image:
    """Any PIL mode → RGB: transparency composited on white; 16-bit greyscale (`I;16`, `I`) scaled, not
    clipped, to 8 bits."""
    if image.mode in _WIDE_GREY_MODES:
        pixels = np.asarray(image, dtype=np.float64) * (255 / 65535)
        image = Image.fromarray(pixels.round().clip(0, 255).astype(np.uint8))
    if image.has_transparency_data:
        image = Image.alpha_composite(Image.new("RGBA", image.size, (255, 255, 255, 255)),
                                      image.convert("RGBA"))
    return image.convert("RGB")


class ImageProcessor:
    """PIL image → float tensor [3, image_size, image_size]: square resize, scale to [0, 1], normalise per
    channel.

    The same numbers as torchvision's `v2.Compose([Resize, ToImage, ToDtype(scale=True), Normalize])`, bit for
    bit, in a sixth of its time: an image already at `image_size` (the synthetic data's) is not resized, and
    the rest is three tensor operations (the training loop processes every image of every batch on the step's
    own cores)."""

    def __init__(self, image_size: int, mean: tuple[float, ...] = (0.5, 0.5, 0.5),
                 std: tuple[float, ...] = (0.5, 0.5, 0.5)):
        self.image_size = image_size
        self.mean = torch.tensor(mean, dtype=torch.float32).view(3, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(3, 1, 1)

    @classmethod
    def from_config(cls, config: VisionConfig) -> ImageProcessor:
        return cls(config.image_size, config.image_mean, config.image_std)

    def __call__(self, image: Image.Image) -> torch.Tensor:
        image = to_rgb(image)
        if image.size != (self.image_size, self.image_size):
            # as v2.Resize does
            image = image.resize((self.image_size, self.image_size), Image.Resampling.BILINEAR)
        pixels = torch.from_numpy(np.array(image)).permute(2, 0, 1)  # uint8 [3, H, W]
        return (pixels.to(torch.float32) * (1 / 255) - self.mean) / self.std
