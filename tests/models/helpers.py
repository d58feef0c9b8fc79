"""Small random models for tests: reference checkpoints built with transformers (and in nanoVLM's published
format), and a tiny VLM of ours."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_model
from torch import nn

from models import LanguageConfig, VisionConfig, VisionLanguageModel, VLMConfig
from models.fused_linear import fuse_projections
from models.quantize import int8_matmul_exact

# Triton kernels on CPU tensors run in Triton's interpreter, which tests/conftest.py turns on where there is
# no GPU.
TRITON_ON_CPU = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                   reason="Triton on CPU tensors needs TRITON_INTERPRET=1 (on a GPU machine "
                                          "the kernel is tested in tests/serving/test_gpu.py)")


def save_tiny_llama(directory: Path, tie: bool, vocab_size: int = 128, seed: int = 0):
    """A random GQA LlamaForCausalLM saved as a Hugging Face checkpoint; returns the transformers model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256,
                         rope_theta=5000.0, rms_norm_eps=1e-5, tie_word_embeddings=tie, eos_token_id=3)
    model = LlamaForCausalLM(config).eval()
    # bigger weights than the default init, so outputs vary strongly from token to token
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    model.save_pretrained(directory)
    return model


def fused_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` (a VisionLanguageModel, LanguageModel or VisionTransformer) with its projections
    fused for inference (models/fused_linear.py)."""
    fused = copy.deepcopy(model)
    fuse_projections(fused)
    return fused


def tiny_vlm_config(**language) -> VLMConfig:
    lang = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4,
                num_kv_heads=2, max_position_embeddings=128, eos_token_id=2)
    return VLMConfig(
        vision=VisionConfig(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64, num_layers=2,
                            num_heads=4),
        language=LanguageConfig(**{**lang, **language}),
        image_token_id=95,
    )


def tiny_vlm(seed: int = 0, **language) -> VisionLanguageModel:
    """A random tiny VLM whose weights are large enough that greedy decoding wanders through the
    vocabulary."""
    torch.manual_seed(seed)
    model = VisionLanguageModel(tiny_vlm_config(**language)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    return model


def base_tokenizer():
    """A base-model tokenizer: its EOS is `</s>`; prepare_tokenizer adds the ChatML, image and pad tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from data import prepare_tokenizer

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(["what colour is the sky? blue, the sky is blue"] * 10, trainer)
    return prepare_tokenizer(PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="</s>"))


def chat_vlm(tokenizer, seed: int = 5, **language) -> VisionLanguageModel:
    """A random tiny VLM for `tokenizer` (its image token, and stop tokens <|im_end|> and EOS), context
    512."""
    from data import IMAGE_TOKEN, stop_token_ids, token_id

    model = tiny_vlm(seed=seed, vocab_size=len(tokenizer), max_position_embeddings=512, **language)
    model.config = model.config.replace({"image_token_id": token_id(tokenizer, IMAGE_TOKEN),
                                         "stop_token_ids": stop_token_ids(tokenizer)})
    return model


IDEFICS3_TOKENS = ["<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>",
                   *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7))]
# SmolVLM-Instruct's chat template: "User:<image>question<end_of_utterance>\nAssistant:".
SMOLVLM_CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def save_tiny_idefics3(directory: Path, seed: int = 0, tie: bool = False, split: bool = True):
    """A random Idefics3ForConditionalGeneration (SmolVLM's layout, tiny: 32 px tiles of 4 tokens, images
    split up to 96 px) with its processor (tokenizer, image processor, chat template), saved as a transformers
    checkpoint; returns the transformers model and processor."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessor,
        Idefics3Processor,
        PreTrainedTokenizerFast,
    )

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300,
                                  special_tokens=["<|endoftext|>", "<|im_start|>", *IDEFICS3_TOKENS],
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(["User: what colour is the sky? Assistant: blue, the sky is blue"] * 10, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<end_of_utterance>",
                                        bos_token="<|im_start|>", pad_token="<|endoftext|>")
    image_processor = Idefics3ImageProcessor(do_image_splitting=split, size={"longest_edge": 96},
                                             max_image_size={"longest_edge": 32})
    processor = Idefics3Processor(image_processor, tokenizer, image_seq_len=4,
                                  chat_template=SMOLVLM_CHAT_TEMPLATE)
    torch.manual_seed(seed)
    config = Idefics3Config(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=32, patch_size=8),
        text_config=dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                         max_position_embeddings=512, rope_theta=5000.0, rms_norm_eps=1e-5,
                         eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=tie),
        scale_factor=2, image_token_id=tokenizer.convert_tokens_to_ids("<image>"), tie_word_embeddings=tie)
    model = Idefics3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # larger than the default init, so greedy decoding wanders through the vocabulary
        for name, p in model.named_parameters():
            if p.dim() > 1 and "embeddings" not in name:
                p.normal_(0, 0.2)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return model, processor


# nanoVLM's published format (models/nanovlm.py): config.json and model.safetensors as nanoVLM writes them.
CHAT_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
                 "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ "
                 "'<|im_start|>assistant\n' }}{% endif %}")
# nanoVLM's extra tokens: the image placeholder, the global-image marker, and a marker per tile of an 8x8
# grid.
EXTRA_TOKENS = {"image_token": "<|image|>", "global_image_token": "<|global_image|>",
                **{f"r{r}c{c}": f"<row_{r}_col_{c}>" for r in range(1, 9) for c in range(1, 9)}}
BASE_VOCAB = 100


def nanovlm_config(**fields) -> dict:
    """config.json as nanoVLM writes it (`json.dumps(asdict(cfg))`): every field of its VLMConfig, in order,
    with its defaults (huggingface/nanoVLM models/config.py), then `fields`."""
    config = {
        "vit_hidden_dim": 768, "vit_inter_dim": 3072, "vit_patch_size": 16, "vit_img_size": 512,
        "vit_n_heads": 12, "vit_dropout": 0.0, "vit_n_blocks": 12, "vit_ln_eps": 1e-6, "vit_cls_flag": False,
        "vit_model_type": "google/siglip2-base-patch16-512",
        "lm_hidden_dim": 960, "lm_inter_dim": 2560, "lm_rms_eps": 1e-5, "lm_re_base": 100000,
        "lm_max_position_embeddings": 8192, "lm_base_vocab_size": 49152, "extra_token_amount": 66,
        "lm_vocab_size": 49218, "lm_n_heads": 15, "lm_n_kv_heads": 5, "lm_dropout": 0.0, "lm_n_blocks": 32,
        "lm_attn_scaling": 1.0, "lm_max_length": 4096, "lm_use_tokens": False, "lm_tie_weights": True,
        "lm_model_type": "HuggingFaceTB/SmolLM2-360M-Instruct",
        "lm_tokenizer": "HuggingFaceTB/SmolLM2-360M-Instruct", "lm_chat_template": CHAT_TEMPLATE,
        "mp_pixel_shuffle_factor": 4, "mp_image_token_length": 64, "max_img_size": 2048,
        "resize_to_max_side_len": True, "vlm_extra_tokens": dict(EXTRA_TOKENS),
        "vlm_load_backbone_weights": True, "vlm_checkpoint_path": "checkpoints", "hf_repo_name": "nanoVLM",
    }
    return {**config, **fields}


def tiny_fields(tie: bool) -> dict:
    """The nanoVLM config fields of the tiny backbones below (values away from nanoVLM's defaults, so that a
    field read from the wrong place changes the logits)."""
    return dict(vit_hidden_dim=32, vit_inter_dim=64, vit_patch_size=8, vit_img_size=32, vit_n_heads=4,
                vit_n_blocks=2, vit_ln_eps=1e-3, lm_hidden_dim=64, lm_inter_dim=128, lm_rms_eps=1e-3,
                lm_re_base=5000, lm_max_position_embeddings=256, lm_base_vocab_size=BASE_VOCAB,
                lm_vocab_size=BASE_VOCAB + 66, lm_n_heads=4, lm_n_kv_heads=2, lm_n_blocks=2,
                lm_tie_weights=tie, mp_pixel_shuffle_factor=2, mp_image_token_length=4, max_img_size=64)


def save_backbones(directory: Path, tie: bool, vocab_size: int = BASE_VOCAB + 66) -> tuple[Path, Path]:
    """A random SiglipVisionModel and LlamaForCausalLM (sizes as in `tiny_fields`, the Llama's vocabulary
    `vocab_size`), saved with save_pretrained."""
    from transformers import LlamaConfig, LlamaForCausalLM, SiglipVisionConfig, SiglipVisionModel

    torch.manual_seed(1)
    siglip = SiglipVisionModel(SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32,
        patch_size=8, layer_norm_eps=1e-3, vision_use_head=False))
    llama = LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rope_theta=5000.0,
        rms_norm_eps=1e-3, tie_word_embeddings=tie))
    with torch.no_grad():  # larger than the default init, so that every weight visibly moves the logits
        for p in [*siglip.parameters(), *llama.parameters()]:
            p.normal_(0, 0.2 if p.dim() > 1 else 1.0)
    siglip.save_pretrained(directory / "siglip")
    llama.save_pretrained(directory / "llama")
    return directory / "siglip", directory / "llama"


def module_of(tensors: dict[str, torch.Tensor], buffers: tuple[str, ...] = ()) -> nn.Module:
    """An nn.Module whose state_dict has exactly these names (dotted paths become submodules)."""
    root = nn.Module()
    for name, tensor in tensors.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, nn.Module())
            module = getattr(module, part)
        if name in buffers:
            module.register_buffer(leaf, tensor)
        else:
            module.register_parameter(leaf, nn.Parameter(tensor))
    return root


def write_nanovlm(directory: Path, siglip_dir: Path, llama_dir: Path, projector: torch.Tensor,
                  config: dict) -> None:
    """The weights of these transformers checkpoints (and a projector) as nanoVLM saves them, after nanoVLM's
    own backbone loaders (ViT.from_pretrained, LanguageModel.from_pretrained) have named them: q, k, v
    concatenated into `qkv_proj`, the position embedding as [1, N, C], RoPE's inv_freq buffer, a tied head
    shared with the token embedding; written by `safetensors.torch.save_model(model)` and
    `json.dumps(asdict(cfg), indent=4)`."""
    vit = {k.removeprefix("vision_model."): v for k, v in load_file(siglip_dir / "model.safetensors").items()}
    lm = load_file(llama_dir / "model.safetensors")
    sd = {
        "vision_encoder.patch_embedding.conv.weight": vit["embeddings.patch_embedding.weight"],
        "vision_encoder.patch_embedding.conv.bias": vit["embeddings.patch_embedding.bias"],
        "vision_encoder.patch_embedding.position_embedding": vit["embeddings.position_embedding.weight"][
            None
        ],
    }
    for i in range(config["vit_n_blocks"]):
        hf, ours = f"encoder.layers.{i}.", f"vision_encoder.blocks.{i}."
        for part in ("weight", "bias"):
            sd[f"{ours}ln1.{part}"] = vit[f"{hf}layer_norm1.{part}"]
            sd[f"{ours}attn.qkv_proj.{part}"] = torch.cat(
                [vit[f"{hf}self_attn.{p}_proj.{part}"] for p in "qkv"], 0
            )
            sd[f"{ours}attn.out_proj.{part}"] = vit[f"{hf}self_attn.out_proj.{part}"]
            sd[f"{ours}ln2.{part}"] = vit[f"{hf}layer_norm2.{part}"]
            sd[f"{ours}mlp.fc1.{part}"] = vit[f"{hf}mlp.fc1.{part}"]
            sd[f"{ours}mlp.fc2.{part}"] = vit[f"{hf}mlp.fc2.{part}"]
    sd["vision_encoder.layer_norm.weight"] = vit["post_layernorm.weight"]
    sd["vision_encoder.layer_norm.bias"] = vit["post_layernorm.bias"]
    sd["MP.proj.weight"] = projector
    sd["decoder.token_embedding.weight"] = lm["model.embed_tokens.weight"]
    head_dim = config["lm_hidden_dim"] // config["lm_n_heads"]
    sd["decoder.rotary_embd.inv_freq"] = 1.0 / (config["lm_re_base"] ** (torch.arange(0, head_dim, 2).float()
                                                                         / head_dim))
    for i in range(config["lm_n_blocks"]):
        hf, ours = f"model.layers.{i}.", f"decoder.blocks.{i}."
        for p in ("q", "k", "v"):
            sd[f"{ours}attn.{p}_proj.weight"] = lm[f"{hf}self_attn.{p}_proj.weight"]
        sd[f"{ours}attn.out_proj.weight"] = lm[f"{hf}self_attn.o_proj.weight"]
        for p in ("gate", "up", "down"):
            sd[f"{ours}mlp.{p}_proj.weight"] = lm[f"{hf}mlp.{p}_proj.weight"]
        sd[f"{ours}norm1.weight"] = lm[f"{hf}input_layernorm.weight"]
        sd[f"{ours}norm2.weight"] = lm[f"{hf}post_attention_layernorm.weight"]
    sd["decoder.norm.weight"] = lm["model.norm.weight"]
    sd["decoder.head.weight"] = lm.get("lm_head.weight", lm["model.embed_tokens.weight"])
    model = module_of({k: v.clone() for k, v in sd.items()}, buffers=("decoder.rotary_embd.inv_freq",))
    if config["lm_tie_weights"]:  # nanoVLM: self.head.weight = self.token_embedding.weight
        model.decoder.head.weight = model.decoder.token_embedding.weight
    directory.mkdir(parents=True, exist_ok=True)
    save_model(model, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config, indent=4))


def base_tokenizer_dir(directory: Path,
                       specials: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")):
    """A small BPE tokenizer laid out like SmolLM2-Instruct's: <|endoftext|>, <|im_start|>, <|im_end|> at ids
    0-2, EOS <|im_end|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=list(specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(["what colour is the sky? blue, the sky is blue"] * 10, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>",
                                        bos_token="<|im_start|>")
    tokenizer.save_pretrained(directory)
    return len(tokenizer)


# int8-dynamic as a test parameter: refused on an x86 CPU without AVX512-VNNI (models/quantize.py), so its
# cases skip there
INT8_DYNAMIC = pytest.param("int8-dynamic", marks=pytest.mark.skipif(
    not int8_matmul_exact(), reason="int8-dynamic needs AVX512-VNNI on an x86 CPU"))
