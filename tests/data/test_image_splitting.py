"""Image splitting against its references: transformers' Idefics3 image processors (pixels, tile order, grid)
and Idefics3Processor (the prompt's token ids and string), nanoVLM's rules (resize, global image first,
get_image_string); then end to end: the config field splits images in the collator and a training step, and a
saved config with splitting makes train.py, generate.py and the serving engine split alike."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

import generate
from data import (
    IMAGE_TOKEN,
    ImageInputs,
    ImageProcessor,
    ImageSplitter,
    VQACollator,
    build_shapes_tokenizer,
    encode_conversation,
    encode_prompt,
    marker_tokens,
    placeholder_ids,
    prepare_images,
    prepare_tokenizer,
    token_id,
)
from data.image_splitting import (
    FAKE_IMAGE_TOKEN,
    IDEFICS3_GLOBAL_TOKEN,
    NANOVLM_GLOBAL_TOKEN,
    max_grid,
    tile_token,
)
from data.prompts import encode_text
from models import LanguageConfig, VisionConfig, VisionLanguageModel, VLMConfig
from models.config import ProjectorConfig
from models.split_config import SplitConfig
from serving.config import ServingConfig
from serving.engine import Engine
from serving.requests import Request, RequestError, RequestParams
from typed_config import ConfigError

TILE, LONGEST = 32, 96  # Idefics3's max_image_size.longest_edge and size.longest_edge, small
MEAN, STD = (0.9, 0.886, 0.878), (0.13, 0.15, 0.19)  # configs/tiny.yaml's, so that normalising is tested too
SIZES = [(150, 60), (60, 150), (100, 100), (20, 25), (97, 43), (33, 31), (200, 7), (7, 200), (32, 32),
         (1000, 999)]
RESAMPLE = {"lanczos": 1, "bilinear": 2, "bicubic": 3}  # PIL's codes, as transformers' `resample` takes them


def noise(width: int, height: int, seed: int = 0) -> Image.Image:
    """Random pixels: every resampling filter and every off-by-one-pixel shows."""
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def idefics3_tokenizer():
    """A byte-level BPE with Idefics3's special tokens (SmolVLM's, 4 x 4 tiles) that merges "\\n\\n" into one
    token."""
    specials = ["<|endoftext|>", "<image>", FAKE_IMAGE_TOKEN, IDEFICS3_GLOBAL_TOKEN, "<end_of_utterance>",
                *(tile_token(r, c) for r in range(1, 5) for c in range(1, 5))]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(["what colour is the sky?\n\nblue\n\n the sky is blue\n"] * 10, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<end_of_utterance>",
                                        pad_token="<|endoftext|>", extra_special_tokens=specials[1:])
    assert len(encode_text(tokenizer, "\n\n")) == 1  # so that encoding the newlines one by one would show
    return tokenizer


def idefics3_processor(backend: str, longest_edge: int = LONGEST, tile: int = TILE,
                       resample: str = "lanczos"):
    from transformers import Idefics3ImageProcessor, Idefics3ImageProcessorPil

    cls = Idefics3ImageProcessor if backend == "torchvision" else Idefics3ImageProcessorPil
    return cls(size={"longest_edge": longest_edge}, max_image_size={"longest_edge": tile},
               image_mean=list(MEAN), image_std=list(STD), resample=RESAMPLE[resample])


def test_auto_image_processor_picks_the_torchvision_idefics3_processor(tmp_path):
    from transformers import AutoImageProcessor, Idefics3ImageProcessor

    idefics3_processor("torchvision").save_pretrained(tmp_path)
    assert type(AutoImageProcessor.from_pretrained(tmp_path)) is Idefics3ImageProcessor  # torchvision >= 0.27


@pytest.mark.parametrize("backend", ["torchvision", "pil"])
@pytest.mark.parametrize("resample", ["lanczos", "bicubic"])
@pytest.mark.parametrize("size", SIZES)
def test_idefics3_pixels_equal_transformers(size, resample, backend):
    """Same tiles, same order (row by row, the global image last), same grid and the same values as
    transformers' Idefics3ImageProcessor (torchvision backend) and Idefics3ImageProcessorPil, each with our
    matching backend."""
    image = noise(*size)
    out = idefics3_processor(backend, resample=resample)(images=[[image]], return_tensors="pt",
                                                         return_row_col_info=True)
    splitter = ImageSplitter(TILE, LONGEST, "idefics3", resample, MEAN, STD, backend=backend)
    pixels, rows, cols = splitter(image)
    expected = out["pixel_values"][0]  # one image in the batch: no padding images
    assert pixels.shape == expected.shape
    assert (pixels - expected).abs().max().item() == 0.0  # exactly equal
    # transformers says 0 x 0 for unsplit
    assert (rows, cols) == (out["rows"][0][0] or 1, out["cols"][0][0] or 1)
    assert splitter.grid(*size) == (rows, cols)
    assert len(pixels) == (1 if rows * cols == 1 else rows * cols + 1)


def test_idefics3_backends_differ_and_the_default_is_torchvision():
    """The two transformers backends give different pixels (torchvision's uint8 Lanczos is not PIL's), so
    matching one exactly is a real check; the splitter follows the torchvision one unless told otherwise."""
    image = noise(60, 150)
    tv, _, _ = ImageSplitter(TILE, LONGEST, "idefics3", "lanczos", MEAN, STD)(image)
    pil, _, _ = ImageSplitter(TILE, LONGEST, "idefics3", "lanczos", MEAN, STD, backend="pil")(image)
    assert (tv - pil).abs().max() > 0.05
    expected = idefics3_processor("torchvision")(images=[[image]], return_tensors="pt")["pixel_values"][0]
    assert torch.equal(tv, expected)


@pytest.mark.parametrize("size", [(150, 60), (20, 25), (33, 31)])
def test_idefics3_image_within_one_tile_is_not_split(size):
    """longest_edge = the tile: every image is one tile (no global image), as transformers does it."""
    image = noise(*size)
    out = idefics3_processor("torchvision", longest_edge=TILE)(images=[[image]], return_tensors="pt",
                                                               return_row_col_info=True)
    pixels, rows, cols = ImageSplitter(TILE, TILE, "idefics3", "lanczos", MEAN, STD)(image)
    assert (rows, cols) == (1, 1) and (out["rows"][0][0], out["cols"][0][0]) == (0, 0)
    assert torch.equal(pixels, out["pixel_values"][0])


@pytest.mark.parametrize("size", [(50, 50), (40, 41), (41, 40), (13, 7)])
def test_idefics3_odd_longest_edge_rounds_past_it(size):
    """An odd longest edge (99) rounds the shorter side up to even (100 > 99): one more row of 33 px tiles,
    which `max_grid` (and so the marker tokens) allows for."""
    image = noise(*size)
    out = idefics3_processor("torchvision", longest_edge=99, tile=33)(images=[[image]], return_tensors="pt",
                                                                      return_row_col_info=True)
    pixels, rows, cols = ImageSplitter(33, 99, "idefics3", "lanczos", MEAN, STD)(image)
    assert (rows, cols) == (out["rows"][0][0], out["cols"][0][0])
    assert torch.equal(pixels, out["pixel_values"][0])
    assert max(rows, cols) <= max_grid("idefics3", 99, 33) == 4


def test_idefics3_caps_each_side_at_4096():
    """A longest edge past transformers' MAX_IMAGE_SIZE: both sides are scaled down to at most 4096 first."""
    image = noise(30, 20)
    out = idefics3_processor("torchvision", longest_edge=4100, tile=2048)(
        images=[[image]], return_tensors="pt", return_row_col_info=True
    )
    pixels, rows, cols = ImageSplitter(2048, 4100, "idefics3", "lanczos", MEAN, STD)(image)
    assert (rows, cols) == (out["rows"][0][0], out["cols"][0][0]) == (2, 2)
    assert torch.equal(pixels, out["pixel_values"][0])


