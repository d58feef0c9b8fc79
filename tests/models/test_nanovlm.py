"""nanoVLM's published format (models/nanovlm.py), offline: tiny random SigLIP and Llama backbones, loaded
through tinyvlm's SigLIP / Llama paths, are written again as a nanoVLM checkpoint by a writer that follows
nanoVLM's own code (its VLMConfig fields, its backbone loaders' weight names, its fused q/k/v, safetensors'
`save_model`), and loading that checkpoint must give the same logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from models import (
    CheckpointError,
    LanguageConfig,
    ProjectorConfig,
    VisionConfig,
    VisionLanguageModel,
    VLMConfig,
)
from models.nanovlm import config_from_nanovlm, nanovlm_tokenizer
from tests.models.helpers import (
    BASE_VOCAB,
    CHAT_TEMPLATE,
    EXTRA_TOKENS,
    base_tokenizer_dir,
    fused_copy,
    nanovlm_config,
    save_backbones,
    tiny_fields,
    write_nanovlm,
)

IMAGE, GLOBAL, R1C1, R1C2 = BASE_VOCAB, BASE_VOCAB + 1, BASE_VOCAB + 2, BASE_VOCAB + 3


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def checkpoints(request, tmp_path_factory):
    """(the model built from the backbones by tinyvlm, the nanoVLM checkpoint directory of the same
    weights)."""
    tie = request.param
    root = tmp_path_factory.mktemp("tied" if tie else "untied")
    siglip_dir, llama_dir = save_backbones(root, tie)
    reference = VisionLanguageModel.from_backbones(VLMConfig(
        vision=VisionConfig(pretrained=str(siglip_dir)), language=LanguageConfig(pretrained=str(llama_dir)),
        projector=ProjectorConfig(pixel_shuffle_factor=2), image_token_id=IMAGE)).eval()
    with torch.no_grad():
        reference.projector.proj.weight.normal_(0, 0.2)
    write_nanovlm(root / "nano", siglip_dir, llama_dir, reference.projector.proj.weight.detach(),
                  nanovlm_config(**tiny_fields(tie)))
    return reference, root / "nano"


def prompt() -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows with image tokens among text: a 1x2 grid (global image, then tiles r1c1 and r1c2), and a 1x1
    grid (the global image only); four images in all, in placeholder order."""
    image = [IMAGE] * 4
    first = [5, 17, GLOBAL, *image, R1C1, *image, R1C2, *image, 42, 7, 99, 3]
    second = [8, GLOBAL, *image, *range(20, 20 + len(first) - 6)]
    torch.manual_seed(2)
    return torch.tensor([first, second]), torch.rand(4, 3, 32, 32)


def rewrite(directory: Path, change) -> None:
    weights = load_file(directory / "model.safetensors")
    change(weights)
    save_file(weights, directory / "model.safetensors")


def copy_checkpoint(source: Path, target: Path, **fields) -> Path:
    target.mkdir()
    (target / "model.safetensors").write_bytes((source / "model.safetensors").read_bytes())
    config = {**json.loads((source / "config.json").read_text()), **fields}
    (target / "config.json").write_text(json.dumps(config))
    return target


def test_logits_match_the_backbones(checkpoints):
    reference, nano = checkpoints
    tied = json.loads((nano / "config.json").read_text())["lm_tie_weights"]
    stored = set(load_file(nano / "model.safetensors"))
    # save_model keeps one name of the shared tensor, the first in sorted order.
    assert ("decoder.token_embedding.weight" in stored) == (not tied) and "decoder.head.weight" in stored
    model = VisionLanguageModel.from_pretrained(nano).eval()
    ids, images = prompt()
    with torch.no_grad():
        expected, _ = reference(ids, images)
        actual, _ = model(ids, images)
        actual_fused, _ = fused_copy(model)(ids, images)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(actual_fused, expected, atol=1e-5, rtol=0)
    assert model.language.head.weight is model.language.token_embedding.weight if tied else \
        not torch.equal(model.language.head.weight, model.language.token_embedding.weight)


