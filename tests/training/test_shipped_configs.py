"""Every shipped config builds its model and trains a step, offline: backbones and tokenizers it names on the
hub or in a package are replaced by tiny local ones of the same architecture (SigLIP, Llama), and runs are
shrunk. (The fine-tuning configs, which start from a whole pretrained VLM, are trained in
test_finetune.py.)"""

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from data import make_shapes_dataset
from data.shards import write_shards
from training.config import load_run_config
from training.run import train

# a random LM's answers in the plot
pytestmark = pytest.mark.filterwarnings("ignore:Glyph .* missing from font")

# Configs that start from a whole pretrained VLM (init_from) train from stand-ins of it in test_finetune.py.
CONFIGS = sorted(path for path in (Path(__file__).parents[2] / "configs").glob("*.yaml")
                 if not load_run_config(path, {}).init_from)
# One step on little data; no torch.compile (minutes of C++ compilation on a CPU for one step) and no
# DataLoader workers (processes to start for two records), which tests/training/test_train.py and
# test_faults.py cover.
SHRUNK = {"train.max_steps": "1", "train.batch_size": "2", "train.eval_batches": "1",
          "train.eval_questions": "2", "train.compile": "false", "train.num_workers": "0",
          "train.vision_pretrain_batch_size": "2", "data.shapes.num_train": "16",
          "data.shapes.num_validation": "4", "data.video_shapes.num_train": "16",
          "data.video_shapes.num_validation": "4"}


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory) -> dict[str, str]:
    """Tiny local checkpoints: a SiglipVisionModel, a LlamaForCausalLM and a base-model tokenizer (EOS `</s>`,
    no ChatML, image or pad token: training adds them)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
        SiglipVisionConfig,
        SiglipVisionModel,
    )

    root = tmp_path_factory.mktemp("stand_ins")
    torch.manual_seed(0)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    bpe.train_from_iterator(["what colour is the circle? the circle is red"] * 10, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="</s>")
    tokenizer.save_pretrained(root / "tokenizer")
    # 32 px in 8 px patches: a 4x4 grid, which a pixel shuffle of 2 divides (nanovlm-222m's projector)
    SiglipVisionModel(SiglipVisionConfig(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1,
                                         num_attention_heads=2)).save_pretrained(root / "siglip")
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=48, intermediate_size=96,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=8192,
                                 eos_token_id=tokenizer.eos_token_id)).save_pretrained(root / "llama")
    return {"model.vision.pretrained": str(root / "siglip"), "model.language.pretrained": str(root / "llama"),
            "tokenizer": str(root / "tokenizer")}


@pytest.mark.parametrize("path", CONFIGS, ids=[path.stem for path in CONFIGS])
def test_a_shipped_config_trains_a_step(path, stand_ins, tmp_path):
    shipped = load_run_config(path, {})
    overrides = {**SHRUNK, "train.output_dir": str(tmp_path)}
    for key, value in stand_ins.items():  # only where the config names one: the others build from scratch
        if _get(shipped, key):
            overrides[key] = value
    # the_cauldron comes from the hub: the synthetic shapes in its place
    if shipped.data.source == "cauldron":
        overrides["data.source"] = "synthetic"
    if shipped.train.vision_pretrain_steps:
        overrides["train.vision_pretrain_steps"] = "1"
    if shipped.train.answer_pretrain_steps:
        overrides["train.answer_pretrain_steps"] = "1"
    config = load_run_config(path, overrides)
    if shipped.data.source == "stream":  # the hub's (or the user's) shards: the test's in their layouts
        config = dataclasses.replace(config, data=_local_streams(config.data, tmp_path / "shards"))
    metrics = train(config)
    assert metrics["step"] == 1 and math.isfinite(metrics["train_loss"]) and metrics["skipped_steps"] == 0
    assert (tmp_path / "step_000001" / "model.safetensors").is_file()


def _local_streams(data, root: Path):
    """`data`'s streams, each reading shards of 8 synthetic records (with their scene labels, for a ViT
    pre-trained on cells) written in its layout under `root`."""
    records = list(make_shapes_dataset("train", 8, seed=0, image_size=32, labels=True))
    streams = []
    for number, stream in enumerate(data.streams):
        write_shards(root / str(number), records, stream.layout, files=1, rows_per_group=1)
        streams.append(dataclasses.replace(stream, files=str(root / str(number) / "*.parquet")))
    return dataclasses.replace(data, streams=tuple(streams), holdout=2, shuffle_buffer=2)


def _get(config, key: str):
    for part in key.split("."):
        config = getattr(config, part)
    return config


def _needs_the_hub(path: Path) -> bool:
    data = load_run_config(path, {}).data
    return data.source == "cauldron" or any(stream.files.startswith("hf://") for stream in data.streams)


HUB_CONFIGS = [path for path in sorted((Path(__file__).parents[2] / "configs").glob("*.yaml"))
               if _needs_the_hub(path)]


@pytest.mark.parametrize("path", HUB_CONFIGS, ids=[path.stem for path in HUB_CONFIGS])
def test_a_hub_config_offline_stops_with_one_line(path, tmp_path, capsys):
    """Offline (HF_HUB_OFFLINE=1, tests/conftest.py), a config that needs the hub's data or weights stops with
    one line naming what the hub could not provide, exit code 2, no traceback."""
    from train import main

    assert main(["--config", str(path), "--train.output_dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: ") and ("the hub could not provide it" in err or "offline mode" in err)