def test_no_grid_exceeds_the_marker_tokens():
    rng = np.random.default_rng(1)
    for layout, longest, tile in [("idefics3", 99, 33), ("idefics3", 96, 32), ("idefics3", 1536, 224),
                                  ("nanovlm", 96, 32)]:
        splitter = ImageSplitter(tile, longest, layout)
        n = max_grid(layout, longest, tile)
        for width, height in rng.integers(1, 3000, (500, 2)):
            assert max(splitter.grid(int(width), int(height))) <= n


@pytest.mark.parametrize("sizes", [[(150, 60)], [(60, 150)], [(20, 25)], [(150, 60), (40, 100), (20, 20)]])
def test_idefics3_placeholders_are_the_processors_prompt(idefics3_tokenizer, sizes):
    """Our ids for the images are the ids Idefics3Processor gives "<image>" x N (it tokenizes its whole
    expanded string: "\\n\\n" is one token here), and decode to exactly its prompt string."""
    from transformers import Idefics3Processor

    images = [noise(*size, seed=i) for i, size in enumerate(sizes)]
    processor = Idefics3Processor(idefics3_processor("torchvision"), idefics3_tokenizer, image_seq_len=4)
    out = processor(text=["<image>" * len(images)], images=[images], return_row_col_info=True)
    splitter = ImageSplitter(TILE, LONGEST, "idefics3")
    ours, strings = [], []
    for image in images:
        rows, cols = splitter.grid(*image.size)
        ours += placeholder_ids(idefics3_tokenizer, "idefics3", rows, cols, 4, image_token="<image>")
        strings.append(processor.replace_image_token({"rows": [[rows if rows * cols > 1 else 0]],
                                                      "cols": [[cols if rows * cols > 1 else 0]]}, 0))
    assert ours == out["input_ids"][0]
    assert idefics3_tokenizer.decode(ours) == "".join(strings)
    if len(images) == 1 and splitter.grid(*images[0].size) != (1, 1):
        assert "\n\n<fake_token_around_image><global-img>" in strings[0]