def test_config_fields_are_mapped(checkpoints):
    _, nano = checkpoints
    hf = json.loads((nano / "config.json").read_text())
    config = VisionLanguageModel.from_pretrained(nano).config
    v, lang, s = config.vision, config.language, config.splitting
    assert (v.image_size, v.patch_size, v.hidden_size, v.intermediate_size, v.num_layers, v.num_heads,
            v.num_channels, v.layer_norm_eps) == (32, 8, 32, 64, 2, 4, 3, 1e-3)
    assert (v.image_mean, v.image_std) == ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0))  # nanoVLM does not normalise
    assert (lang.vocab_size, lang.hidden_size, lang.intermediate_size, lang.num_layers, lang.num_heads,
            lang.num_kv_heads, lang.max_position_embeddings, lang.rope_theta, lang.rms_norm_eps,
            lang.tie_word_embeddings) == (166, 64, 128, 2, 4, 2, 256, 5000.0, 1e-3, hf["lm_tie_weights"])
    assert (config.projector.pixel_shuffle_factor, config.projector.position_embedding) == (2, False)
    assert config.tokens_per_image == hf["mp_image_token_length"] == 4
    assert (s.enabled, s.max_image_size, s.layout, s.resample) == (True, 64, "nanovlm", "bicubic")
    assert (config.image_token_id, config.image_position) == (IMAGE, "before_text")
    # SmolLM2-360M-Instruct: EOS and end of turn are both <|im_end|>, id 2.
    assert (config.stop_token_ids, lang.eos_token_id) == ((2,), 2)


def test_nanovlm_defaults_map_to_the_460m_shape():
    config = config_from_nanovlm(nanovlm_config())
    assert (config.vision.image_size, config.vision.grid_size, config.tokens_per_image) == (512, 32, 64)
    assert (config.language.vocab_size, config.image_token_id) == (49218, 49152)
    assert (config.language.num_layers, config.language.hidden_size,
            config.language.rope_theta) == (32, 960, 1e5)
    assert (config.splitting.enabled, config.splitting.max_image_size) == (True, 2048)


def test_configs_before_splitting_resize_one_square_image():
    """June 2025 configs (nanoVLM-450M): only <|image|> added, no max_img_size, no chat template (the prompt
    was 'Question: ... Answer:'); a base (non-Instruct) tokenizer stops at <|endoftext|>, id 0."""
    old = nanovlm_config(lm_vocab_size=49153, extra_token_amount=1,
                         vlm_extra_tokens={"image_token": "<|image|>"}, vit_img_size=256,
                         mp_pixel_shuffle_factor=2, lm_tokenizer="HuggingFaceTB/cosmo2-tokenizer")
    for field in ("max_img_size", "resize_to_max_side_len", "lm_chat_template"):
        del old[field]
    config = config_from_nanovlm(old)
    assert (config.splitting.enabled, config.splitting.resample,
            config.tokens_per_image) == (False, "bilinear", 64)
    assert (config.image_token_id, config.language.vocab_size, config.stop_token_ids) == (49152, 49153, (0,))
    # With ChatML on a base tokenizer, both the end of turn and the EOS end an answer; an unknown tokenizer:
    # none.
    assert config_from_nanovlm({**old, "lm_chat_template": CHAT_TEMPLATE}).stop_token_ids == (2, 0)
    assert config_from_nanovlm({**old, "lm_tokenizer": "someone/else"}).stop_ids == []


v01 = nanovlm_config()
for _field in ("vlm_extra_tokens", "lm_base_vocab_size", "extra_token_amount", "mp_image_token_length"):
    del v01[_field]


@pytest.mark.parametrize("fields, named", [
    (dict(vit_cls_flag=True), "vit_cls_flag true"),
    (dict(lm_attn_scaling=0.5), "lm_attn_scaling 0.5"),
    (dict(resize_to_max_side_len=False), "resize_to_max_side_len false"),
    (dict(max_img_size=1000), "max_img_size 1000"),
    (dict(mp_image_token_length=256), "mp_image_token_length 256"),
    (dict(lm_vocab_size=49200), "lm_vocab_size 49200"),
    (dict(vlm_extra_tokens={k: v for k, v in EXTRA_TOKENS.items() if k != "global_image_token"}),
     "global_image_token"),
    (dict(vlm_extra_tokens={k: v for k, v in EXTRA_TOKENS.items() if k != "r4c3"}), "r4c3"),
    (dict(lm_n_kv_heads=4), "num_kv_heads"),
    (v01, "vlm_extra_tokens null"),  # nanoVLM v0.1 (nanoVLM-222M): image embeddings prepended, no image token
],
                         ids=["cls", "attn_scaling", "resize", "max_img_size", "token_length", "vocab",
                              "no_global", "no_tile_token", "heads", "v0.1"])
