"""Video clips as SmolVLM2 feeds them: frames sampled uniformly under a frame rate and a frame cap, with their
timestamps and the clip's duration, exactly as transformers' SmolVLM video processor samples them
(`SmolVLMVideoProcessor.sample_frames` over PyAV's metadata: same indices, timestamps and duration).

    clip = read_video("clip.mp4", VideoConfig(fps=1, max_frames=64, max_side=512))
    clip.frames      # RGB PIL images, one per sampled frame
    clip.timestamps  # seconds, one per frame; clip.duration: the clip's length in seconds
    text = video_prompt(clip, frame_text)  # SmolVLM2's words around each frame's placeholders

Only the sampled frames are decoded: the decoder seeks to the keyframe before a frame that lies further than a
second ahead rather than decoding everything in between, and a frame larger than `max_side` is scaled down as
it is decoded (the first of SmolVLM's two resizes, done as SmolVLM does it), so a long 4K clip costs one full
frame and `max_frames` small images of memory.

The decoder is PyAV (`av`): its wheels ship their own FFmpeg libraries, so `pip install av` is all a fresh
machine needs. torchcodec (transformers' default video backend) needs the system's FFmpeg installed beside it.
"""

from __future__ import annotations

import dataclasses
import time
from datetime import timedelta
from fractions import Fraction
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from PIL import Image

from data.images import MAX_IMAGE_PIXELS
from models.errors import TinyVLMError
from models.split_config import VideoConfig

SKIP_SECONDS = 1  # SmolVLM skips this much of a long clip's start and end (`sample_frames`' skip_secs)


class VideoError(TinyVLMError, ValueError):
    """A clip that cannot be read: missing, not a video, empty, truncated or corrupt."""


@dataclasses.dataclass(frozen=True)
class Clip:
    """The sampled frames of a clip, where they lie in it, and the clip's length."""

    frames: list[Image.Image]
    indices: list[int]  # the frames' positions among the clip's frames
    timestamps: list[float]  # seconds from the start, one per frame
    duration: float  # seconds: the clip's frame count over its frame rate


def sample_indices(total_frames: int, source_fps: float, duration: float, fps: float,
                   max_frames: int) -> list[int]:
    """SmolVLM's uniform sampling: round(fps * duration) frames, at most `max_frames` and at least one, spread
    evenly over the clip; a clip long enough to spare them loses its first and last second."""
    desired = max(1, min(int(round(fps * duration)), max_frames))
    start, end = 0, total_frames - 1
    if duration - 2 * SKIP_SECONDS > max_frames * fps:
        start = int(SKIP_SECONDS * source_fps)
        end = min(int(total_frames - SKIP_SECONDS * source_fps), total_frames - 1)
    if start >= end:
        start, end = 0, total_frames - 1
    return np.unique(np.linspace(start, end, desired, dtype=int)).tolist()


def scaled_size(width: int, height: int, max_side: int) -> tuple[int, int]:
    """(width, height) with the longer side `max_side` and the shorter one rounded up to even, as SmolVLM's
    video processor resizes."""
    if width >= height:
        width, height = max_side, int(max_side / (width / height))
        height += height % 2
    else:
        width, height = int(max_side * (width / height)), max_side
        width += width % 2
    return max(width, 1), max(height, 1)


def read_video(source: str | Path | BinaryIO, config: VideoConfig, max_pixels: int = MAX_IMAGE_PIXELS,
               max_seconds: float | None = None) -> Clip:
    """The frames that `config` samples (see the module docstring) of the clip at a path or in a binary file
    object (named in errors by its `name`), or a one-line VideoError; a clip whose frames are larger than
    `max_pixels` is refused before any is decoded (as `load_image` refuses such an image), and one whose
    sampled frames take longer than `max_seconds` to decode (a long clip with few keyframes) when it is
    reached."""
    import av

    if isinstance(source, (str, Path)):
        path = Path(source)
        if not path.is_file():
            raise VideoError(f"{path}: no such file")
        source = str(path)
    else:
        path = getattr(source, "name", "<file object>")
    try:
        with av.open(source) as container:
            if container.format.name == "image2" or container.format.name.endswith("_pipe"):
                raise VideoError(f"{path}: an image ({container.format.name}), not a video")
            stream = container.streams.video[0] if container.streams.video else None
            rate = stream and (stream.average_rate or stream.guessed_rate)
            if not stream or not stream.frames or not rate:
                raise VideoError(f"{path}: the clip holds no video frames")
            if stream.width * stream.height > max_pixels:
                raise VideoError(f"{path}: frames of {stream.width} x {stream.height}, more than "
                                 f"{max_pixels} pixels")
            duration = float(Fraction(stream.frames) / rate)
            indices = sample_indices(stream.frames, float(rate), duration, config.fps, config.max_frames)
            deadline = None if max_seconds is None else time.monotonic() + max_seconds
            frames = _decode(container, stream, indices, float(rate), config.max_side, path, deadline)
    except av.FFmpegError as e:
        raise VideoError(f"{path}: not a readable video ({e.strerror or type(e).__name__})") from None
    return Clip(frames, indices, [index / float(rate) for index in indices], duration)