def test_idefics3_single_tile_placeholder(idefics3_tokenizer):
    ids = placeholder_ids(idefics3_tokenizer, "idefics3", 1, 1, 3, image_token="<image>")
    assert idefics3_tokenizer.decode(ids) == "<fake_token_around_image><global-img><image><image><image>" \
                                             "<fake_token_around_image>"


# nanoVLM's rules, written out again from data/custom_transforms.py and data/images.py: DynamicResize with
# resize_to_max_side_len (long side = max, short side rounded up to whole tiles) on the PIL image, ToTensor,
# then GlobalAndSplitImages (tiles row by row, a bilinear antialiased resize of the whole first, unless
# 1 x 1).
def nanovlm_reference(
    image: Image.Image, tile: int, max_side: int, resample
) -> tuple[torch.Tensor, int, int]:
    width, height = image.size
    scale = max_side / max(width, height)
    short = max(math.ceil(min(width, height) * scale / tile) * tile, tile)
    new_width, new_height = (max_side, short) if width >= height else (short, max_side)
    x = torch.tensor(np.array(image.resize((new_width, new_height), resample)), dtype=torch.float32)
    x = x.permute(2, 0, 1) / 255
    rows, cols = new_height // tile, new_width // tile
    tiles = [x[:, r * tile:(r + 1) * tile, c * tile:(c + 1) * tile] for r in range(rows) for c in range(cols)]
    if len(tiles) > 1:
        tiles.insert(0, F.interpolate(x[None], size=(tile, tile), mode="bilinear", align_corners=False,
                                      antialias=True)[0])
    mean, std = torch.tensor(MEAN)[:, None, None], torch.tensor(STD)[:, None, None]
    return (torch.stack(tiles) - mean) / std, rows, cols