def test_unsupported_configs_are_refused_in_one_line(fields, named):
    with pytest.raises(CheckpointError) as error:
        config_from_nanovlm(fields if fields is v01 else nanovlm_config(**fields))
    assert named in str(error.value) and "\n" not in str(error.value)


def test_from_pretrained_refuses_a_cls_token(checkpoints, tmp_path):
    _, nano = checkpoints
    with pytest.raises(CheckpointError, match="^unsupported nanoVLM config: vit_cls_flag true"):
        VisionLanguageModel.from_pretrained(copy_checkpoint(nano, tmp_path / "cls", vit_cls_flag=True))


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda w: w.pop("vision_encoder.blocks.1.attn.qkv_proj.bias"),
            "missing keys: vision.blocks.1.attn.k_proj.bias",
        ),
        (
            lambda w: w.update({"MP.proj.weight": torch.zeros(64, 64)}),
            "shape mismatch (checkpoint vs model): projector.proj.weight (64, 64) vs (64, 128)",
        ),
        (
            lambda w: w.update({"vision_encoder.patch_embedding.cls_token": torch.zeros(1, 1, 32)}),
            "unexpected keys: vision_encoder.patch_embedding.cls_token",
        ),
        (
            lambda w: w.update({"decoder.rotary_embd.inv_freq": w["decoder.rotary_embd.inv_freq"] * 0.5}),
            "decoder.rotary_embd.inv_freq is not 1 / lm_re_base",
        ),
    ],
    ids=["missing", "shape", "unexpected", "rope"],
)
def test_weights_that_do_not_fit_fail_in_one_line(checkpoints, tmp_path, change, message):
    _, nano = checkpoints
    broken = copy_checkpoint(nano, tmp_path / "broken")
    rewrite(broken, change)
    with pytest.raises(CheckpointError) as error:
        VisionLanguageModel.from_pretrained(broken)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_tokenizer_adds_the_extra_tokens_as_nanovlm_does(tmp_path):
    base = base_tokenizer_dir(tmp_path / "tok")
    hf = nanovlm_config(lm_tokenizer=str(tmp_path / "tok"), lm_base_vocab_size=base, lm_vocab_size=base + 66)
    tokenizer = nanovlm_tokenizer(hf)
    assert len(tokenizer) == base + 66
    assert [tokenizer.convert_tokens_to_ids(t) for t in EXTRA_TOKENS.values()] == list(range(base, base + 66))
    assert (
        tokenizer.convert_tokens_to_ids(tokenizer.image_token)
        == config_from_nanovlm(hf).image_token_id
        == base
    )
    assert (tokenizer.global_image_token, tokenizer.r2c3) == ("<|global_image|>", "<row_2_col_3>")
    assert (
        tokenizer.chat_template == CHAT_TEMPLATE
        and tokenizer.pad_token == tokenizer.eos_token == "<|im_end|>"
    )
    text = tokenizer.apply_chat_template([{"role": "user", "content": "<|image|>hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text == "<|im_start|>user\n<|image|>hi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.encode("<|image|><|image|>", add_special_tokens=False) == [base, base]


def test_tokenizer_that_gives_other_ids_is_refused(tmp_path):
    """A base vocabulary that already holds <|image|> does not append it: the config's ids would be wrong."""
    base = base_tokenizer_dir(tmp_path / "tok", ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|image|>"))
    hf = nanovlm_config(lm_tokenizer=str(tmp_path / "tok"), lm_base_vocab_size=base, lm_vocab_size=base + 66)
    with pytest.raises(CheckpointError,
                       match=rf"<\|image\|> got id 3, but the checkpoint's embeddings expect {base}"):
        nanovlm_tokenizer(hf)


def test_tokenizer_that_cannot_be_had_fails_in_one_line():
    with pytest.raises(CheckpointError) as error:
        nanovlm_tokenizer(nanovlm_config(lm_tokenizer="no-such-owner/no-such-tokenizer"))
    assert "no-such-owner/no-such-tokenizer" in str(error.value) and "\n" not in str(error.value)
