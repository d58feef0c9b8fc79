"""Image loading (every mode to RGB with the right colours; typed one-line errors) and the normalising
processor."""

import io
import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms import v2

from data import ImageLoadError, ImageProcessor, load_image
from models.config import VisionConfig

WHITE, RED, BLUE = (255, 255, 255), (255, 0, 0), (0, 0, 255)


def pixels(image) -> list[tuple[int, ...]]:
    return [tuple(int(v) for v in p) for p in np.asarray(image).reshape(-1, 3)]


def saved(tmp_path, image: Image.Image, name: str, **kwargs):
    path = tmp_path / name
    image.save(path, **kwargs)
    return path


def test_rgba_and_la_are_composited_on_white(tmp_path):
    rgba = Image.new("RGBA", (3, 1))
    rgba.putdata([(255, 0, 0, 255), (0, 0, 255, 0), (0, 0, 0, 128)])
    assert pixels(load_image(saved(tmp_path, rgba, "rgba.png"))) == [RED, WHITE, (127, 127, 127)]
    la = Image.new("LA", (2, 1))
    la.putdata([(50, 255), (0, 0)])
    assert pixels(load_image(saved(tmp_path, la, "la.png"))) == [(50, 50, 50), WHITE]


def test_palette_images_with_and_without_transparency(tmp_path):
    palette = Image.new("P", (3, 1))
    palette.putpalette([255, 0, 0, 0, 0, 255, 0, 255, 0] + [0] * (256 * 3 - 9))
    palette.putdata([0, 1, 2])
    assert pixels(load_image(saved(tmp_path, palette, "p.png"))) == [RED, BLUE, (0, 255, 0)]
    transparent = saved(tmp_path, palette, "p_transparent.png", transparency=1)
    assert pixels(load_image(transparent)) == [RED, WHITE, (0, 255, 0)]


def test_greyscale_and_cmyk(tmp_path):
    grey = Image.new("L", (1, 1), 100)
    assert pixels(load_image(saved(tmp_path, grey, "l.png"))) == [(100, 100, 100)]
    cmyk = Image.new("CMYK", (1, 1), (0, 255, 255, 0))
    assert pixels(load_image(saved(tmp_path, cmyk, "cmyk.tif"))) == [RED]


def test_sixteen_bit_greyscale_is_scaled_not_clipped(tmp_path):
    wide = Image.fromarray(np.array([[0, 257 * 128, 65535]], dtype=np.uint16))
    path = saved(tmp_path, wide, "sixteen.png")
    assert Image.open(path).mode == "I;16"
    assert pixels(load_image(path)) == [(0, 0, 0), (128, 128, 128), WHITE]
    as_i = Image.fromarray(np.array([[257 * 64]], dtype=np.int32))
    assert as_i.mode == "I" and pixels(load_image(saved(tmp_path, as_i, "i.tif"))) == [(64, 64, 64)]


def test_float_image_loads(tmp_path):
    image = Image.fromarray(np.array([[0.0, 100.0, 255.0]], dtype=np.float32))
    assert pixels(load_image(saved(tmp_path, image, "f.tif"))) == [(0, 0, 0), (100, 100, 100), WHITE]


def test_animated_gif_gives_its_first_frame(tmp_path):
    frames = [Image.new("RGB", (4, 4), colour) for colour in (RED, BLUE)]
    path = tmp_path / "anim.gif"
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=100, loop=0)
    assert Image.open(path).n_frames == 2
    assert set(pixels(load_image(path))) == {RED}


def test_file_objects_load_too():
    buffer = io.BytesIO()
    Image.new("RGB", (2, 2), BLUE).save(buffer, format="PNG")
    buffer.seek(0)
    assert set(pixels(load_image(buffer))) == {BLUE}


def png_header(width: int, height: int) -> bytes:
    """A PNG that declares the given size (with a token IDAT): enough to open, not to decode."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\0" * 16))
        + chunk(b"IEND", b"")
    )


def bad_files(tmp_path) -> dict:
    good = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(
        good, format="PNG"
    )
    contents = {
        "empty.png": b"",
        "truncated.png": good.getvalue()[: len(good.getvalue()) // 2],
        "random.png": np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8).tobytes(),
        "notes.txt": b"just some text\nwith lines\n",
        "bomb.png": png_header(100_000, 100_000),  # past Pillow's own hard limit
        "big.png": png_header(9000, 9000),  # under Pillow's limit, over ours
    }
    for name, data in contents.items():
        (tmp_path / name).write_bytes(data)
    return {"missing.png": "no such file", "empty.png": "empty", "truncated.png": "truncated",
            "random.png": "not an image", "notes.txt": "not an image", "bomb.png": "pixels",
            "big.png": "pixels", ".": "cannot read"}


def test_bad_files_raise_one_line_image_load_errors(tmp_path):
    for name, words in bad_files(tmp_path).items():
        path = tmp_path / name
        with pytest.raises(ImageLoadError, match=words) as error:
            load_image(path)
        message = str(error.value)
        assert "\n" not in message and message.startswith(str(path)), message


def test_processor_normalises_like_the_formula():
    rgb = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    mean, std = (0.48, 0.45, 0.40), (0.27, 0.26, 0.28)
    tensor = ImageProcessor(32, mean, std)(Image.fromarray(rgb))
    expected = (rgb / 255.0 - np.array(mean)) / np.array(std)
    assert tensor.dtype == torch.float32 and tensor.shape == (3, 32, 32)
    torch.testing.assert_close(tensor, torch.from_numpy(expected).permute(2, 0, 1).float(), atol=1e-5, rtol=0)


def test_processor_resizes_to_a_square_and_reads_vision_config():
    config = VisionConfig(image_size=48, patch_size=16, image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5))
    processor = ImageProcessor.from_config(config)
    tensor = processor(Image.new("RGBA", (100, 30), (0, 0, 0, 0)))  # transparent: white after compositing
    assert tensor.shape == (3, 48, 48)
    torch.testing.assert_close(tensor, torch.ones(3, 48, 48))


@pytest.mark.parametrize("size", [(32, 32), (50, 20), (7, 90)])
def test_processor_matches_torchvision_bit_for_bit(size):
    """The hand-rolled fast path returns torchvision's v2 pipeline (resize, to [0, 1], normalise) exactly."""
    mean, std = (0.9, 0.886, 0.878), (0.13, 0.15, 0.19)
    reference = v2.Compose([v2.Resize((32, 32), antialias=True), v2.ToImage(),
                            v2.ToDtype(torch.float32, scale=True), v2.Normalize(list(mean), list(std))])
    rgb = np.random.default_rng(1).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    image = Image.fromarray(rgb)
    assert torch.equal(ImageProcessor(32, mean, std)(image), reference(image))
