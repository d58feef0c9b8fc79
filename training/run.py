"""One training run from start to finish: data, model, optimizer, the loop (training/loop.py), and the
results."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path

import torch
from datasets import Dataset
from tqdm import tqdm

from data import CheckedRecords, ImageProcessor, VQACollator, build_datasets, text_lengths
from data.batches import loader_batches, training_batches
from data.chat_processors import ChatProcessor, ConversationEncoder
from data.prefetch import prefetched
from data.sampler import ResumableBatchSampler
from data.sources import stream_sources
from data.stream_batches import StreamedBatches
from data.streaming import Source
from models import VisionLanguageModel
from models.lora import WholeModuleError, adapter_base, add_adapters, load_adapter, quantize_frozen
from training import distributed, loop
from training.answer_pretraining import pretraining_on_answers, read_question_types
from training.checkpoint import (
    RUN_CONFIG,
    is_pretraining,
    load_pretraining,
    load_training_state,
    run_id_of,
    save_pretraining,
)
from training.config import RunConfig, check_fresh_start
from training.optim import build_optimizer, build_scheduler, check_same_parts, freeze_parts, learning_rates
from training.progress import Phase
from training.results import write_results
from training.run_dir import check_output_dir, check_resumable, new_run_id
from training.setup import model_and_processor, unsharded
from training.signals import GracefulStop
from training.vision_pretraining import Pretraining, StreamedScenes, pretraining_on_scenes
from typed_config import ConfigError, check, one_line

TOKENIZER_RECORDS = 2000  # data.source=stream: each stream's first records train the tokenizer (when none)


def train(config: RunConfig, resume: Path | None = None) -> dict:
    """Run training to `train.max_steps` (as one rank of the job when started by torchrun); return the final
    metrics."""
    ranks, device = distributed.init(config.train.device, config.train.dist_timeout)
    try:
        return _train(config, resume, ranks, device)
    finally:
        distributed.shutdown()


def _train(config: RunConfig, resume: Path | None, ranks: distributed.Ranks, device: torch.device) -> dict:
    """Start-up (checks, data, model; a stop signal ends it at once: nothing to save yet), then, where a stop
    signal saves what exists and ends the run (training/signals.py): the ViT's pre-training, the training loop
    and the results."""
    train_config = config.train
    torch.manual_seed(train_config.seed)
    if train_config.num_threads:
        torch.set_num_threads(train_config.num_threads)
    say, report = distributed.main_rank_only(ranks, print), distributed.main_rank_only(ranks, tqdm.write)
    _check_start(config, resume, device)
    run_id = (resume and run_id_of(resume)) or new_run_id()
    if resume:
        say(f"resuming from {resume}", flush=True)
    with Phase(f"reading the data (data.source {config.data.source})", say):
        sources, train_data, validation_data = _read_data(config)
    with Phase(f"loading {resume or config.init_from}" if resume or config.init_from
               else "building the tokenizer and the model", say):
        model, processor = model_and_processor(config, resume, train_data)
    config = dataclasses.replace(config, model=model.config)
    _check(config, resume)
    train_records = CheckedRecords(train_data, config.data.on_bad_record, "train", report=report,
                                   check_texts=processor.check_texts, video=config.model.video)
    with GracefulStop(escalate=not ranks.distributed) as stop:
        if config.pretrain_steps() and (resume is None or is_pretraining(resume)):
            if not _pretrain_vision(config, model, processor, train_records, sources, device, say, stop,
                                    resume, run_id, ranks):
                return {"step": 0, "stopped_by": stop.requested or "stop signal"}
            distributed.broadcast_parameters(model.vision)  # GPU kernels need not be bit-exact across ranks
        resumed = resume if resume is not None and not is_pretraining(resume) else None
        return _train_model(config, resumed, run_id, model, processor, train_records, validation_data, ranks,
                            device, stop, sources)


def _read_data(config: RunConfig) -> tuple[list[Source] | None, Dataset | list[dict], Dataset | list[dict]]:
    """(streamed sources or None, training records, validation records). A stream's training records are
    only its first ones, which train the tokenizer where none is configured: the loop streams the rest."""
    if config.data.source != "stream":
        return None, *build_datasets(config.data)
    sources, validation = stream_sources(config.data)
    count = 0 if config.tokenizer else TOKENIZER_RECORDS
    return sources, [record for source in sources for record in source.head(count)], validation


def _train_model(config: RunConfig, resume: Path | None, run_id: str, model: VisionLanguageModel,
                 processor: ConversationEncoder, train_records: CheckedRecords, validation_data: Dataset,
                 ranks: distributed.Ranks, device: torch.device, stop: GracefulStop,
                 sources: list[Source] | None = None) -> dict:
    """The training loop from step 0, or from the step checkpoint `resume`, then the results; the training
    records are `sources`' streams where it is given."""
    train_config, train_data = config.train, train_records.dataset
    say, report = distributed.main_rank_only(ranks, print), distributed.main_rank_only(ranks, tqdm.write)
    with Phase("preparing the training loop", say, announce=False):
        _prepare_parts(model, train_config, device, resume)
        model = distributed.wrap(model.to(device), train_config.parallel, ranks, device)
        optimizer = build_optimizer(distributed.unwrap(model), train_config, device)
        state = (loop.TrainState.resumed(load_training_state(resume, model, optimizer, ranks), train_config,
                                         run_id) if resume else loop.TrainState(run_id))
        # Records encoded the way the model is asked: tinyvlm's ChatML, or a checkpoint's own chat template
        # and images.
        collator = VQACollator.for_encoder(processor, train_config.max_length, ensure_image=ranks.distributed,
                                           pack=train_config.packing != "off")
        validation_records = CheckedRecords(validation_data, config.data.on_bad_record, "validation",
                                            report=report, check_texts=processor.check_texts,
                                            video=config.model.video)
        validation_batches = _validation_batches(collator, validation_records, train_config)
    say(_description(config, distributed.unwrap(model), sources or train_data, validation_data, device,
                     ranks), flush=True)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" and train_config.bf16
                else contextlib.nullcontext())
    with _batches(config, state, train_records, sources, collator, processor, ranks, report,
                  pin_memory=device.type == "cuda") as batches:
        trainer = loop.Trainer(config, model, torch.compile(model) if train_config.compile else model,
                               optimizer, build_scheduler(optimizer, train_config, state.step), device,
                               autocast, processor, batches, validation_batches, ranks,
                               _wandb_run(config, ranks), stop)
        stopped_by = loop.run(trainer, state)
    if stopped_by:
        return {"step": state.step, "stopped_by": stopped_by}
    # the last checkpoint is written: a stop signal from here on ends the run with its results, unscored
    final = Path(train_config.output_dir) / f"step_{train_config.max_steps:06d}"
    final_model = unsharded(model, config, final, ranks)
    if not ranks.is_main:
        return state.summary()
    return write_results(final_model, trainer, state, validation_records)


