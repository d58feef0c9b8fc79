"""Loading a model to use: where it is (a model directory, a run's newest checkpoint, a hub id; the newest run
under runs/), the model (any format `VisionLanguageModel.from_pretrained` reads; a LoRA adapter merged into
its base), its chat processor, and the device. Inference and training load models through here; neither needs
the other's code.

    # a run directory, a hub id, or None: the newest run
    model, processor = load_for_inference("runs/tiny", pick_device("auto"))
    ids, pixels = processor.encode("What color is the circle?", [image])

A run directory is `runs/NAME/step_NNNNNN/`, each checkpoint complete once its training_state.json is written
(training/checkpoint.py writes them).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from data.chat_processors import ChatProcessor, CheckpointProcessor
from data.tokenizer import IMAGE_TOKEN
from models.config import VLMConfig
from models.lora import ADAPTER_CONFIG, adapter_base, load_adapter, merge_adapters
from models.quantize import describe, quantize
from models.vision_language_model import VisionLanguageModel
from models.weights import CheckpointError, read_json, resolve, weight_patterns

# written last into a checkpoint: its presence marks the checkpoint complete
STATE_JSON = "training_state.json"
SHARDED = "sharded"  # an FSDP2 checkpoint's weights and optimizer state (torch.distributed.checkpoint),
                     # one file per rank
STEP_DIR = re.compile(r"^step_(\d+)$")
RUNS = Path("runs")  # where train.py puts runs by default, and where inference looks for the newest
# a checkpoint's own transformers processor
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")


def checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints under `run_dir`, lowest step first."""
    if not run_dir.is_dir():
        return []
    found = [p for p in run_dir.iterdir() if STEP_DIR.match(p.name) and (p / STATE_JSON).is_file()]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def find_checkpoint(path: Path) -> Path:
    """`path` if it is a model directory (or an adapter's), else its complete checkpoint with the highest
    step."""
    if (path / "config.json").is_file() or (path / ADAPTER_CONFIG).is_file():
        return path
    found = checkpoints(path)
    if not found:
        raise CheckpointError(f"{path}: no checkpoint here (expected config.json or step_* directories)")
    return found[-1]


def newest_checkpoint(root: Path) -> Path:
    """The highest-step checkpoint of the most recently written run under `root` (e.g. runs/).

    Runs are ordered by the newest file time among their checkpoints; within a run the step decides, since a
    copied run (`cp -r`) gets file times in copy order, not in step order."""
    runs = [
        found
        for run in (root.iterdir() if root.is_dir() else [])
        if run.is_dir() and (found := checkpoints(run))
    ]
    if not runs:
        raise CheckpointError(f"no checkpoint under {root}/: train one with `python train.py`, "
                              f"or pass --checkpoint DIR")
    newest_run = max(runs, key=lambda found: max((c / STATE_JSON).stat().st_mtime for c in found))
    return newest_run[-1]


def locate(checkpoint: str | Path | None, runs: Path = RUNS, allow_pickle: bool = False) -> Path:
    """The model directory for `checkpoint`: a model or run directory, a Hugging Face hub id (downloaded), or,
    for None, the newest checkpoint under `runs`."""
    if checkpoint is None:
        path = newest_checkpoint(runs)
        print(f"using the newest checkpoint: {path}", file=sys.stderr)
        return path
    if not Path(checkpoint).expanduser().exists():  # a hub id such as "HuggingFaceTB/SmolVLM-256M-Instruct"
        checkpoint = resolve(checkpoint, allow_patterns=weight_patterns(allow_pickle))
    return find_checkpoint(Path(checkpoint).expanduser())


