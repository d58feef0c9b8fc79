"""SmolVLM / Idefics3 checkpoints against transformers' Idefics3ForConditionalGeneration, and the export
back."""

import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from data.chat_processors import CheckpointProcessor
from models import CheckpointError, VisionLanguageModel
from models.idefics3 import config_from_idefics3, export_idefics3
from tests.models.helpers import fused_copy, save_tiny_idefics3, tiny_vlm

QUESTION = "what colour is the sky?"


@pytest.fixture(scope="module")
def idefics3(tmp_path_factory):
    directory = tmp_path_factory.mktemp("idefics3")
    reference, processor = save_tiny_idefics3(directory)
    return directory, reference, processor


def photo(width: int, height: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8))


def reference_inputs(processor, images):
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": QUESTION}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    return processor(text=text, images=[images], return_tensors="pt")


@pytest.mark.parametrize("sizes", [[(80, 40)], [(30, 70), (40, 40)]], ids=["wide photo", "tall and square"])
def test_logits_match_transformers_on_split_images(idefics3, sizes):
    directory, reference, processor = idefics3
    images = [photo(w, h, seed=i) for i, (w, h) in enumerate(sizes)]
    ids, pixels = CheckpointProcessor.from_pretrained(directory).encode(QUESTION, images)
    inputs = reference_inputs(processor, images)
    assert ids == inputs["input_ids"][0].tolist()
    assert len(pixels) > len(images)  # split into tiles, plus a global image each
    model = VisionLanguageModel.from_pretrained(directory).eval()
    with torch.no_grad():
        expected = reference(**inputs).logits
        logits, _ = model(torch.tensor([ids]), pixels)
        fused_logits, _ = fused_copy(model)(torch.tensor([ids]), pixels)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(fused_logits, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_greedy_tokens_match_transformers_generate(idefics3, compile):
    directory, reference, processor = idefics3
    images = [photo(80, 40)]
    ids, pixels = CheckpointProcessor.from_pretrained(directory).encode(QUESTION, images)
    expected = reference.generate(**reference_inputs(processor, images), max_new_tokens=24, do_sample=False,
                                  eos_token_id=None)[0, len(ids):]
    model = VisionLanguageModel.from_pretrained(directory).eval()
    tokens = model.generate(torch.tensor([ids]), pixels, max_new_tokens=24, greedy=True, compile=compile)[0]
    assert len(set(expected.tolist())) > 5  # a wandering sequence, not one repeated token
    assert tokens.tolist() == expected.tolist()


def test_config_maps_checkpoint_fields(idefics3):
    directory, reference, _ = idefics3
    config = VisionLanguageModel.from_pretrained(directory).config
    assert config.image_token_id == reference.config.image_token_id
    assert config.projector.pixel_shuffle_factor == 2 and not config.projector.position_embedding
    assert config.tokens_per_image == 4
    splitting = config.splitting
    assert (splitting.enabled, splitting.max_image_size, splitting.layout) == (True, 96, "idefics3")
    assert list(config.stop_token_ids) == [reference.generation_config.eos_token_id]


def test_a_tied_checkpoint_loads(tmp_path):
    reference, processor = save_tiny_idefics3(tmp_path, tie=True)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    model = VisionLanguageModel.from_pretrained(tmp_path).eval()
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids)[0], reference(input_ids=ids).logits, atol=1e-4, rtol=0)


def test_a_sparse_config_takes_transformers_defaults():
    from transformers import Idefics3Config

    sparse = {"model_type": "idefics3", "scale_factor": 4, "image_token_id": 49190,
              "text_config": {"vocab_size": 49280},
              "vision_config": {"model_type": "idefics3_vision", "image_size": 512, "patch_size": 16}}
    config = config_from_idefics3(sparse)
    defaults = Idefics3Config()
    assert config.vision.hidden_size == defaults.vision_config.hidden_size
    assert config.vision.num_layers == defaults.vision_config.num_hidden_layers
    assert (config.vision.patch_size, config.tokens_per_image) == (16, 64)
    assert config.language.num_layers == defaults.text_config.num_hidden_layers
    assert config.language.hidden_size == defaults.text_config.hidden_size


