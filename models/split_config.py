"""Image splitting's and video sampling's settings, part of a VLM's config: they travel with the checkpoint,
as the model was trained with them (data/image_splitting.py does the splitting, data/video.py the
sampling)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from typed_config import Config, check

SplitLayout = Literal["idefics3", "nanovlm"]
Resample = Literal["lanczos", "bicubic", "bilinear"]


@dataclasses.dataclass
class SplitConfig(Config):
    """Image splitting (SmolVLM / Idefics3, nanoVLM): an image is resized so that its longer side is
    `max_image_size`, then up to whole multiples of the encoder's `vision.image_size`, cut into that grid of
    tiles, and shown with one extra tile-sized global (downscaled) image; each tile's tokens are marked in the
    prompt with its row and column. `layout` names whose order and marker tokens are used: "idefics3" (tiles
    row by row, then the global image; `<fake_token_around_image>`, `<row_R_col_C>`, `<global-img>`) or
    "nanovlm" (the global image, then the tiles; nanoVLM's `global_image_token` and `rRcC` tokens). Disabled:
    one square resize per image."""

    enabled: bool = False  # split images into tiles plus a global image (else one square resize)
    max_image_size: int = 1536  # the longer side an image is resized to before it is cut into tiles
    layout: SplitLayout = "idefics3"  # whose tile order and marker tokens: idefics3 or nanovlm
    resample: Resample = "lanczos"  # the resizing filter

    def __post_init__(self) -> None:
        self.check_at_least("splitting", 1, ("max_image_size",))

    def check_tile(self, tile: int) -> None:
        """ConfigError unless images of `max_image_size` cut into tiles of `tile` pixels as `layout` cuts."""
        size = self.max_image_size
        check(size >= tile,
              f"splitting.max_image_size ({size}) must be at least vision.image_size ({tile}), the size of "
              "one tile")
        check(self.layout != "nanovlm" or size % tile == 0,
              f"splitting.max_image_size ({size}) must be a multiple of vision.image_size ({tile}) for "
              "splitting.layout nanovlm (nanoVLM resizes the longer side to it, in whole tiles)")


@dataclasses.dataclass
class VideoConfig(Config):
    """Video input, SmolVLM2's `video_sampling` (data/video.py): frames sampled uniformly at `fps` per second,
    at most `max_frames`, each resized so its longer side is `max_side`, then to one square tile (no
    splitting)."""

    fps: float = 1.0  # frames sampled per second of the clip
    max_frames: int = 64  # the most frames one clip gives
    max_side: int = 512  # a frame's longer side before its square resize (SmolVLM2's video_size)

    def __post_init__(self) -> None:
        check(self.fps > 0, f"video.fps must be positive, got {self.fps}")
        self.check_at_least("video", 1, ("max_frames", "max_side"))
