"""Clips sampled as transformers' SmolVLM video processor samples them (same indices, timestamps, duration and
pixels, over its own PyAV reader), large frames scaled down as decoded, and bad clips as one-line errors."""

from functools import partial
from pathlib import Path

import av
import numpy as np
import pytest

from data.video import VideoError, read_video
from models.split_config import VideoConfig


def write_clip(path: Path, seconds: float, rate: int = 10, size: tuple[int, int] = (64, 48),
               keyframe_every: int = 5, faststart: bool = False) -> Path:
    """An MPEG-4 clip of a red square crossing a dark frame left to right, a blue one falling (`faststart`:
    the frame index before the frames, as streamed files have it, rather than after them)."""
    width, height = size
    count = int(seconds * rate)
    with av.open(str(path), "w", options={"movflags": "faststart"} if faststart else {}) as out:
        stream = out.add_stream("mpeg4", rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.gop_size = keyframe_every
        for i in range(count):
            frame = np.full((height, width, 3), (20, 20, 60), np.uint8)
            x, y = i * (width - 8) // max(1, count - 1), i * (height - 8) // max(1, count - 1)
            frame[4:12, x:x + 8] = (255, 0, 0)
            frame[y:y + 8, 4:12] = (0, 0, 255)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return path


def transformers_sampling(path: Path, config: VideoConfig):
    from transformers import SmolVLMVideoProcessor
    from transformers.video_utils import load_video

    sampler = partial(SmolVLMVideoProcessor().sample_frames, num_frames=config.max_frames, fps=config.fps)
    return load_video(str(path), backend="pyav", sample_indices_fn=sampler)


@pytest.mark.parametrize(("seconds", "fps", "max_frames"), [
    (4, 1, 64),    # one frame a second
    (4, 3, 5),     # capped at max_frames
    (3, 30, 64),   # faster than the clip: every frame
    (12, 1, 4),    # long enough to skip the first and last second
    (12, 2, 1),    # a single frame
], ids=["1fps", "capped", "every-frame", "skip-ends", "one-frame"])
def test_sampling_matches_transformers_smolvlm(tmp_path, seconds, fps, max_frames):
    path = write_clip(tmp_path / "clip.mp4", seconds)
    config = VideoConfig(fps=fps, max_frames=max_frames)
    expected_frames, metadata = transformers_sampling(path, config)
    clip = read_video(path, config)
    assert clip.indices == [int(i) for i in metadata.frames_indices]
    assert clip.timestamps == metadata.timestamps
    assert clip.duration == metadata.duration
    # decoded after seeking to a keyframe, the frames equal transformers' (which decodes the clip through)
    assert np.array_equal(np.stack([np.asarray(frame) for frame in clip.frames]), expected_frames)


class CountingContainer:
    """av's container, counting the frames it decodes."""

    def __init__(self, container) -> None:
        self.container, self.decoded = container, 0

    def __getattr__(self, name):
        return getattr(self.container, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.container.close()

    def decode(self, *args, **kwargs):
        for frame in self.container.decode(*args, **kwargs):
            self.decoded += 1
            yield frame


def test_only_the_sampled_frames_are_decoded(tmp_path, monkeypatch):
    path = write_clip(tmp_path / "long.mp4", 60, keyframe_every=10)  # 600 frames
    opened = []
    monkeypatch.setattr(av, "open", lambda *args, open=av.open, **kwargs: opened.append(
        CountingContainer(open(*args, **kwargs))) or opened[-1])
    clip = read_video(path, VideoConfig(fps=1, max_frames=4))
    assert clip.indices == [int(i) for i in transformers_sampling(path, VideoConfig(fps=1, max_frames=4))[1]
                            .frames_indices]
    # each sampled frame costs at most the frames from the keyframe before it
    assert opened[0].decoded <= len(clip.indices) * 10


def test_large_frames_are_scaled_down_as_smolvlm_resizes_them(tmp_path):
    import torch
    from transformers import SmolVLMVideoProcessor
    from transformers.image_utils import SizeDict
    from transformers.models.smolvlm.video_processing_smolvlm import get_resize_output_image_size

    path = write_clip(tmp_path / "4k.mp4", 2, rate=1, size=(3840, 2160), keyframe_every=1)
    config = VideoConfig(fps=1, max_frames=2, max_side=512)
    clip = read_video(path, config)
    full_frames, _ = transformers_sampling(path, config)
    height, width = get_resize_output_image_size(torch.zeros(3, 2160, 3840), resolution_max_side=512)
    processor = SmolVLMVideoProcessor()  # its first resize: the longer side to the video size, Lanczos
    expected = super(SmolVLMVideoProcessor, processor).resize(
        torch.from_numpy(full_frames).permute(0, 3, 1, 2), SizeDict(height=height, width=width),
        resample=processor.resample)
    ours = torch.stack([torch.from_numpy(np.asarray(frame)) for frame in clip.frames]).permute(0, 3, 1, 2)
    assert torch.equal(ours, expected)


def test_frames_within_max_side_keep_their_size(tmp_path):
    clip = read_video(write_clip(tmp_path / "clip.mp4", 2), VideoConfig(max_side=64))
    assert {frame.size for frame in clip.frames} == {(64, 48)}


def _zero_length(path: Path) -> Path:
    with av.open(str(path), "w") as out:
        stream = out.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        out.start_encoding()
    return path


def _truncated(path: Path, faststart: bool = True) -> Path:
    write_clip(path, 4, faststart=faststart)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return path


def _corrupt(path: Path) -> Path:
    write_clip(path, 4)
    data = bytearray(path.read_bytes())
    data[100:-200] = np.random.RandomState(0).randint(0, 256, len(data) - 300, dtype=np.uint8).tobytes()
    path.write_bytes(bytes(data))
    return path


def _image(path: Path) -> Path:
    from PIL import Image

    Image.new("RGB", (32, 32), "red").save(path.with_suffix(".png"))
    return path.with_suffix(".png")


def _text(path: Path) -> Path:
    path.write_text("not a video at all\n" * 20)
    return path


@pytest.mark.parametrize(("make", "message"), [
    (_zero_length, "holds no video frames"),
    (_truncated, "the clip ends before frame"),  # its index promises frames the file lacks
    (partial(_truncated, faststart=False), "not a readable video"),  # the index, at the end, is cut off
    (_corrupt, "not a readable video"),
    (_image, "an image (png_pipe), not a video"),
    (_text, "not a readable video"),
    (lambda path: path, "no such file"),
], ids=["zero-length", "truncated", "truncated-index", "corrupt", "image", "text", "missing"])
def test_bad_clips_are_one_line_errors(tmp_path, make, message):
    path = make(tmp_path / "clip.mp4")
    with pytest.raises(VideoError) as error:
        read_video(path, VideoConfig())
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_clip_in_a_file_object_reads_as_the_same_clip_from_its_path(tmp_path):
    import io

    path = write_clip(tmp_path / "clip.mp4", 4)
    config = VideoConfig(fps=2, max_frames=5)
    source = io.BytesIO(path.read_bytes())
    source.name = "video 0"
    from_bytes, from_path = read_video(source, config), read_video(path, config)
    assert from_bytes.indices == from_path.indices and from_bytes.timestamps == from_path.timestamps
    assert np.array_equal(np.stack(from_bytes.frames), np.stack(from_path.frames))
    source = io.BytesIO(path.read_bytes()[:300])
    source.name = "video 0"
    with pytest.raises(VideoError, match="^video 0: not a readable video"):
        read_video(source, config)


def test_frames_larger_than_max_pixels_are_refused_before_decoding(tmp_path):
    path = write_clip(tmp_path / "clip.mp4", 2)  # 64 x 48
    with pytest.raises(VideoError, match=r"clip.mp4: frames of 64 x 48, more than 3000 pixels$"):
        read_video(path, VideoConfig(), max_pixels=3000)
    assert len(read_video(path, VideoConfig(), max_pixels=64 * 48).frames) == 2