@pytest.mark.parametrize(("damage", "message"), [
    ("missing", "missing keys: language.blocks.0.mlp.up_proj.weight"),
    ("misshapen", "shape mismatch (checkpoint vs model): vision.blocks.1.fc1.weight"),
    ("gelu", "unsupported SigLIP variant: hidden_act 'gelu'"),
    ("model_type", "model_type 'llava' is not supported"),
])
def test_bad_checkpoints_give_one_line_errors(idefics3, tmp_path, damage, message):
    import json
    import shutil

    directory = shutil.copytree(idefics3[0], tmp_path / "copy")
    weights = load_file(directory / "model.safetensors")
    config = json.loads((directory / "config.json").read_text())
    if damage == "missing":
        del weights["model.text_model.layers.0.mlp.up_proj.weight"]
    elif damage == "misshapen":
        weights["model.vision_model.encoder.layers.1.mlp.fc1.weight"] = torch.zeros(3, 3)
    elif damage == "gelu":
        config["vision_config"]["hidden_act"] = "gelu"
    else:
        config["model_type"] = "llava"
    save_file(weights, directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError,
                       match="^.*" + message.replace("(", r"\(").replace(")", r"\)")) as error:
        VisionLanguageModel.from_pretrained(directory)
    assert "\n" not in str(error.value)


def test_export_round_trip_matches_transformers(tmp_path):
    from transformers import AutoModelForImageTextToText

    model = tiny_vlm()
    model.save_pretrained(tmp_path / "ours")
    done = subprocess.run([sys.executable, "-m", "training.export", "--format", "idefics3",
                           str(tmp_path / "ours"), str(tmp_path / "idefics3")], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    reference = AutoModelForImageTextToText.from_pretrained(tmp_path / "idefics3").eval()
    per_image = model.config.tokens_per_image
    ids = torch.tensor([[5, 6, *[model.config.image_token_id] * (2 * per_image), 7, 8, 9]])
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(input_ids=ids, pixel_values=pixels[None]).logits
        logits, _ = model(ids, pixels)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
    generated = reference.generate(input_ids=ids, pixel_values=pixels[None], max_new_tokens=16,
                                   do_sample=False, eos_token_id=None)[0, ids.shape[1]:]
    assert model.generate(ids, pixels, max_new_tokens=16, greedy=True)[0].tolist() == generated.tolist()
    # and back: the exported directory loads here as the same model
    again = VisionLanguageModel.from_pretrained(tmp_path / "idefics3").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(ids, pixels)[0], logits, atol=0, rtol=0)
    # a model with fused projections exports the same tensors
    export_idefics3(fused_copy(model), tmp_path / "fused")
    exported = load_file(tmp_path / "idefics3" / "model.safetensors")
    from_fused = load_file(tmp_path / "fused" / "model.safetensors")
    assert exported.keys() == from_fused.keys()
    assert all(torch.equal(from_fused[name], tensor) for name, tensor in exported.items())


def test_a_model_that_does_not_fit_idefics3_is_refused_naming_the_field(tmp_path):
    model = tiny_vlm()
    model.config = model.config.replace({"projector.position_embedding": True})
    with pytest.raises(CheckpointError, match="projector.position_embedding") as error:
        export_idefics3(VisionLanguageModel(model.config), tmp_path)
    assert "\n" not in str(error.value)
    assert not any(tmp_path.iterdir())


def test_generate_py_answers_like_transformers_with_a_smolvlm_checkpoint(idefics3, tmp_path, capsys):
    import generate

    directory, reference, processor = idefics3
    images = [photo(80, 40), photo(40, 60, seed=1)]
    for i, image in enumerate(images):
        image.save(tmp_path / f"{i}.png")
    inputs = reference_inputs(processor, images)
    expected = reference.generate(**inputs, max_new_tokens=12, do_sample=False)[
        0, inputs["input_ids"].shape[1] :
    ]
    code = generate.main(["--checkpoint", str(directory), "--image", str(tmp_path / "0.png"), "--image",
                          str(tmp_path / "1.png"), "--prompt", QUESTION, "--max-new-tokens", "12", "--device",
                          "cpu"])
    assert code == 0
    assert capsys.readouterr().out.strip() == processor.decode(expected, skip_special_tokens=True).strip()


def test_images_that_overflow_the_context_are_a_one_line_error(idefics3, tmp_path, capsys):
    import generate

    photo(96, 96).save(tmp_path / "big.png")  # 9 tiles + the global image, 4 tokens each, with their markers
    code = generate.main(["--checkpoint", str(idefics3[0]), *["--image", str(tmp_path / "big.png")] * 6,
                          "--prompt", QUESTION, "--max-new-tokens", "200", "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        code == 2 and err[-1].startswith("error: prompt (") and "exceeds the context of 512 tokens" in err[-1]
    )