def nanovlm_image_string(grids: list[tuple[int, int]], tokens_per_image: int) -> str:
    """nanoVLM's get_image_string with its tokenizer's tokens (vlm_extra_tokens)."""
    image = IMAGE_TOKEN * tokens_per_image
    text = ""
    for index, (rows, cols) in enumerate(grids):
        text += f"<image: {index}>" if len(grids) > 1 else ""
        text += NANOVLM_GLOBAL_TOKEN + image
        if (rows, cols) != (1, 1):
            text += "".join(f"<row_{r + 1}_col_{c + 1}>" + image for r in range(rows) for c in range(cols))
    return text


@pytest.mark.parametrize("size, grid", [((150, 60), (2, 3)), ((60, 150), (3, 2)), ((100, 100), (3, 3)),
                                        ((20, 25), (3, 3)), ((200, 7), (1, 3)), ((97, 43), (2, 3))])
@pytest.mark.parametrize("resample", ["bicubic", "lanczos"])
def test_nanovlm_pixels_follow_nanovlms_rules(size, grid, resample):
    image = noise(*size)
    pixels, rows, cols = ImageSplitter(TILE, LONGEST, "nanovlm", resample, MEAN, STD)(image)
    expected, *expected_grid = nanovlm_reference(
        image, TILE, LONGEST, getattr(Image.Resampling, resample.upper())
    )
    assert (rows, cols) == tuple(expected_grid) == grid
    assert pixels.shape == expected.shape == (rows * cols + 1, 3, TILE, TILE)
    assert (pixels - expected).abs().max() < 1e-5


def test_nanovlm_one_tile_has_no_global_image():
    image = noise(50, 40)
    pixels, rows, cols = ImageSplitter(TILE, TILE, "nanovlm", "bicubic", MEAN, STD)(image)
    expected, *_ = nanovlm_reference(image, TILE, TILE, Image.Resampling.BICUBIC)
    assert (rows, cols) == (1, 1) and pixels.shape == (1, 3, TILE, TILE)
    assert (pixels - expected).abs().max() < 1e-5


def chat_tokenizer(config: VLMConfig | None = None):
    """A fresh shapes-style tokenizer (never the shared one: markers are added in place)."""
    tokenizer = build_shapes_tokenizer(["what colour is the sky?", "blue", "<image: 0>",
                                        "the sky is blue"] * 5)
    return prepare_tokenizer(tokenizer, marker_tokens(config)) if config else tokenizer


def tiny_config(layout: str = "idefics3", max_image_size: int = 48, **split) -> VLMConfig:
    """16 px tiles of 4 tokens each."""
    return VLMConfig(
        vision=VisionConfig(image_size=16, patch_size=8, hidden_size=32, intermediate_size=64, num_layers=1,
                            num_heads=2, image_mean=MEAN, image_std=STD),
        projector=ProjectorConfig(pixel_shuffle_factor=1),
        language=LanguageConfig(vocab_size=4096, hidden_size=32, intermediate_size=64, num_layers=1,
                                num_heads=4, num_kv_heads=2, max_position_embeddings=512),
        splitting=SplitConfig(enabled=True, max_image_size=max_image_size, layout=layout, **split),
    )


@pytest.mark.parametrize("sizes", [[(150, 60)], [(20, 20)], [(150, 60), (40, 100), (20, 20)]])
def test_nanovlm_placeholders_are_get_image_string(sizes):
    config = tiny_config("nanovlm", 48, resample="bicubic")
    tokenizer = chat_tokenizer(config)
    images = [noise(*size, seed=i) for i, size in enumerate(sizes)]
    pixels, placeholders = prepare_images(config, tokenizer, images)
    grids = [ImageSplitter.from_config(config).grid(*image.size) for image in images]
    string = nanovlm_image_string(grids, config.tokens_per_image)
    ids = [token for placeholder in placeholders for token in placeholder]
    assert tokenizer.decode(ids) == string
    # nanoVLM tokenizes the whole string
    assert ids == tokenizer(string, add_special_tokens=False)["input_ids"]
    assert pixels.shape[0] * config.tokens_per_image == ids.count(token_id(tokenizer, IMAGE_TOKEN))