def _batches(config: RunConfig, state: loop.TrainState, train_records: CheckedRecords,
             sources: list[Source] | None, collator: VQACollator, processor: ConversationEncoder,
             ranks: distributed.Ranks, report: Callable[[str], None], pin_memory: bool):
    """The training batches (a context manager): `train_records` in the resumable sampler's order, or
    `sources` streamed from where `state` stands (data/stream_batches.py)."""
    train_config = config.train
    loader = (train_config.num_workers, train_config.prefetch_factor, pin_memory)
    if sources is None:
        lengths = text_lengths(train_records.dataset) if train_config.group_by_length else None
        sampler = ResumableBatchSampler(len(train_records), train_config.batch_size, train_config.seed,
                                        state.samples_seen, ranks.rank, ranks.world_size, lengths)
        return training_batches(train_records, sampler, collator, *loader)
    workers = max(train_config.num_workers, 1)
    saved = {position["readers"] for position in state.stream.values()}
    check(saved <= {ranks.world_size * workers},
          f"a streamed run resumes with as many readers (ranks x DataLoader workers) as it had, "
          f"{min(saved, default=0)}; this run has {ranks.world_size} x {workers}")
    streamed = StreamedBatches(sources, collator, train_config.batch_size, train_config.seed,
                               config.data.shuffle_buffer, config.data.on_bad_record, ranks.rank,
                               ranks.world_size, train_config.num_workers,
                               consumed=state.step * train_config.grad_accum_steps, positions=state.stream,
                               report=report, check_texts=processor.check_texts,
                               fill_rows=train_config.packing == "max_length")
    return _streamed(streamed, *loader)