def _decode(container, stream, indices: list[int], rate: float, max_side: int, path: Path | str,
            deadline: float | None) -> list[Image.Image]:
    """The frames at `indices` (increasing), seeking to the keyframe before each one more than a second past
    the last decoded frame; VideoError once the clock passes `deadline`."""
    start = stream.start_time or 0
    position, decoded, frames = None, iter(()), []
    for target in indices:
        if position is None or target - position > rate:
            container.seek(start + int(target / rate / stream.time_base), stream=stream)
            decoded = container.decode(stream)
        for frame in decoded:
            if deadline is not None and time.monotonic() > deadline:
                raise VideoError(f"{path}: decoding its frames took too long (a long clip with few "
                                 "keyframes?): sample fewer frames or cut the clip")
            position = round((frame.pts - start) * stream.time_base * rate)
            if position >= target:
                frames.append(_to_image(frame, max_side))
                break
        else:
            raise VideoError(f"{path}: the clip ends before frame {target} of {stream.frames} (truncated?)")
    return frames


def _to_image(frame, max_side: int) -> Image.Image:
    """An RGB image of `frame`, scaled down to `max_side` on its longer side if larger, the way SmolVLM's
    video processor resizes (torchvision, Lanczos, antialiased), one frame at a time."""
    if max(frame.width, frame.height) <= max_side:
        return frame.to_image()
    from torchvision.transforms.v2 import InterpolationMode
    from torchvision.transforms.v2.functional import resize

    width, height = scaled_size(frame.width, frame.height, max_side)
    pixels = torch.from_numpy(frame.to_ndarray(format="rgb24")).permute(2, 0, 1)
    scaled = resize(pixels, [height, width], interpolation=InterpolationMode.LANCZOS, antialias=True)
    return Image.fromarray(scaled.permute(1, 2, 0).numpy())


def video_sampling(config: VideoConfig, fps: float | None, max_frames: int | None) -> VideoConfig:
    """A model's clip sampling (its `config.video`) with `fps` / `max_frames` in its place where given
    (generate.py's --fps / --max-frames, a batch line's or a training record's); ConfigError for values it
    cannot take."""
    overrides = {"fps": fps, "max_frames": max_frames}
    return config.replace({key: value for key, value in overrides.items() if value is not None})


def write_video(clip: Clip, path: str | Path, fps: float) -> Path:
    """The clip's frames as an MP4 file at `fps` frames a second, losslessly (H.264 in RGB, `libx264rgb`
    at crf 0): `read_video` gives back the very pixels."""
    import av

    width, height = clip.frames[0].size
    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264rgb", rate=Fraction(fps).limit_denominator(1000),
                                options={"crf": "0", "preset": "ultrafast"})
        stream.width, stream.height, stream.pix_fmt = width, height, "rgb24"
        for frame in clip.frames:
            out.mux(stream.encode(av.VideoFrame.from_image(frame.convert("RGB"))))
        out.mux(stream.encode())
    return Path(path)


def video_wording(config: VideoConfig) -> str:
    """`video_prompt`'s words (no frames) for the longest clip `config` samples at its own rate: a tokenizer
    trained on the records' texts learns them too."""
    count = config.max_frames
    blank = Image.new("RGB", (1, 1))
    return video_prompt(Clip([blank] * count, list(range(count)), [i / config.fps for i in range(count)],
                             count / config.fps), "")


def video_prompt(clip: Clip, frame_text: str) -> str:
    """SmolVLM2's text for a clip (transformers' `SmolVLMProcessor.replace_video_token`): the frame count in
    words and the duration, then each frame's `frame_text` (its image placeholders) after its MM:SS
    timestamp."""
    from num2words import num2words

    text = (f"You are provided the following series of {num2words(len(clip.frames))} frames from a "
            f"{timedelta(seconds=int(clip.duration))} [H:MM:SS] video.\n")
    for second in clip.timestamps:
        text += f"\nFrame from {int(second // 60):02d}:{int(second % 60):02d}:" + frame_text
    return text + "\n\n"