def test_marker_tokens_and_the_config_check():
    assert marker_tokens(VLMConfig()) == []  # splitting disabled: the tokenizer gains nothing
    idefics3 = marker_tokens(tiny_config("idefics3", 48))
    assert idefics3[:2] == [FAKE_IMAGE_TOKEN, IDEFICS3_GLOBAL_TOKEN] and idefics3[-1] == tile_token(3, 3)
    assert marker_tokens(tiny_config("nanovlm", 64)) == [NANOVLM_GLOBAL_TOKEN,
                                                         *(tile_token(r, c) for r in range(1, 5)
                                                           for c in range(1, 5))]
    tokenizer = chat_tokenizer(tiny_config())
    assert all(tokenizer.convert_tokens_to_ids(t) in tokenizer.all_special_ids for t in idefics3)
    with pytest.raises(ConfigError,
                       match=r"^splitting.max_image_size \(8\) must be at least vision.image_size \(16\)"):
        tiny_config("idefics3", 8)
    with pytest.raises(ConfigError, match="must be a multiple of vision.image_size"):
        tiny_config("nanovlm", 40)
    tiny_config("idefics3", 40)  # any size for idefics3
    VLMConfig(splitting=SplitConfig(enabled=False, max_image_size=8))  # disabled: not checked
    with pytest.raises(ValueError, match="prepare_tokenizer"):
        VQACollator(chat_tokenizer(), ImageInputs.from_config(tiny_config(), chat_tokenizer()), 4, 512)


def test_disabled_splitting_is_todays_square_image():
    config = tiny_config().replace({"splitting.enabled": "false"})
    tokenizer = chat_tokenizer()
    images = [noise(150, 60), noise(20, 25, seed=1)]
    pixels, placeholders = prepare_images(config, tokenizer, images)
    processor = ImageProcessor.from_config(config.vision)
    assert torch.equal(pixels, torch.stack([processor(image) for image in images]))
    assert placeholders == [[token_id(tokenizer, IMAGE_TOKEN)] * config.tokens_per_image] * 2
    assert encode_prompt(tokenizer, "what?", image_position="after_text", placeholders=placeholders) == \
        encode_prompt(tokenizer, "what?", 2, config.tokens_per_image, "after_text")
    assert prepare_images(config, tokenizer, []) == (None, [])


def test_disabled_splitting_engine_prompts_are_todays():
    """The engine's call sites with splitting off: the prompt and pixels of before (square image,
    `<|image|>` x tokens_per_image) for PIL images; pixels come with prompts of token ids only (the processor
    makes a text prompt's pixels)."""
    model, tokenizer = split_model()
    model.config = model.config.replace({"splitting.enabled": "false"})
    engine = Engine(model.eval(), tokenizer, ServingConfig(num_blocks=64, block_size=16))
    image = noise(150, 60)
    pixels = ImageProcessor.from_config(model.config.vision)(image)[None]
    prompt = encode_prompt(tokenizer, "what?", 1, model.config.tokens_per_image, model.config.image_position)
    encoded, engine_pixels = engine._encode(Request("what?", [image]))
    assert encoded == prompt and torch.equal(engine_pixels, pixels)
    encoded, engine_pixels = engine._encode(Request(prompt, pixels))
    assert encoded == prompt and engine_pixels is pixels
    with pytest.raises(RequestError, match="a text prompt takes PIL images"):
        engine._encode(Request("what?", pixels))


def test_held_out_answers_are_asked_with_split_images(monkeypatch):
    """training/evaluate.answer with the run's ImageInputs: the prompts and tiles of the collator's split."""
    from training.evaluate import answer

    model, tokenizer = split_model()
    inputs = ImageInputs.from_config(model.config, tokenizer)
    records = [
        {"images": [noise(150, 60)], "texts": [{"user": "what colour is the sky?", "assistant": "blue"}]},
        {"images": [noise(20, 20, seed=1)], "texts": [{"user": "what?", "assistant": "blue"}]},
    ]
    seen = {}

    def generate(input_ids, images, attention_mask, **settings):
        seen.update(prompts=[row[mask.bool()].tolist() for row, mask in zip(input_ids, attention_mask)],
                    images=images)
        return torch.full((len(input_ids), 1), tokenizer.eos_token_id)

    monkeypatch.setattr(model, "generate", generate)
    answer(model, tokenizer, inputs, records, torch.device("cpu"))
    position = model.config.image_position
    assert seen["prompts"] == [encode_prompt(tokenizer, r["texts"][0]["user"], image_position=position,
                                             placeholders=inputs.placeholders(r["images"])) for r in records]
    assert torch.equal(seen["images"], torch.cat([inputs.pixels(r["images"]) for r in records]))
    assert len(seen["images"]) == 7 + 10


