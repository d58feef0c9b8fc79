"""The run config (model + data + train sections) from YAML, with `--section.field VALUE` overrides from the
CLI."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Literal

import yaml

from data import DataConfig
from data.video import sample_indices
from loading import STEP_DIR, find_checkpoint
from models.config import VLMConfig
from models.lora import LANGUAGE_PROJECTIONS
from training.loss import LossWeight
from typed_config import Config, ConfigError, check

Packing = Literal["longest", "max_length", "off"]
FINE_TUNE_DIR = "runs/finetune"  # where a fine-tune over the default recipe (train.py --init_from) writes


@dataclasses.dataclass
class LoraConfig(Config):
    """Low-rank adapters (LoRA, through peft; models/lora.py) on the model a run starts from (`init_from`):
    only the adapters train, and checkpoints hold them alone in peft's format, pointing at that model."""

    rank: int = 0  # the adapters' rank (0: no adapters, the parts train whole)
    alpha: float = 16.0  # an adapter's output is scaled by alpha / rank
    dropout: float = 0.0  # dropout on an adapter's input
    # The linear layers that get adapters: a regex over full module names (language.blocks.N.attn.q_proj, ...,
    # vision.blocks.N.attn.q_proj, vision.blocks.N.fc1, projector.proj); by default the LM's attention and
    # MLP.
    target_modules: str = LANGUAGE_PROJECTIONS
    # Modules that train whole beside the adapters and are saved whole in the adapter (peft's
    # modules_to_save): a regex over full module names (projector, language.norm, ...); empty: none.
    modules_to_save: str = ""
    # QLoRA: the frozen base's block linear layers in 4-bit NF4 (bitsandbytes) under the adapters; CUDA only.
    quantize_base: bool = False

    def __post_init__(self) -> None:
        check(self.rank >= 0, f"train.lora.rank must be 0 (off) or positive, got {self.rank}")
        check(self.alpha > 0 and 0 <= self.dropout < 1,
              f"train.lora.alpha must be positive and train.lora.dropout in [0, 1), got {self.alpha}, "
              f"{self.dropout}")
        for name in ("target_modules", "modules_to_save"):
            try:
                re.compile(getattr(self, name))
            except re.error as e:
                raise ConfigError(f"train.lora.{name}: not a regular expression ({e})") from None