@contextlib.contextmanager
def _streamed(streamed: StreamedBatches, num_workers: int, prefetch_factor: int, pin_memory: bool):
    """The streamed batches through the DataLoader's worker processes, or (none) a producer thread that keeps
    `prefetch_factor` batches ahead of the step."""
    with loader_batches(streamed, num_workers, prefetch_factor, pin_memory, batch_size=None) as batches:
        if num_workers:
            yield batches
        else:
            with prefetched(batches, prefetch_factor) as ahead:
                yield ahead


def _check_start(config: RunConfig, resume: Path | None, device: torch.device) -> None:
    """What refuses a run before it reads any data: a setting this device cannot train, a resume with no step
    left to train, or a fresh run's config or output directory (decided on rank 0: it writes there)."""
    check(not config.train.flex_attention or device.type == "cuda", "train.flex_attention trains on a CUDA "
          f"GPU (FlexAttention has no backward pass on a CPU); this run's device is {device.type}")
    if resume:
        check_resumable(resume, config.train.max_steps)
    else:
        check_fresh_start(config)
        distributed.checked_on_main(lambda: check_output_dir(config))


def _prepare_parts(model: VisionLanguageModel, train_config, device: torch.device,
                   resume: Path | None) -> None:
    """The parts at learning rate 0 frozen, LoRA's adapters (and QLoRA's 4-bit base) in place."""
    freeze_parts(model, train_config)
    _adapt(model, train_config, device, resume)


def _validation_batches(collator: VQACollator, records: CheckedRecords, train_config) -> list[dict]:
    """The first train.eval_batches batches of the validation records, collated once for the whole run."""
    size = train_config.batch_size
    shown = min(len(records), train_config.eval_batches * size)
    return [
        collator([records[i] for i in range(start, min(start + size, shown))])
        for start in range(0, shown, size)
    ]


def _description(config: RunConfig, model: VisionLanguageModel, train_data, validation_data,
                 device: torch.device, ranks: distributed.Ranks) -> str:
    """The run's first line: the model's size, the data's, where it trains."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    train = (f"{len(train_data)} streams" if config.data.source == "stream" else f"{len(train_data)} train")
    return (f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters "
            f"({trainable / 1e6:.2f}M trained), {config.model.tokens_per_image} tokens per image, vocabulary "
            f"{config.model.language.vocab_size}; data: {train} / {len(validation_data)} "
            f"validation samples; device {device}"
            + (f"; {ranks.world_size} ranks ({config.train.parallel})" if ranks.distributed else ""))


def _adapt(model: VisionLanguageModel, train_config, device: torch.device, resume: Path | None) -> None:
    """train.lora on the model: its frozen base quantized (QLoRA), then its adapters: new ones, or those of
    the LoRA run it resumes (in that order either way: a resumed run is built as it first was)."""
    if train_config.lora.quantize_base:
        _quantize_base(model, device)
    if resume is not None and adapter_base(resume) is not None:
        load_adapter(model, resume)
    elif train_config.lora.rank:
        _add_adapters(model, train_config)


def _quantize_base(model: VisionLanguageModel, device: torch.device) -> None:
    """QLoRA's frozen 4-bit base (bitsandbytes, on a CUDA GPU), before any adapter goes on it."""
    check(device.type == "cuda",
          f"train.lora.quantize_base: a 4-bit base (QLoRA, bitsandbytes) trains on a CUDA "
          f"GPU; this run's device is {device.type}")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise ConfigError("train.lora.quantize_base needs bitsandbytes: pip install bitsandbytes") from None
    quantize_frozen(model, device)


def _add_adapters(model: VisionLanguageModel, train_config) -> None:
    """train.lora's adapters (and modules trained whole) on the model, each in a part that trains (a part at
    learning rate 0 would leave them as they start)."""
    lora = train_config.lora
    try:
        add_adapters(model, lora.rank, lora.alpha, lora.target_modules, lora.dropout, lora.modules_to_save)
    # peft: no layer matches, or a match is no linear layer; a tied or misnamed module
    except ValueError as e:
        setting = "modules_to_save" if isinstance(e, WholeModuleError) else "target_modules"
        raise ConfigError(f"train.lora.{setting} ({getattr(lora, setting)}): {one_line(e, 200)}") from None
    for part, lr in learning_rates(train_config).items():
        trained = [name for name, p in getattr(model, part).named_parameters() if p.requires_grad]
        if trained and lr == 0:
            raise ConfigError(f"train.lora puts trained weights in the {part} ({part}.{trained[0]}), whose "
                              f"learning rate train.lr_{part} is 0: they would never train")