def split_model(layout: str = "idefics3") -> tuple[VisionLanguageModel, PreTrainedTokenizerFast]:
    config = tiny_config(layout)
    tokenizer = chat_tokenizer(config)
    config = config.replace({"language.vocab_size": len(tokenizer),
                             "language.eos_token_id": tokenizer.eos_token_id,
                             "image_token_id": token_id(tokenizer, IMAGE_TOKEN)})
    return VisionLanguageModel(config), tokenizer


@pytest.mark.parametrize("layout", ["idefics3", "nanovlm"])
def test_a_training_step_on_split_images(layout):
    """The collator splits as the config says: as many image tokens as tiles x tokens_per_image, the tiles in
    placeholder order, the markers in the ids; and the model trains on the batch."""
    model, tokenizer = split_model(layout)
    config = model.config
    images = [noise(150, 60), noise(40, 100, seed=1), noise(20, 20, seed=2)]
    records = [{"images": images[:1], "texts": [{"user": "what colour is the sky?", "assistant": "blue"}]},
               {"images": images[1:], "texts": [{"user": "what?", "assistant": "the sky is blue"}]},
               {"images": [], "texts": [{"user": "what?", "assistant": "blue"}]}]
    inputs = ImageInputs.from_config(config, tokenizer)
    batch = VQACollator(tokenizer, inputs, config.tokens_per_image, 512)(records)
    splitter = ImageSplitter.from_config(config)
    tiles = [splitter(image)[0] for image in images]
    assert [len(t) for t in tiles] == [7, 7, 10]  # 2 x 3 + 1, 3 x 2 + 1, and 3 x 3 + 1 (upscaled to 48 px)
    assert torch.equal(batch["images"], torch.cat(tiles))
    image_id = token_id(tokenizer, IMAGE_TOKEN)
    assert int((batch["input_ids"] == image_id).sum()) == len(batch["images"]) * config.tokens_per_image
    placeholders = ImageInputs.from_config(config, tokenizer).placeholders(images[1:])
    expected, _ = encode_conversation(tokenizer, records[1]["texts"], placeholders=placeholders)
    rows = [row[row != tokenizer.pad_token_id].tolist() for row in batch["input_ids"]]
    assert any(expected == row[i:i + len(expected)] for row in rows for i in range(len(row)))
    global_token = IDEFICS3_GLOBAL_TOKEN if layout == "idefics3" else NANOVLM_GLOBAL_TOKEN
    assert int((batch["input_ids"] == token_id(tokenizer, global_token)).sum()) == 3
    # as train.py does
    packed = VQACollator(tokenizer, inputs, config.tokens_per_image, 512, pack=True)(records)
    assert len(packed["input_ids"]) < len(batch["input_ids"])
    assert int((packed["input_ids"] == image_id).sum()) == len(packed["images"]) * config.tokens_per_image
    before = {name: p.detach().clone() for name, p in model.vision.named_parameters()}
    _, loss = model(**packed)
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert torch.isfinite(loss)
    assert all(not torch.equal(before[name], p) for name, p in model.vision.named_parameters() if p.dim() > 1)