@dataclasses.dataclass
class TrainConfig(Config):
    output_dir: str = "runs/tiny"  # where checkpoints, metrics.json and the plots go
    # A fresh run refuses an output_dir that holds another run (a step_* checkpoint, vision_pretraining/ or
    # metrics.json); true writes into it anyway: the files this run writes replace those of the same name
    # (metrics.json, the plots, a checkpoint at a step this run saves too), the other run's other checkpoints
    # stay (a run prunes only its own).
    overwrite: bool = False
    max_steps: int = 1000  # optimizer steps
    # per rank and micro-batch: a step sees batch_size x grad_accum_steps x world_size samples
    batch_size: int = 32
    grad_accum_steps: int = 1  # micro-batches whose gradients add up to one step
    # Batches of similar lengths (characters of text, in buckets of 64) drawn from windows of 16 batches: less
    # padding, the same samples. Resume with the same global batch size (batch_size x world_size) to see the
    # same batches.
    group_by_length: bool = False
    # Several samples a row (data/packing.py; each sample keeps the logits it has alone). longest: a batch's
    # batch_size samples in as few rows as its longest sample allows (the same samples and loss as off, on
    # fewer padding tokens). max_length (data.source=stream): batch_size rows of up to max_length tokens each,
    # first-fit decreasing from a window of streamed samples, so a step sees a varying number of samples (see
    # docs/streaming.md, "Packing"). off: a row per sample. true and false (older configs) mean longest and
    # off.
    packing: Packing | bool = "longest"
    # Before step 1 of a fresh run, for a ViT that starts from scratch: pre-train it for this many steps (0
    # skips it) with `vision_pretrain_objective`: "cells" (synthetic shapes only: name each patch's shape,
    # colour and size, from the scene generator's labels, or streamed from shards that carry them, written by
    # `python -m training.write_shards`; training/vision_pretraining.py), "answers" (any source but a stream,
    # no labels: answer the training records' own questions through a one-layer reader;
    # training/answer_pretraining.py), or "auto" (cells on the synthetic shapes and on streams, answers on any
    # other source).
    vision_pretrain_steps: int = 0
    # The answers objective's own step count, in place of vision_pretrain_steps (null: that one; 0 there still
    # skips pre-training whatever the objective): it learns from one question per image where cells names
    # every patch, so it needs more steps.
    answer_pretrain_steps: int | None = None
    vision_pretrain_objective: Literal["auto", "cells", "answers"] = "auto"  # see vision_pretrain_steps
    vision_pretrain_batch_size: int = 64  # images per ViT pre-training step
    vision_pretrain_lr: float = 1e-3  # the ViT pre-training's learning rate
    lr_projector: float = 3e-3  # the projector's learning rate (0 freezes it)
    lr_vision: float = 3e-3  # the ViT's learning rate (0 freezes it)
    lr_language: float = 3e-3  # the language model's learning rate (0 freezes it)
    weight_decay: float = 0.01  # matrices only; norms, biases and embeddings' gains are not decayed
    adam_beta2: float = 0.95  # AdamW's second-moment decay
    warmup_steps: int = 50  # steps of linear learning-rate warmup
    # The cosine decay's length in steps, for a run that stops early and resumes onto the same schedule (0:
    # see min_lr_tail_fraction).
    decay_steps: int = 0
    # With decay_steps 0, the share of max_steps trained at min_lr_ratio after the cosine, which ends at the
    # step nearest max_steps x (1 - min_lr_tail_fraction): a share, so a shorter max_steps keeps the
    # schedule's shape.
    min_lr_tail_fraction: float = 0.0
    min_lr_ratio: float = 0.1  # cosine decay ends at this fraction of each learning rate
    grad_clip: float = 1.0  # 0 disables clipping
    # How a sample's n answer tokens share the loss: token (1 each), sample (1/n each: every sample, i.e.
    # every record, weighs alike, so a one-word answer as much as a 40-token caption) or square (1/sqrt(n)
    # each; see training/loss.py).
    loss_weight: LossWeight = "token"
    # a NaN/inf loss or gradient: skip that step, or stop the run
    on_nonfinite: Literal["skip", "stop"] = "skip"
    max_length: int = 256  # samples longer than this (in tokens) are skipped, never truncated
    eval_every: int = 250  # steps between validation losses
    eval_batches: int = 8  # validation-loss batches
    eval_questions: int = 600  # held-out questions scored by exact match (synthetic data)
    save_every: int = 250  # steps between checkpoints
    keep_checkpoints: int = 2  # the newest checkpoints kept (older ones are deleted)
    log_every: int = 10  # steps between log lines
    seed: int = 0  # seeds the model's initialisation and the batches' order
    device: str = "auto"  # auto: cuda if available, else cpu
    bf16: bool = True  # autocast to bfloat16 on GPU (CPU trains in float32)
    compile: bool = False  # torch.compile the training step
    # Recompute each block of the LM and the ViT in the backward pass instead of keeping its activations: the
    # same loss and gradients for less memory, for a second forward pass of each block.
    activation_checkpointing: bool = False
    # The output head and the cross-entropy a chunk of positions at a time (models/linear_cross_entropy.py):
    # the [batch, seq, vocabulary] logits are never kept for the backward pass, which computes each chunk's
    # again.
    chunked_loss: bool = False
    # Packed and padded batches attend through FlexAttention (a block mask, its fully masked tiles skipped)
    # instead of SDPA under a dense mask, which no flash kernel takes: CUDA only (FlexAttention has no
    # backward pass on a CPU) and with train.compile (uncompiled, it runs an unfused reference).
    flex_attention: bool = False
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    # Under torchrun: DDP replicas, or FSDP2 shards for models too big for one GPU.
    parallel: Literal["ddp", "fsdp"] = "ddp"
    dist_timeout: int = 600  # seconds a collective may wait for the other ranks before the job fails
    num_threads: int = 0  # CPU threads for torch (0: torch's default)
    # Processes that read, decode and collate batches while the model trains (0: the training process does it
    # between steps); the same batches in the same order either way. Workers pay off where the training
    # process waits on a GPU; on a CPU they take cores from the step (the tiny default on 2 cores: 10.7
    # steps/s with 0, 10.0 with 1).
    num_workers: int = 0
    prefetch_factor: int = 2  # batches each worker prepares ahead
    wandb: bool = False  # log to Weights & Biases
    # Read pretrained backbones' .bin weights (torch.load(weights_only=True)); safetensors otherwise.
    allow_pickle: bool = False
    wandb_project: str = "tinyvlm"  # the Weights & Biases project

    def __post_init__(self) -> None:
        if isinstance(self.packing, bool):
            self.packing = "longest" if self.packing else "off"
        self.check_at_least("train", 1,
                            ("max_steps", "batch_size", "grad_accum_steps", "max_length", "eval_every",
                             "save_every", "keep_checkpoints", "log_every", "dist_timeout",
                             "vision_pretrain_batch_size", "prefetch_factor"))
        self.check_at_least("train", 0,
                            ("lr_projector", "lr_vision", "lr_language", "weight_decay", "warmup_steps",
                             "grad_clip", "eval_batches", "eval_questions", "num_threads", "decay_steps",
                             "vision_pretrain_steps", "num_workers"))
        check(self.answer_pretrain_steps is None or self.answer_pretrain_steps >= 1,
              f"train.answer_pretrain_steps must be null or at least 1, got {self.answer_pretrain_steps}")
        check(self.vision_pretrain_lr > 0,
              f"train.vision_pretrain_lr must be positive, got {self.vision_pretrain_lr}")
        check(0 <= self.min_lr_ratio <= 1, f"train.min_lr_ratio must lie in [0, 1], got {self.min_lr_ratio}")
        check(not self.flex_attention or self.compile, "train.flex_attention needs train.compile: true "
              "(uncompiled, FlexAttention runs an unfused reference, slower than the dense mask)")
        check(0 <= self.min_lr_tail_fraction < 1,
              f"train.min_lr_tail_fraction must lie in [0, 1), got {self.min_lr_tail_fraction}")
        check(0 < self.adam_beta2 < 1, f"train.adam_beta2 must lie in (0, 1), got {self.adam_beta2}")
        check(self.decay_steps == 0 or self.decay_steps >= self.warmup_steps,
              f"train.decay_steps ({self.decay_steps}) must be 0 or at least train.warmup_steps "
              f"({self.warmup_steps})")
        check(self.max_steps <= self.warmup_steps or self.cosine_end() >= self.warmup_steps,
              f"train.min_lr_tail_fraction ({self.min_lr_tail_fraction}) ends the cosine at step "
              f"{self.cosine_end()} of train.max_steps ({self.max_steps}), before the warmup ends "
              f"(train.warmup_steps {self.warmup_steps}): lower one of them or set train.decay_steps")
        check(max(self.lr_projector, self.lr_vision, self.lr_language) > 0,
              "every learning rate is 0: nothing would train")

    def cosine_end(self) -> int:
        """The step at which the learning rate's cosine reaches min_lr_ratio (see decay_steps)."""
        return self.decay_steps or round(self.max_steps * (1 - self.min_lr_tail_fraction))