def load_checkpoint(path: Path, device: torch.device, allow_pickle: bool = False):
    """Model (in eval mode, on `device`) and tokenizer (None when the checkpoint ships a whole processor) of
    the model directory `path`: tinyvlm's own, a SmolVLM / Idefics3 or a nanoVLM one."""
    from transformers import AutoTokenizer

    if (path / SHARDED).is_dir() and not (path / "model.safetensors").is_file():
        raise CheckpointError(f"{path}: a sharded (FSDP2) checkpoint; export it first: "
                              f"python -m training.export {path}")
    base = adapter_base(path)
    # a LoRA checkpoint: its base model, the adapter merged in, and its own tokenizer files
    if base is not None:
        model, tokenizer = load_checkpoint(locate(base, allow_pickle=allow_pickle), device, allow_pickle)
        load_adapter(model, path)
        merge_adapters(model).eval()
        if any((path / name).is_file() for name in PROCESSOR_FILES):
            return model, None
        return model, AutoTokenizer.from_pretrained(path) if (
            path / "tokenizer_config.json"
        ).is_file() else tokenizer
    model = VisionLanguageModel.from_pretrained(path, map_location=device, allow_pickle=allow_pickle).eval()
    if any((path / name).is_file() for name in PROCESSOR_FILES):
        return model, None
    try:
        if (path / "tokenizer_config.json").is_file() or "vit_hidden_dim" not in read_json(
            path / "config.json"
        ):
            return model, AutoTokenizer.from_pretrained(path)
        # a nanoVLM checkpoint names the hub tokenizer it was trained with
        from models.nanovlm import nanovlm_tokenizer

        return model, nanovlm_tokenizer(read_json(path / "config.json"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: no usable tokenizer ({type(e).__name__})") from None


def pick_device(name: str) -> torch.device:
    """`auto` is the GPU when there is one, else the CPU; anything else is taken as a torch device name."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def load_for_inference(checkpoint: str | Path | None, device: torch.device, allow_pickle: bool = False,
                       runs: Path = RUNS, quantization: str | None = None, quantize_vision: bool = False):
    """`load_with_processor`'s model and processor, the model's projections fused for inference
    (`VisionLanguageModel.fuse_projections`: fewer kernels a step, the same outputs and state dict), then,
    given a `quantization` ("int8", "int4", "int8-dynamic"), its language model's linears (and with
    `quantize_vision` its ViT's) quantized (models/quantize.py; an adapter is merged in before). A checkpoint
    saved quantized loads quantized: a `quantization` that is its own is already applied."""
    model, processor = load_with_processor(checkpoint, device, allow_pickle, runs)
    model.fuse_projections()
    if quantization is not None and set(describe(model).values()) != {quantization}:
        quantize(model, quantization, vision=quantize_vision)
    return model, processor


def load_with_processor(checkpoint: str | Path | None, device: torch.device, allow_pickle: bool = False,
                        runs: Path = RUNS):
    """Model (eval mode, on `device`) and its chat processor (`encode(prompt, images)`, `.tokenizer`) for a
    checkpoint: tinyvlm's own, a SmolVLM / Idefics3 or a nanoVLM one; a directory, a hub id, or None for the
    newest under `runs`."""
    path = locate(checkpoint, runs, allow_pickle)
    model, tokenizer = load_checkpoint(path, device, allow_pickle)
    # the checkpoint ships its own processor, unless it is a model of tinyvlm's exported
    if tokenizer is None:
        tokenizer = exported_tinyvlm_tokenizer(path, model.config)
        if tokenizer is None:
            return model, CheckpointProcessor.from_pretrained(path)
    return model, ChatProcessor.from_config(model.config, tokenizer)


def exported_tinyvlm_tokenizer(path: Path, config: VLMConfig) -> PreTrainedTokenizerBase | None:
    """The tokenizer of a model tinyvlm trained and exported as Idefics3 (training/export.py): Idefics3's
    files, but a tokenizer whose image token is tinyvlm's, so the model is asked in tinyvlm's ChatML. None for
    any other."""
    if not (path / "tokenizer_config.json").is_file() or config.image_token_id is None:
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    return tokenizer if tokenizer.convert_ids_to_tokens(config.image_token_id) == IMAGE_TOKEN else None
