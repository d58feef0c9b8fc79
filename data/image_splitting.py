"""Image splitting (SmolVLM / Idefics3, nanoVLM): one image becomes a grid of encoder-sized tiles plus a
downscaled global image, each shown to the ViT as an image of its own, with marker tokens in the prompt naming
each tile's place.

    pixels, placeholders = prepare_images(model.config, tokenizer, [image])
    ids = encode_prompt(tokenizer, question, image_position=model.config.image_position,
                        placeholders=placeholders)

Inference goes through `data.chat_processors.ChatProcessor.encode(prompt, images)`, which does both steps.

`config.splitting` (models.config.SplitConfig) picks the layout; disabled, an image is one square
(`ImageProcessor`) and its placeholder `<|image|>` x tokens_per_image, as before splitting existed. Layouts:

- "idefics3": transformers' Idefics3ImageProcessor. Resize so the longer side is `max_image_size` (aspect
  kept, the other side rounded up to even), then up to whole multiples of the tile size, cut into tiles row by
  row, and put the whole image resized to one tile LAST (an image that fits one tile is not split: just that
  tile). Prompt per image: `<fake_token_around_image><row_R_col_C>` + image tokens per tile, "\\n" after each
  row, then "\\n<fake_token_around_image><global-img>" + image tokens + `<fake_token_around_image>`; an
  unsplit image is just the last part, without the newline.
- "nanovlm": nanoVLM's DynamicResize + GlobalAndSplitImages. Resize so the longer side is `max_image_size` and
  the shorter one is the next multiple of the tile size up (aspect kept), cut into tiles, and put a bilinear
  downscale of the whole image FIRST (none for a 1x1 grid). Prompt: `<|global_image|>` + image tokens, then
  `<row_R_col_C>` + image tokens per tile, no newlines; `<image: i>` before each image when a prompt has
  several.

Pixels are scaled to [0, 1] and normalised with the ViT's mean and std (nanoVLM itself does not normalise).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Literal

import numpy as np
import torch
from PIL import Image
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from data.images import ImageProcessor, to_rgb
from data.prompts import encode_text
from data.tokenizer import IMAGE_TOKEN, token_id
from models.config import VLMConfig
from models.split_config import Resample, SplitConfig, SplitLayout

Backend = Literal["torchvision", "pil"]

FAKE_IMAGE_TOKEN = "<fake_token_around_image>"  # idefics3: opens every tile and closes the global image
IDEFICS3_GLOBAL_TOKEN = "<global-img>"
NANOVLM_GLOBAL_TOKEN = "<|global_image|>"
IDEFICS3_MAX_SIDE = 4096  # transformers' MAX_IMAGE_SIZE: no resized side exceeds it
PIL_FILTERS = {"lanczos": Image.Resampling.LANCZOS, "bicubic": Image.Resampling.BICUBIC,
               "bilinear": Image.Resampling.BILINEAR}
DEFAULT_BACKEND: dict[str, Backend] = {"idefics3": "torchvision", "nanovlm": "pil"}


# nanoVLM models/config.py vlm_extra_tokens "rRcC"; transformers Idefics3Processor.replace_image_token's
# row/col tag.
def tile_token(row: int, col: int) -> str:
    """The marker of the tile in (1-based) row `row`, column `col`: `<row_1_col_2>` (Idefics3 and nanoVLM
    alike)."""
    return f"<row_{row}_col_{col}>"


# transformers idefics3 _resize_output_size_rescale_to_max_len, then
# _resize_output_size_scale_below_upper_bound.
def idefics3_resized_size(height: int, width: int, longest_edge: int) -> tuple[int, int]:
    """(height, width) with the longer side `longest_edge` (up or down), the other side kept in proportion,
    truncated and rounded up to even; then both scaled down so that neither exceeds 4096."""
    aspect_ratio = width / height
    if width >= height:
        width = longest_edge
        height = int(width / aspect_ratio)
        height += height % 2
    else:
        height = longest_edge
        width = int(height * aspect_ratio)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect_ratio = width / height
    if width >= height and width > IDEFICS3_MAX_SIDE:
        width = IDEFICS3_MAX_SIDE
        height = int(width / aspect_ratio)
    elif height > width and height > IDEFICS3_MAX_SIDE:
        height = IDEFICS3_MAX_SIDE
        width = int(height * aspect_ratio)
    return max(height, 1), max(width, 1)


# transformers Idefics3ImageProcessor.resize_for_vision_encoder.
def idefics3_tiled_size(height: int, width: int, tile: int) -> tuple[int, int]:
    """(height, width) rounded up to multiples of `tile`: the longer side first, the other from the aspect
    ratio."""
    aspect_ratio = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = int(width / aspect_ratio)
        height = math.ceil(height / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = int(height * aspect_ratio)
        width = math.ceil(width / tile) * tile
    return height, width


# nanoVLM data/custom_transforms.py DynamicResize._get_new_hw, with resize_to_max_side_len=True (its training
# default).
def nanovlm_resized_size(height: int, width: int, tile: int, max_side: int) -> tuple[int, int]:
    """(height, width) with the longer side `max_side` and the shorter one scaled alike, then rounded up to a
    multiple of `tile` (at least one tile)."""
    long, short = (width, height) if width >= height else (height, width)
    scale = max_side / long
    short = max(math.ceil(short * scale / tile) * tile, tile)
    return (short, max_side) if width >= height else (max_side, short)


# transformers Idefics3Processor's row_col tokens (6 x 6 there) / nanoVLM vlm_extra_tokens (8 x 8): sized
# here.
def max_grid(layout: SplitLayout, max_image_size: int, tile: int) -> int:
    """The most rows (or columns) of tiles any image can get: idefics3 ceil(longest_edge / tile), but one more
    when an odd longest_edge rounds the shorter side up past it; nanovlm max_side / tile."""
    if layout == "nanovlm":
        return max_image_size // tile
    side = min(max_image_size, IDEFICS3_MAX_SIDE)
    return math.ceil((side + side % 2) / tile)


# transformers Idefics3Processor.__init__'s special tokens / nanoVLM models/config.py vlm_extra_tokens.
def marker_tokens(config: VLMConfig) -> list[str]:
    """The special tokens the config's split prompts use, beyond `<|image|>` (none when splitting is
    disabled): add them with `data.prepare_tokenizer(tokenizer, marker_tokens(config))` before sizing the LM's
    vocabulary."""
    return ImageSplitter.from_config(config).marker_tokens() if config.splitting.enabled else []


# transformers Idefics3Processor.replace_image_token (was _prompt_split_image); nanoVLM
# processors.get_image_string.
def placeholder_ids(tokenizer: PreTrainedTokenizerBase, layout: SplitLayout, rows: int, cols: int,
                    tokens_per_image: int, index: int | None = None,
                    image_token: str = IMAGE_TOKEN) -> list[int]:
    """The prompt ids that stand for one split image of rows x cols tiles (1 x 1: not split), in `layout`'s
    form (see the module docstring); `index` (nanovlm only) is the image's place among several in the prompt.

    Marker tokens are looked up one by one, never tokenized from text; the text between them (the newlines,
    nanoVLM's `<image: i>`) is encoded as plain text, a run at a time, so "\\n\\n" becomes the tokens a
    tokenizer gives it."""
    image = [image_token] * tokens_per_image
    split = rows * cols > 1
    if layout == "idefics3":
        pieces = [FAKE_IMAGE_TOKEN, IDEFICS3_GLOBAL_TOKEN, *image, FAKE_IMAGE_TOKEN]
        if split:
            grid = []
            for row in range(1, rows + 1):
                for col in range(1, cols + 1):
                    grid += [FAKE_IMAGE_TOKEN, tile_token(row, col), *image]
                grid.append("\n")
            pieces = [*grid, "\n", *pieces]
        specials = {FAKE_IMAGE_TOKEN, IDEFICS3_GLOBAL_TOKEN}
    elif layout == "nanovlm":
        pieces = ([] if index is None else [f"<image: {index}>"]) + [NANOVLM_GLOBAL_TOKEN, *image]
        if split:
            pieces += [piece for row in range(1, rows + 1) for col in range(1, cols + 1)
                       for piece in (tile_token(row, col), *image)]
        specials = {NANOVLM_GLOBAL_TOKEN}
    else:
        raise ValueError(f"layout must be 'idefics3' or 'nanovlm', got {layout!r}")
    specials |= {image_token, *(tile_token(r, c) for r in range(1, rows + 1) for c in range(1, cols + 1))}
    return _encode_pieces(tokenizer, pieces, specials)


# tinyvlm's own (data/prompts.py style): special tokens by id, the text between them encoded as plain text.
def _encode_pieces(tokenizer: PreTrainedTokenizerBase, pieces: Iterable[str],
                   specials: set[str]) -> list[int]:
    ids: list[int] = []
    found: dict[str, int] = {}
    text = ""
    for piece in pieces:
        if piece not in specials:
            text += piece
            continue
        if text:
            ids += encode_text(tokenizer, text)
            text = ""
        if piece not in found:
            found[piece] = token_id(tokenizer, piece)
        ids.append(found[piece])
    return ids + (encode_text(tokenizer, text) if text else [])


# transformers Idefics3ImageProcessor(Pil)._preprocess; nanoVLM
# DynamicResize + ToTensor + GlobalAndSplitImages.
class ImageSplitter:
    """PIL image → (pixels [num_tiles, 3, S, S] in placeholder order, rows, cols), S = `image_size` (the tile,
    the ViT's input size). rows x cols is the grid of tiles, 1 x 1 for an image that is not split (then
    num_tiles is 1: no global image); otherwise num_tiles is rows * cols + 1.

    `backend` picks the code of the uint8 resizes (mostly 1 level of 255 apart, up to ~20 on noise):
    torchvision (`Idefics3ImageProcessor`, what transformers' AutoImageProcessor picks) or PIL
    (`Idefics3ImageProcessorPil`, nanoVLM's resize to the grid). Default: the layout's reference, torchvision
    for idefics3 and PIL for nanovlm.
    """

    def __init__(self, image_size: int, max_image_size: int, layout: SplitLayout = "idefics3",
                 resample: Resample = "lanczos", mean: Sequence[float] = (0.5, 0.5, 0.5),
                 std: Sequence[float] = (0.5, 0.5, 0.5), backend: Backend | None = None):
        # ConfigError (a ValueError) for an unknown layout or filter, or a size that does not cut into tiles
        split = {"enabled": True, "max_image_size": max_image_size, "layout": layout, "resample": resample}
        SplitConfig.from_dict(split).check_tile(image_size)
        self.image_size = image_size
        self.max_image_size = max_image_size
        self.layout = layout
        self.resample = resample
        self.backend: Backend = backend or DEFAULT_BACKEND[layout]
        self.mean = torch.tensor(mean, dtype=torch.float32)[:, None, None]
        self.std = torch.tensor(std, dtype=torch.float32)[:, None, None]

    @classmethod
    def from_config(cls, config: VLMConfig, backend: Backend | None = None) -> ImageSplitter:
        split, vision = config.splitting, config.vision
        return cls(vision.image_size, split.max_image_size, split.layout, split.resample, vision.image_mean,
                   vision.image_std, backend)

    def marker_tokens(self) -> list[str]:
        """The special tokens this layout's placeholders use beyond `<|image|>`, for every grid it can
        make."""
        n = max_grid(self.layout, self.max_image_size, self.image_size)
        tiles = [tile_token(row, col) for row in range(1, n + 1) for col in range(1, n + 1)]
        if self.layout == "idefics3":
            return [FAKE_IMAGE_TOKEN, IDEFICS3_GLOBAL_TOKEN, *tiles]
        return [NANOVLM_GLOBAL_TOKEN, *tiles]

    def resized_size(self, width: int, height: int) -> tuple[int, int]:
        """The (height, width) the image is resized to before it is cut: whole multiples of the tile size."""
        if self.layout == "idefics3":
            height, width = idefics3_resized_size(height, width, self.max_image_size)
            return idefics3_tiled_size(height, width, self.image_size)
        return nanovlm_resized_size(height, width, self.image_size, self.max_image_size)

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """(rows, cols) of tiles for an image of this size, without processing any pixels."""
        height, width = self.resized_size(width, height)
        return height // self.image_size, width // self.image_size

    def __call__(self, image: Image.Image) -> tuple[Tensor, int, int]:
        pixels = torch.from_numpy(np.array(to_rgb(image))).permute(2, 0, 1)  # uint8 [3, H, W]
        if self.layout == "idefics3":  # every resize on uint8 images, as transformers does
            pixels = self._resize(pixels, *idefics3_resized_size(*pixels.shape[1:], self.max_image_size))
            pixels = self._resize(pixels, *idefics3_tiled_size(*pixels.shape[1:], self.image_size))
            tiles, rows, cols = self._tiles(pixels)
            if rows * cols > 1:
                tiles = torch.cat([tiles, self._resize(pixels, self.image_size, self.image_size)[None]])
            return self._normalise(tiles), rows, cols
        pixels = self._resize(pixels,
                              *nanovlm_resized_size(*pixels.shape[1:], self.image_size, self.max_image_size))
        pixels = pixels.float().div(255)  # nanoVLM's ToTensor; its global image is resized from these floats
        tiles, rows, cols = self._tiles(pixels)
        if rows * cols > 1:
            size = [self.image_size, self.image_size]
            whole = _torchvision_resize(pixels, size, "bilinear")
            tiles = torch.cat([whole[None], tiles])
        return (tiles - self.mean) / self.std, rows, cols

    def _normalise(self, tiles: Tensor) -> Tensor:
        """uint8 → float32 scaled by 1/255 and normalised, with the rounding of transformers' backend."""
        if self.backend == "torchvision":  # TorchvisionBackend's fused rescale and normalise
            return (tiles.float() - self.mean * 255.0) / (self.std * 255.0)
        return (tiles.double().mul(1 / 255).float() - self.mean) / self.std  # PilBackend: rescale in float64

    def _tiles(self, pixels: Tensor) -> tuple[Tensor, int, int]:
        """[C, rows*S, cols*S] → [rows*cols, C, S, S], row by row."""
        size = self.image_size
        rows, cols = pixels.shape[1] // size, pixels.shape[2] // size
        tiles = pixels.unfold(1, size, size).unfold(2, size, size)  # [C, rows, cols, S, S]
        return tiles.permute(1, 2, 0, 3, 4).reshape(rows * cols, pixels.shape[0], size, size), rows, cols

    def _resize(self, pixels: Tensor, height: int, width: int) -> Tensor:
        """uint8 [3, h, w] → uint8 [3, height, width] with the configured filter."""
        if self.backend == "torchvision":
            return _torchvision_resize(pixels, [height, width], self.resample)
        image = Image.fromarray(pixels.permute(1, 2, 0).numpy()).resize(
            (width, height), PIL_FILTERS[self.resample]
        )
        return torch.from_numpy(np.array(image)).permute(2, 0, 1)


def _torchvision_resize(pixels: Tensor, size: list[int], resample: Resample) -> Tensor:
    """torchvision's antialiased tensor resize. Imported here, not at the top: importing torchvision takes
    ~1-2 s, which every start of train.py and generate.py would pay, while only image splitting uses it."""
    from torchvision.transforms.v2 import InterpolationMode, functional

    return functional.resize(pixels, size, interpolation=InterpolationMode[resample.upper()], antialias=True)


# tinyvlm's own: nanoVLM's BaseDataset._process_images + get_image_string, Idefics3Processor.__call__, for any
# config.
class ImageInputs:
    """A prompt's PIL images → (pixels [N_tiles, 3, S, S] in placeholder order, or None without images; each
    image's placeholder ids for `encode_prompt(..., placeholders=...)`), split or not as `processor` does it.

    `from_config` follows the model's config: split (`config.splitting.enabled`) or one square per image. The
    tokenizer is needed for placeholders only, and must then hold the marker tokens (`check_tokenizer`)."""

    def __init__(self, processor: ImageProcessor | ImageSplitter, tokens_per_image: int,
                 tokenizer: PreTrainedTokenizerBase | None = None):
        self.processor = processor
        self.tokens_per_image = tokens_per_image
        self.tokenizer = tokenizer
        self._cache: dict[tuple[int, int, int | None], list[int]] = {}

    def check_tokenizer(self) -> None:
        """TokenizerError unless the tokenizer holds every token the placeholders can use (fail before any
        batch)."""
        if self.tokenizer is None:
            raise ValueError("image placeholders need a tokenizer")
        for token in [IMAGE_TOKEN, *(self.processor.marker_tokens() if self.splits else ())]:
            token_id(self.tokenizer, token)

    @classmethod
    def from_config(cls, config: VLMConfig, tokenizer: PreTrainedTokenizerBase | None = None,
                    backend: Backend | None = None) -> ImageInputs:
        if config.splitting.enabled:
            processor = ImageSplitter.from_config(config, backend)
        else:
            processor = ImageProcessor.from_config(config.vision)
        return cls(processor, config.tokens_per_image, tokenizer)

    @property
    def image_size(self) -> int:
        """The side of one tile (of one image, unsplit): the ViT's input size."""
        return self.processor.image_size

    @property
    def splits(self) -> bool:
        return isinstance(self.processor, ImageSplitter)

    def pixels(self, images: Sequence[Image.Image]) -> Tensor | None:
        if not images:
            return None
        if not self.splits:
            return torch.stack([self.processor(image) for image in images])
        return torch.cat([self.processor(image)[0] for image in images])

    def placeholders(self, images: Sequence[Image.Image]) -> list[list[int]]:
        if self.tokenizer is None:
            raise ValueError("image placeholders need a tokenizer")
        if not self.splits:
            return [[token_id(self.tokenizer, IMAGE_TOKEN)] * self.tokens_per_image for _ in images]
        several = len(images) > 1
        return [self._placeholder(*self.processor.grid(*image.size), i if several else None)
                for i, image in enumerate(images)]

    def __call__(self, images: Sequence[Image.Image]) -> tuple[Tensor | None, list[list[int]]]:
        return self.pixels(images), self.placeholders(images)

    def _placeholder(self, rows: int, cols: int, index: int | None) -> list[int]:
        if self.processor.layout == "idefics3":
            index = None  # idefics3 numbers no images
        key = (rows, cols, index)
        if key not in self._cache:
            self._cache[key] = placeholder_ids(self.tokenizer, self.processor.layout, rows, cols,
                                               self.tokens_per_image, index)
        return list(self._cache[key])


# tinyvlm's own: the unsplit ImageProcessor behind the ImageInputs interface.
def as_image_inputs(processor: ImageProcessor | ImageInputs, tokens_per_image: int,
                    tokenizer: PreTrainedTokenizerBase | None = None) -> ImageInputs:
    """`ImageInputs` as they are; an `ImageProcessor` (one square per image) wrapped as ImageInputs."""
    return (
        processor
        if isinstance(processor, ImageInputs)
        else ImageInputs(processor, tokens_per_image, tokenizer)
    )


# The images half of ChatProcessor.encode, on its own (nanoVLM generate.py / Idefics3Processor do this
# inline).
def prepare_images(config: VLMConfig, tokenizer: PreTrainedTokenizerBase,
                   images: Sequence[Image.Image]) -> tuple[Tensor | None, list[list[int]]]:
    """The model inputs for a prompt's images, as the model's config says (split or not): pixels [N_tiles, 3,
    S, S] (None without images) and each image's placeholder ids, for `encode_prompt(...,
    placeholders=...)`."""
    return ImageInputs.from_config(config, tokenizer)(images)