@dataclasses.dataclass
class RunConfig(Config):
    model: VLMConfig = dataclasses.field(default_factory=VLMConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    # A Hugging Face tokenizer (directory, hub id, .gguf or package://pkg/file.gguf); None trains a byte-level
    # BPE on the training texts. Image and pad tokens are added and the LM vocabulary is sized to fit.
    tokenizer: str | None = None
    # A whole pretrained VLM to fine-tune (local directory, run directory or hub id): tinyvlm's own
    # checkpoint, a SmolVLM / Idefics3 one or a nanoVLM one. Its architecture (model.*: leave the section
    # out), weights, image splitting and tokenizer (or processor and chat template) come with it, and the
    # training data is encoded the way it was trained. Like `tokenizer`, where a fresh run starts, not a model
    # field: a run resumed from its own checkpoint loads that checkpoint, never this.
    init_from: str | None = None

    def vision_pretrain_objective(self) -> Literal["cells", "answers"]:
        """The ViT pre-training objective this run uses: `train.vision_pretrain_objective`, with auto resolved
        by the data source."""
        objective = self.train.vision_pretrain_objective
        if objective == "auto":
            return "cells" if self.data.source in ("synthetic", "synthetic_video", "stream") else "answers"
        return objective

    def pretrain_steps(self) -> int:
        """The ViT's pre-training steps in this run: 0 when `train.vision_pretrain_steps` is 0, else that, or
        `train.answer_pretrain_steps` in its place where that is set and the objective is answers."""
        train_config = self.train
        answers = self.vision_pretrain_objective() == "answers"
        if train_config.vision_pretrain_steps and train_config.answer_pretrain_steps and answers:
            return train_config.answer_pretrain_steps
        return train_config.vision_pretrain_steps

    def __post_init__(self) -> None:
        if self.init_from is not None:
            start = f"init_from ({self.init_from})"
            check(bool(self.init_from.strip()),
                  "init_from: expected a checkpoint directory or hub id, got ''")
            for part in ("vision", "language"):
                pretrained = getattr(self.model, part).pretrained
                check(pretrained is None,
                      f"{start} brings the whole model: model.{part}.pretrained ({pretrained}) "
                      "must be null")
            check(self.tokenizer is None,
                  f"{start} brings its own tokenizer: tokenizer ({self.tokenizer}) must be "
                  "null")
            check(self.train.vision_pretrain_steps == 0, f"{start} brings a trained ViT: "
                  f"train.vision_pretrain_steps ({self.train.vision_pretrain_steps}) must be 0")
        check(not self.train.lora.rank or self.init_from is not None,
              "train.lora.rank: adapters go on a trained "
              "model: set init_from (a run directory, a checkpoint or a hub id)")
        check(self.train.lora.rank or not self.train.lora.quantize_base,
              "train.lora.quantize_base quantizes the base "
              "under adapters: set train.lora.rank")
        check(not self.train.lora.rank or self.train.parallel == "ddp",
              "train.lora.rank: adapters train with train.parallel=ddp (FSDP2 shards whole models)")
        check(self.train.packing != "max_length" or self.data.source == "stream",
              "train.packing=max_length packs streamed samples (data.source=stream); in memory a batch is "
              f"the sampler's batch_size records: use longest (data.source={self.data.source})")
        check(self.data.source != "stream" or not self.train.group_by_length,
              "data.source=stream: train.group_by_length reads the records in memory; set it to false")
        if self.train.vision_pretrain_steps:
            check(self.data.source != "stream" or self.vision_pretrain_objective() == "cells",
                  "data.source=stream: the ViT's answers pre-training reads the records in memory; use "
                  "train.vision_pretrain_objective cells (shards with scene labels: python -m "
                  "training.write_shards) or train.vision_pretrain_steps 0")
            check(self.data.source in ("synthetic", "synthetic_video", "stream")
                  or self.train.vision_pretrain_objective != "cells",
                  "train.vision_pretrain_objective=cells needs the scenes' labels: data.source=synthetic, or "
                  "a stream of shards that carry them; use answers (or auto) for "
                  f"data.source={self.data.source}")
            check(self.model.vision.pretrained is None,
                  "train.vision_pretrain_steps would overwrite the pretrained ViT "
                  f"{self.model.vision.pretrained}; set it to 0")
        if self.train.vision_pretrain_steps and self.vision_pretrain_objective() == "cells":
            check(self.data.source == "stream" or self.model.vision.image_size == self.data.shapes.image_size,
                  f"train.vision_pretrain_steps: model.vision.image_size ({self.model.vision.image_size}) "
                  f"must equal data.shapes.image_size ({self.data.shapes.image_size})")
            grid = self.model.vision.grid_size
            check(grid % 3 == 0,
                  f"train.vision_pretrain_steps: the patch grid ({grid}x{grid}) must split evenly into "
                  "the scenes' 3x3 cells")


        if self.data.source == "synthetic_video":
            clips, video = self.data.video_shapes, self.model.video
            frames = clips.frames
            check(sample_indices(frames, clips.fps, frames / clips.fps, video.fps, video.max_frames)
                  == list(range(frames)),
                  f"model.video (fps {video.fps}, max_frames {video.max_frames}) must sample every frame of "
                  f"data.video_shapes' clips ({frames} frames at fps {clips.fps}): set model.video.fps to "
                  f"{clips.fps} and model.video.max_frames to at least {frames}")


def check_fresh_start(config: RunConfig) -> None:
    """What a fresh run's config may not hold (a resumed run's saved config holds its model's real
    architecture): with init_from, any model field, since the architecture and image splitting come from that
    checkpoint, and an output directory holding the start (the run would write over, and prune, the
    checkpoints it starts from)."""
    if config.init_from is None:
        return
    start, output = Path(config.init_from).expanduser(), Path(config.train.output_dir).expanduser().resolve()
    checkpoint = find_checkpoint(start).resolve() if start.exists() else None
    run_dir = checkpoint.parent if checkpoint is not None and STEP_DIR.match(checkpoint.name) else None
    if checkpoint is not None and output in (checkpoint, run_dir):
        raise ConfigError(f"train.output_dir ({config.train.output_dir}) holds init_from "
                          f"({config.init_from}): give the fine-tune a directory of its own, e.g. "
                          "--train.output_dir runs/finetune")
    defaults, ours = _flat(VLMConfig().to_dict()), _flat(config.model.to_dict())
    changed = [key for key in defaults if ours[key] != defaults[key]]
    if changed:
        raise ConfigError(f"init_from ({config.init_from}) brings the model's architecture and image "
                          f"splitting: leave model.{changed[0]} out (it is set to {ours[changed[0]]!r})")


def _flat(values: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in values.items():
        flat.update(_flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return flat


def load_yaml(path: str | Path, seen: tuple[Path, ...] = ()) -> dict:
    """A YAML config's sections; one with `base: OTHER.yaml` (a path relative to it) is that config with its
    own settings in place of the base's, section by section."""
    try:
        values = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        raise ConfigError(f"{path}: not valid YAML{f' (line {where.line + 1})' if where else ''}") from None
    check(isinstance(values, dict), f"{path}: expected a mapping of sections (model, data, train, tokenizer)")
    if "base" not in values:
        return values
    base, where = values.pop("base"), Path(path).resolve()
    check(isinstance(base, str), f"{path}: base must be a config file's path, got {base!r}")
    check(where not in seen, f"{path}: its bases lead back to it")
    return _merged(load_yaml(where.parent / base, (*seen, where)), values)


def _merged(base: dict, changes: dict) -> dict:
    """`base` with `changes`: a section (mapping) merged key by key, any other value replaced."""
    merged = dict(base)
    for key, value in changes.items():
        sections = isinstance(value, dict) and isinstance(base.get(key), dict)
        merged[key] = _merged(base[key], value) if sections else value
    return merged


def parse_overrides(arguments: list[str]) -> dict[str, str]:
    """`--section.field VALUE` and `--section.field=VALUE` pairs as {"section.field": "VALUE"}."""
    overrides, i = {}, 0
    while i < len(arguments):
        argument = arguments[i]
        check(argument.startswith("--") and len(argument) > 2,
              f"unexpected argument {argument!r} (expected --section.field VALUE)")
        key, has_value, value = argument[2:].partition("=")
        if not has_value:
            check(i + 1 < len(arguments), f"--{key} needs a value")
            value, i = arguments[i + 1], i + 1
        overrides[key] = value
        i += 1
    return overrides


def load_run_config(path: str | Path | None, overrides: dict[str, str], keep_model: bool = True) -> RunConfig:
    """Defaults, then the YAML file, then the overrides; every step validated. `keep_model=False` takes the
    file's data and training settings only, not its model section nor its ViT pre-training: for fine-tuning a
    whole VLM (`init_from`, which brings both) with the default recipe."""
    values = load_yaml(path) if path else {}
    if not keep_model:  # a fine-tune: its own run directory, never the recipe's (where its start may be)
        values = {key: value for key, value in values.items() if key != "model"}
        values["train"] = {**(values.get("train") or {}), "vision_pretrain_steps": 0,
                           "output_dir": FINE_TUNE_DIR}
    return RunConfig.from_dict(values).replace(overrides)