def _pretrain_vision(config: RunConfig, model: VisionLanguageModel, chat: ChatProcessor,
                     train_records: CheckedRecords, sources: list[Source] | None, device: torch.device,
                     say: Callable[..., None], stop: GracefulStop, resume: Path | None, run_id: str,
                     ranks: distributed.Ranks) -> bool:
    """Pre-train the from-scratch ViT in place with the run's objective (see
    RunConfig.vision_pretrain_objective), from the start or from where the pre-training checkpoint `resume`
    stopped, then save a pre-training checkpoint (the run's, until its first step checkpoint). Returns
    False when a stop signal ended it first; it says how to continue then."""
    train_config = config.train
    pretraining = _pretraining(config, model, chat, train_records, sources, device)
    if resume is not None:
        load_pretraining(resume, pretraining)
    field = (
        "vision_pretrain_steps" if pretraining.steps == train_config.vision_pretrain_steps
        else "answer_pretrain_steps"
    )
    say(f"vision pre-training ({config.vision_pretrain_objective()}): {pretraining.steps} steps "
        f"(train.{field}) of {train_config.vision_pretrain_batch_size} images"
        + (f", from step {pretraining.step}" if pretraining.step else ""), flush=True)
    finished = pretraining.run(functools.partial(say, flush=True),
                               stop=lambda: distributed.any_rank(stop.requested is not None, device))
    path = save_pretraining(Path(train_config.output_dir), pretraining, model, chat, config, run_id, ranks)
    if not finished:
        say(f"{stop.requested or 'stop signal'}: stopped the ViT's pre-training at step {pretraining.step}/"
            f"{pretraining.steps}, saved {path}; continue with: python train.py --resume {path}", flush=True)
    return finished


def _pretraining(config: RunConfig, model: VisionLanguageModel, chat: ChatProcessor,
                 train_records: CheckedRecords, sources: list[Source] | None,
                 device: torch.device) -> Pretraining:
    """The ViT's pre-training with the run's objective, at step 0 (cells: on fresh scenes, or on the labelled
    images of `sources`, streamed)."""
    train_config = config.train
    processor, vision = ImageProcessor.from_config(config.model.vision), model.vision.to(device)
    common = dict(steps=config.pretrain_steps(), batch_size=train_config.vision_pretrain_batch_size,
                  lr=train_config.vision_pretrain_lr, seed=train_config.seed, device=device)
    if config.vision_pretrain_objective() == "cells":
        scenes = StreamedScenes(sources, processor, vision.config.grid_size,
                                train_config.vision_pretrain_batch_size, train_config.seed,
                                config.data.shuffle_buffer) if sources else None
        return pretraining_on_scenes(vision, processor, config.data.shapes, scenes=scenes, **common)
    encode = functools.partial(chat.tokenizer.encode, add_special_tokens=False)
    return pretraining_on_answers(
        vision,
        processor,
        train_records,
        encode,
        model.config.language.vocab_size,
        question_types=read_question_types(train_records.dataset),
        # read through it only where the LM will read through it as it is now
        projector=model.projector.to(device) if train_config.lr_projector == 0 else None,
        **common,
    )


def _check(config: RunConfig, resume: Path | None) -> None:
    """Settings that cannot work with this model or this checkpoint, refused before anything trains."""
    train_config, context = config.train, config.model.language.max_position_embeddings
    check(train_config.max_length <= context,
          f"train.max_length ({train_config.max_length}) exceeds the language "
          f"model's context (model.language.max_position_embeddings = {context})")
    if resume:
        check_same_parts(RunConfig.from_json(resume / RUN_CONFIG).train, train_config)


def _wandb_run(config: RunConfig, ranks: distributed.Ranks):
    """A Weights & Biases run on rank 0 when train.wandb is on, else None."""
    if not (config.train.wandb and ranks.is_main):
        return None
    import wandb

    return wandb.init(project=config.train.wandb_project, config=config.to_dict(),
                      dir=config.train.output_dir, resume="allow")