def test_a_saved_split_config_makes_inference_split(tmp_path, monkeypatch, capsys):
    """From a checkpoint whose config has splitting on: prepare_images, the serving engine and generate.py all
    split the image and mark its tiles, as training did."""
    model, tokenizer = split_model("idefics3")
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded = VisionLanguageModel.from_pretrained(tmp_path).eval()
    loaded_tokenizer = PreTrainedTokenizerFast.from_pretrained(tmp_path)
    assert loaded.config.splitting.enabled
    image = noise(150, 60)
    image.save(tmp_path / "photo.png")
    pixels, placeholders = prepare_images(loaded.config, loaded_tokenizer, [image])
    assert pixels.shape == (7, 3, 16, 16)
    assert token_id(loaded_tokenizer, tile_token(2, 3)) in placeholders[0]
    prompt = encode_prompt(loaded_tokenizer, "what colour is the sky?", placeholders=placeholders)

    engine = Engine(loaded, loaded_tokenizer, ServingConfig(num_blocks=64, block_size=16))
    encoded, engine_pixels = engine._encode(Request("what colour is the sky?", [image]))
    assert encoded == prompt and torch.equal(engine_pixels, pixels)
    result = engine.generate([Request("what colour is the sky?", [image], RequestParams(max_tokens=2))])[0]
    assert result.prompt_tokens == len(prompt)
    with pytest.raises(RequestError, match="PIL images"):
        engine._encode(Request("what colour is the sky?", pixels))

    seen = {}

    def stream(self, ids, images, **settings):
        seen.update(ids=ids[0].tolist(), images=images)
        return iter(())

    monkeypatch.setattr(VisionLanguageModel, "stream", stream)
    assert generate.main(["--checkpoint", str(tmp_path), "--image", str(tmp_path / "photo.png"),
                          "--prompt", "what colour is the sky?", "--max-new-tokens", "2"]) == 0
    assert seen["ids"] == prompt
    assert torch.equal(seen["images"], prepare_images(loaded.config, loaded_tokenizer, [Image.open(tmp_path /
                                                                                                  "photo.png")])[0])


@pytest.mark.parametrize("layout", ["idefics3", "nanovlm"])
def test_train_py_trains_on_split_images_and_its_checkpoint_splits_at_generate_time(
    tmp_path, monkeypatch, layout
):
    """train.py with model.splitting on: the tokenizer gains the markers, batches hold the tiles (5 per 32 px
    shapes image) and their markers, and the checkpoint's config makes the inference entry point split the
    same way."""
    from loading import load_for_inference
    from tests.training.helpers import small_config
    from training import run

    batches = []

    class Recording(VQACollator):
        def collate(self, records):
            batch, too_long = super().collate(records)
            batches.append((batch, sum(len(r["images"]) for r in records if r)))
            return batch, too_long

    monkeypatch.setattr(run, "VQACollator", Recording)
    config = small_config(tmp_path,
                          **{"model.splitting.enabled": "true", "model.splitting.max_image_size": "64",
                             "model.splitting.layout": layout, "train.max_steps": "2",
                             "train.eval_every": "2", "train.save_every": "2", "train.eval_questions": "2"})
    metrics = run.train(config)
    assert math.isfinite(metrics["validation_loss"])
    model, processor = load_for_inference(tmp_path / "step_000002", torch.device("cpu"))
    tokenizer = processor.tokenizer
    global_id = token_id(tokenizer, IDEFICS3_GLOBAL_TOKEN if layout == "idefics3" else NANOVLM_GLOBAL_TOKEN)
    assert len(batches) >= 3  # validation and two training batches
    for batch, num_images in batches:
        assert len(batch["images"]) == 5 * num_images > 0
        assert int((batch["input_ids"] == global_id).sum()) == num_images
    assert model.config.splitting == config.model.splitting
    assert all(token in tokenizer.all_special_tokens for token in marker_tokens(model.config))
    pixels, placeholders = prepare_images(model.config, tokenizer, [noise(32, 32)])  # a shapes image's size
    assert pixels.shape == (5, 3, 32, 32)  # upscaled to 64 px: 2 x 2 tiles and the global image
    assert placeholders[0].count(token_id(tokenizer, IMAGE_TOKEN)) == 5 * model.config.tokens_per_image
