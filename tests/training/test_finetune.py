"""Fine-tuning released VLMs (`init_from`): the shipped configs/smolvlm-256m-finetune.yaml and
configs/nanovlm-460m-finetune.yaml, offline, with tiny random stand-ins in the hub checkpoints' formats (a
transformers Idefics3 checkpoint with its processor and chat template; a nanoVLM checkpoint naming a local
tokenizer) and the synthetic shapes in place of the_cauldron. A run starts from the pretrained weights (its
first loss is the one the pretrained model gives on that batch, computed without tinyvlm's training code), its
held-out loss falls, its records are encoded as the checkpoint was trained (SmolVLM: its chat template,
answer-only targets), and its checkpoints are asked the same way by generate.py."""

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

import generate
from data import (
    IGNORE_INDEX,
    BadRecordError,
    CheckedRecords,
    PromptError,
    VQACollator,
    build_datasets,
    make_shapes_dataset,
)
from data.chat_processors import ChatProcessor, CheckpointProcessor, TemplateError
from loading import load_for_inference
from models import (
    CheckpointError,
    ConfigError,
    LanguageConfig,
    ProjectorConfig,
    VisionConfig,
    VisionLanguageModel,
    VLMConfig,
)
from models.nanovlm import nanovlm_tokenizer
from tests.models.helpers import (
    base_tokenizer,
    base_tokenizer_dir,
    chat_vlm,
    nanovlm_config,
    save_backbones,
    save_tiny_idefics3,
    save_tiny_llama,
    tiny_fields,
    write_nanovlm,
)
from tests.training.helpers import small_config
from training import loop
from training.config import load_run_config
from training.export import export_idefics3
from training.run import train

# a random LM's answers in the plot
pytestmark = pytest.mark.filterwarnings("ignore:Glyph .* missing from font")

CONFIGS = Path(__file__).parents[2] / "configs"
SMOLVLM, NANOVLM = CONFIGS / "smolvlm-256m-finetune.yaml", CONFIGS / "nanovlm-460m-finetune.yaml"
STEPS = 6
# The shipped config, shrunk to seconds on a CPU: the synthetic shapes (three questions per training record,
# 64 px images: split into 3x3 tiles + a global image by the Idefics3 stand-in, 2x2 + a global image by the
# nanoVLM one), a few steps at a learning rate that shows the held-out loss fall within them.
SHRUNK = {
    "data.source": "synthetic", "data.shapes.num_train": "48", "data.shapes.num_validation": "8",
    "train.max_steps": str(STEPS), "train.batch_size": "4", "train.grad_accum_steps": "1",
    "train.warmup_steps": "1", "train.eval_every": str(STEPS), "train.save_every": str(STEPS),
    "train.eval_batches": "1", "train.eval_questions": "0", "train.num_workers": "0", "train.log_every": "1",
    "train.device": "cpu", "train.lr_projector": "0.003", "train.lr_vision": "0.001",
    "train.lr_language": "0.003",
}
QUESTION = "What color is the circle?"


@pytest.fixture(scope="module")
def smolvlm(tmp_path_factory):
    """A random SmolVLM-layout Idefics3 checkpoint (32 px tiles of 4 tokens, images split up to 96 px), saved
    with its processor; (directory, the transformers model, its processor)."""
    directory = tmp_path_factory.mktemp("smolvlm")
    reference, processor = save_tiny_idefics3(directory)
    return directory, reference, processor


@pytest.fixture(scope="module")
def nanovlm(tmp_path_factory):
    """A random nanoVLM checkpoint (32 px tiles of 4 tokens, images split up to 64 px) whose `lm_tokenizer` is
    a local SmolLM2-like tokenizer; (directory, the same weights as a tinyvlm model built from the
    SigLIP / Llama backbones)."""
    root = tmp_path_factory.mktemp("nanovlm")
    base = base_tokenizer_dir(root / "tokenizer")
    siglip, llama = save_backbones(root, tie=True, vocab_size=base + 66)
    reference = VisionLanguageModel.from_backbones(VLMConfig(
        vision=VisionConfig(pretrained=str(siglip)), language=LanguageConfig(pretrained=str(llama)),
        projector=ProjectorConfig(pixel_shuffle_factor=2), image_token_id=base)).eval()
    with torch.no_grad():
        reference.projector.proj.weight.normal_(0, 0.2)
    fields = {**tiny_fields(tie=True), "lm_base_vocab_size": base, "lm_vocab_size": base + 66,
              "lm_tokenizer": str(root / "tokenizer"), "lm_max_position_embeddings": 512}
    write_nanovlm(root / "nano", siglip, llama, reference.projector.proj.weight.detach(),
                  nanovlm_config(**fields))
    return root / "nano", reference


def photo(width: int, height: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8))


def answer_runs(targets: list[int]) -> list[list[int]]:
    """The target tokens in contiguous runs (one run per answer)."""
    runs, current = [], []
    for token in [*targets, IGNORE_INDEX]:
        if token != IGNORE_INDEX:
            current.append(token)
        elif current:
            runs, current = [*runs, current], []
    return runs


def segments(batch: dict[str, torch.Tensor], tokens_per_image: int, image_token_id: int):
    """Each record of a (packed) batch: its ids, targets and image tiles, read from the attention mask's
    numbering (the tiles in placeholder order, as many as its image tokens need)."""
    tiles = iter(batch["images"])
    for ids, mask, targets in zip(batch["input_ids"], batch["attention_mask"], batch["targets"]):
        for number in range(1, int(mask.max()) + 1):
            where = mask == number
            count = int((ids[where] == image_token_id).sum()) // tokens_per_image
            yield (
                ids[where],
                targets[where],
                torch.stack([next(tiles) for _ in range(count)]) if count else None,
            )
    assert next(tiles, None) is None


def idefics3_loss(reference, batch, processor) -> tuple[float, int]:
    """The transformers Idefics3ForConditionalGeneration's mean loss over the batch's answer tokens, a record
    at a time: its labels are the ids at the target positions (the model shifts them itself)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for ids, targets, tiles in segments(batch, processor.image_seq_len, processor.image_token_id):
            labels = torch.cat([torch.tensor([IGNORE_INDEX]), targets[:-1]])
            n = int((labels != IGNORE_INDEX).sum())
            pixels = None if tiles is None else tiles[None]
            loss = reference(input_ids=ids[None], pixel_values=pixels, labels=labels[None]).loss
            total, count = total + float(loss) * n, count + n
    return total / count, count


def tinyvlm_loss(reference: VisionLanguageModel, batch) -> tuple[float, int]:
    """The mean loss over the batch's answer tokens of a tinyvlm model, a record at a time."""
    total, count = 0.0, 0
    with torch.no_grad():
        for ids, targets, tiles in segments(
            batch, reference.config.tokens_per_image, reference.config.image_token_id
        ):
            _, loss = reference(ids[None], tiles, targets=targets[None], reduction="sum")
            total, count = total + float(loss), count + int((targets != IGNORE_INDEX).sum())
    return total / count, count


def check_records(batch, expected: dict[tuple[int, ...], list[str]], tokens_per_image: int,
                  image_token_id: int, decode) -> None:
    """Each record of the batch is one of `expected` (ids encoded as the checkpoint's own code would, without
    tinyvlm's), and its targets are exactly that record's answers, each with the end-of-turn token closing
    it."""
    for ids, targets, _ in segments(batch, tokens_per_image, image_token_id):
        assert tuple(ids.tolist()) in expected, (
            f"a record encoded unlike the checkpoint's own code: {decode(ids)!r}"
        )
        assert [decode(run) for run in answer_runs(targets.tolist())] == expected[tuple(ids.tolist())]


def mean_of(losses: list[tuple[float, int]]) -> float:
    """The mean over every answer token of several batches' (mean loss, tokens)."""
    return sum(loss * count for loss, count in losses) / sum(count for _, count in losses)


def watch(monkeypatch) -> dict:
    """What the loop trains on: its first training batch and its validation batches."""
    seen, run = {}, loop.run

    def recorded(batches):
        for batch in batches:
            seen.setdefault("first", batch)
            yield batch

    def spy(trainer, state):
        seen["validation"] = trainer.validation_batches
        trainer.batches = recorded(trainer.batches)
        return run(trainer, state)

    monkeypatch.setattr(loop, "run", spy)
    return seen


def history(checkpoint: Path) -> tuple[list[float], list[float]]:
    state = json.loads((checkpoint / "training_state.json").read_text())
    return [loss for _, loss in state["history"]], [loss for _, loss in state["validation"]]


def ask(checkpoint: Path, image: Path, capsys) -> str:
    """generate.py's answer from the checkpoint (exit code 0 asserted)."""
    capsys.readouterr()
    code = generate.main(["--checkpoint", str(checkpoint), "--image", str(image), "--prompt", QUESTION,
                          "--max-new-tokens", "6", "--device", "cpu"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def test_smolvlm_config_fine_tunes_an_idefics3_checkpoint(smolvlm, tmp_path, monkeypatch, capsys):
    directory, reference, processor = smolvlm
    seen = watch(monkeypatch)
    config = load_run_config(SMOLVLM, {**SHRUNK, "init_from": str(directory), "train.max_length": "512",
                                       "train.eval_questions": "1", "train.output_dir": str(tmp_path)})
    metrics = train(config)
    # a held-out question asked through its processor
    assert any(key.startswith("accuracy/") for key in metrics)
    assert metrics["too_long_records"] == 0
    checkpoint = tmp_path / f"step_{STEPS:06d}"
    losses, validation = history(checkpoint)

    # the records as Idefics3Processor and the chat template write them, targets on the answers: " red<eou>"
    encoded = {}
    for record in build_datasets(config.data)[0]:
        messages = [
            message
            for i, turn in enumerate(record["texts"])
            for message in (
                {
                    "role": "user",
                    "content": [{"type": "image"}] * (i == 0) + [{"type": "text", "text": turn["user"]}],
                },
                {"role": "assistant", "content": [{"type": "text", "text": turn["assistant"]}]},
            )
        ]
        ids = processor(text=processor.apply_chat_template(messages),
                        images=[record["images"]])["input_ids"][0]
        encoded[tuple(ids)] = [f" {turn['assistant']}<end_of_utterance>" for turn in record["texts"]]
    check_records(seen["first"], encoded, processor.image_seq_len, processor.image_token_id, processor.decode)
    # the pretrained weights: transformers' model gives the first loss on the first batch
    expected, tokens = idefics3_loss(reference, seen["first"], processor)
    assert tokens > 20 and losses[0] == pytest.approx(expected, rel=1e-4)
    # ... and the held-out loss, which training lowers
    held_out = mean_of([idefics3_loss(reference, batch, processor) for batch in seen["validation"]])
    assert math.isfinite(metrics["validation_loss"]) and validation[-1] < 0.8 * held_out

    # the checkpoint keeps the processor: it is asked with the chat template, as the pretrained one is
    model, loaded = load_for_inference(checkpoint, torch.device("cpu"))
    assert isinstance(loaded, CheckpointProcessor) and model.config.image_token_id == processor.image_token_id
    image = photo(64, 48)
    original = CheckpointProcessor.from_pretrained(directory).encode(QUESTION, [image])
    ids, pixels = loaded.encode(QUESTION, [image])
    assert ids == original[0] and torch.equal(pixels, original[1])
    image.save(tmp_path / "photo.png")
    ask(checkpoint, tmp_path / "photo.png", capsys)


def test_nanovlm_config_fine_tunes_a_nanovlm_checkpoint(nanovlm, tmp_path, monkeypatch, capsys):
    directory, reference = nanovlm
    seen = watch(monkeypatch)
    config = load_run_config(NANOVLM, {**SHRUNK, "init_from": str(directory), "train.max_length": "512",
                                       "train.output_dir": str(tmp_path)})
    metrics = train(config)
    assert metrics["too_long_records"] == 0
    checkpoint = tmp_path / f"step_{STEPS:06d}"
    losses, validation = history(checkpoint)

    # the records as nanoVLM writes them (its tokenizer, its ChatML template, the image string at the start of
    # the user turn: the global image, then each tile of the 2x2 grid after its marker), targets on the
    # answers
    tokenizer = nanovlm_tokenizer(json.loads((directory / "config.json").read_text()))
    image = "<|global_image|>" + "<|image|>" * 4 + "".join(f"<row_{r}_col_{c}>" + "<|image|>" * 4
                                                          for r in (1, 2) for c in (1, 2))
    encoded = {}
    for record in build_datasets(config.data)[0]:
        messages = [message for i, turn in enumerate(record["texts"]) for message in (
            {"role": "user", "content": image * (i == 0) + turn["user"]},
            {"role": "assistant", "content": turn["assistant"]})]
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        encoded[tuple(tokenizer(text)["input_ids"])] = [
            f"{turn['assistant']}<|im_end|>" for turn in record["texts"]
        ]
    first = seen["first"]
    check_records(first, encoded, 4, tokenizer.convert_tokens_to_ids("<|image|>"), tokenizer.decode)
    # the same weights, built from the SigLIP / Llama backbones, give the first loss on the first batch
    expected, tokens = tinyvlm_loss(reference, first)
    assert tokens > 20 and losses[0] == pytest.approx(expected, rel=1e-4)
    held_out = mean_of([tinyvlm_loss(reference, batch) for batch in seen["validation"]])
    assert math.isfinite(metrics["validation_loss"]) and validation[-1] < 0.8 * held_out

    # the checkpoint keeps nanoVLM's tokenizer: asked in ChatML with nanoVLM's splitting, as the pretrained
    # one is
    model, loaded = load_for_inference(checkpoint, torch.device("cpu"))
    pretrained, original = load_for_inference(directory, torch.device("cpu"))
    assert isinstance(loaded, ChatProcessor) and model.config.splitting == pretrained.config.splitting
    image = photo(64, 48)
    assert loaded.encode(QUESTION, [image])[0] == original.encode(QUESTION, [image])[0]
    image.save(tmp_path / "photo.png")
    ask(checkpoint, tmp_path / "photo.png", capsys)


def test_a_tinyvlm_run_is_a_start_too(tmp_path, monkeypatch):
    """init_from a run directory of tinyvlm's own (its newest checkpoint): its weights, tokenizer and config
    (here image tokens after the text) carry on."""
    train(small_config(tmp_path / "first", **{"train.max_steps": "2", "train.save_every": "2",
                                               "train.eval_every": "2", "train.eval_questions": "0"}))
    seen = watch(monkeypatch)
    metrics = train(load_run_config(NANOVLM,
                                    {**SHRUNK, "init_from": str(tmp_path / "first"), "train.max_steps": "1",
                                     "train.max_length": "256",
                                     "train.output_dir": str(tmp_path / "second")}))
    start = VisionLanguageModel.from_pretrained(tmp_path / "first" / "step_000002")
    with torch.no_grad():
        _, expected = start(**seen["first"])
    assert metrics["train_loss"] == pytest.approx(float(expected), rel=1e-4)
    model, processor = load_for_inference(tmp_path / "second", torch.device("cpu"))
    assert isinstance(processor, ChatProcessor) and model.config == start.config


def test_the_command_line_fine_tunes_a_trained_run_with_the_default_recipe(tmp_path, capsys):
    """`python train.py --init_from RUN` takes the default recipe's data and training settings and the run's
    own model, on the synthetic shapes and on a JSONL of one's own (the default's model section and ViT
    pre-training were refused before)."""
    from train import main

    train(small_config(tmp_path / "first", **{"train.max_steps": "2", "train.save_every": "2",
                                               "train.eval_every": "2", "train.eval_questions": "0"}))
    rows = make_shapes_dataset("train", 20, seed=0, image_size=32)
    for i, row in enumerate(rows):
        row["images"][0].save(tmp_path / f"{i}.png")
    (tmp_path / "mine.jsonl").write_text("\n".join(json.dumps({"images": [f"{i}.png"], "texts": row["texts"]})
                                                   for i, row in enumerate(rows)))
    shrunk = [f"--{key}={value}" for key, value in {**SHRUNK, "train.max_steps": "1"}.items()]
    own = ["--data.source", "jsonl", "--data.path", str(tmp_path / "mine.jsonl")]
    for name, data in [("shapes", []), ("mine", own)]:
        assert main(["--init_from", str(tmp_path / "first"), *shrunk, *data,
                     "--train.output_dir", str(tmp_path / name)]) == 0, capsys.readouterr().err
        model, _ = load_for_inference(tmp_path / name, torch.device("cpu"))
        assert model.config == VisionLanguageModel.from_pretrained(tmp_path / "first" / "step_000002").config


def test_a_resumed_fine_tune_loads_its_own_checkpoint(smolvlm, tmp_path):
    """Resuming needs no init_from (the start is gone) and continues exactly as an uninterrupted run."""
    start = shutil.copytree(smolvlm[0], tmp_path / "start")
    common = {**SHRUNK, "init_from": str(start), "train.max_length": "512", "train.eval_every": "2",
              "train.save_every": "2", "train.decay_steps": "4", "train.max_steps": "4"}
    train(load_run_config(SMOLVLM, {**common, "train.output_dir": str(tmp_path / "whole")}))
    train(load_run_config(SMOLVLM,
                          {**common, "train.max_steps": "2", "train.output_dir": str(tmp_path / "split")}))
    shutil.rmtree(start)
    saved = json.loads((tmp_path / "split" / "step_000002" / "run_config.json").read_text())
    assert saved["init_from"] == str(start)
    from train import main

    assert main(["--resume", str(tmp_path / "split"), "--train.max_steps", "4"]) == 0
    whole, split = tmp_path / "whole" / "step_000004", tmp_path / "split" / "step_000004"
    torch.testing.assert_close(torch.tensor(history(split)[0]), torch.tensor(history(whole)[0]), atol=1e-6,
                               rtol=0)
    weights = load_file(whole / "model.safetensors")
    for name, tensor in load_file(split / "model.safetensors").items():
        torch.testing.assert_close(tensor, weights[name], atol=1e-6, rtol=0)
    assert isinstance(load_for_inference(split, torch.device("cpu"))[1], CheckpointProcessor)


def test_idefics3_targets_are_each_answer_and_its_end_of_utterance(smolvlm):
    """A two-turn conversation with two split images: the ids and pixels are the processor's for the chat
    template's text, the prompt up to the first answer is what inference asks, and the targets are exactly the
    answers' tokens, each closed by <end_of_utterance>, aligned with the logits."""
    directory, _, processor = smolvlm
    encoder = CheckpointProcessor.from_pretrained(directory)
    turns = [{"user": QUESTION, "assistant": "red"},
             {"user": "How many shapes are there?", "assistant": "2 shapes"}]
    images = [photo(80, 40), photo(30, 70, seed=1)]
    ids, targets, pixels = encoder.encode_conversation(turns, images)

    messages = [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": QUESTION}],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "red"}]},
        {"role": "user", "content": [{"type": "text", "text": "How many shapes are there?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "2 shapes"}]},
    ]
    text = processor.apply_chat_template(messages)
    assert text.endswith("User: How many shapes are there?<end_of_utterance>\nAssistant: 2 "
                         "shapes<end_of_utterance>\n")
    inputs = processor(text=text, images=[images], return_tensors="pt")
    assert ids == inputs["input_ids"][0].tolist() and torch.equal(pixels, inputs["pixel_values"][0])
    # 2x3 and 3x2 tiles (the images resized to 96 px, then to whole tiles), + global
    assert len(pixels) == 7 + 7

    assert len(targets) == len(ids) and targets[-1] == IGNORE_INDEX
    learned = [t for t, target in enumerate(targets) if target != IGNORE_INDEX]
    assert all(targets[t] == ids[t + 1] for t in learned)
    decoded = [processor.tokenizer.decode(run) for run in answer_runs(targets)]
    assert decoded == [" red<end_of_utterance>", " 2 shapes<end_of_utterance>"]
    prompt, prompt_pixels = encoder.encode(QUESTION, images)
    assert ids[:learned[0] + 1] == prompt and torch.equal(prompt_pixels, pixels)


def test_idefics3_text_only_conversation(smolvlm):
    encoder = CheckpointProcessor.from_pretrained(smolvlm[0])
    ids, targets, pixels = encoder.encode_conversation([{"user": "hi", "assistant": "blue sky"}], [])
    assert pixels is None and ids == encoder.tokenizer(encoder.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
         {"role": "assistant", "content": [{"type": "text", "text": "blue sky"}]}]))["input_ids"]
    assert [encoder.tokenizer.decode(run) for run in answer_runs(targets)] == [" blue sky<end_of_utterance>"]


@pytest.mark.parametrize("template, message", [
    # the generation prompt is not how the template writes the assistant turn: no token prefix to find answers
    # by
    ("{% for m in messages %}{{ m['role'] + ':' }}{% for c in m['content'] %}{% if c['type'] == 'image' %}"
     "{{ '<image>' }}{% else %}{{ c['text'] }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
     "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}",
     "turn 0: the chat template's text up to the assistant turn opened does not tokenize to a prefix"),
    # answers not closed by the end-of-utterance token
    ("{% for m in messages %}{{ m['role'] + ':' }}{% for c in m['content'] %}{% if c['type'] == 'image' %}"
     "{{ '<image>' }}{% else %}{{ c['text'] }}{% endif %}{% endfor %}\n{% endfor %}"
     "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}",
     "turn 0: the chat template does not close the answer with <end_of_utterance>"),
], ids=["no-prefix", "no-end-of-utterance"])
def test_a_template_that_hides_the_answers_is_a_one_line_error(smolvlm, template, message):
    encoder = CheckpointProcessor.from_pretrained(smolvlm[0])
    encoder.processor.chat_template = template
    with pytest.raises(TemplateError) as error:
        encoder.encode_conversation([{"user": QUESTION, "assistant": "red"}], [photo(40, 40)])
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_a_text_only_batch_under_ddp_gets_a_placeholder_image_in_the_checkpoints_format(smolvlm):
    """`ensure_image` (every rank must run the vision tower): one black tile behind the checkpoint's own
    <image> tokens, no targets; the model trains on the batch."""
    directory, _, processor = smolvlm
    collator = VQACollator.for_encoder(CheckpointProcessor.from_pretrained(directory), 512, ensure_image=True)
    batch = collator([{"images": [], "texts": [{"user": "hi", "assistant": "blue sky"}]}])
    assert batch["images"].shape == (1, 3, 32, 32) and not batch["images"].any()
    assert int((batch["input_ids"] == processor.image_token_id).sum()) == processor.image_seq_len
    answers = [processor.decode(run) for run in answer_runs(batch["targets"][0].tolist())]
    assert answers == [" blue sky<end_of_utterance>"] and (batch["targets"][1] == IGNORE_INDEX).all()
    _, loss = VisionLanguageModel.from_pretrained(directory)(**batch)
    loss.backward()
    assert torch.isfinite(loss)


def test_a_typed_image_token_is_a_prompt_error(smolvlm):
    encoder = CheckpointProcessor.from_pretrained(smolvlm[0])
    with pytest.raises(PromptError, match="holds <image>, which the chat template would take for an image"):
        encoder.encode_conversation([{"user": "<image>\nwhat?", "assistant": "red"}], [photo(40, 40)])


def test_an_exported_smolvlm_keeps_its_processor(smolvlm, tmp_path):
    export_idefics3(smolvlm[0], tmp_path / "out")
    model, encoder = load_for_inference(tmp_path / "out", torch.device("cpu"))
    assert isinstance(encoder, CheckpointProcessor)  # image splitting and chat template, not a bare tokenizer
    original = CheckpointProcessor.from_pretrained(smolvlm[0])
    image = photo(70, 50)
    ids, pixels = encoder.encode("what colour?", [image])
    expected_ids, expected_pixels = original.encode("what colour?", [image])
    assert ids == expected_ids and torch.equal(pixels, expected_pixels)


def test_a_model_tinyvlm_trained_answers_after_its_idefics3_export(tmp_path, capsys):
    """generate.py answers from the export as from the original (the export's Idefics3 processor files made it
    ask through transformers' processor, with no usable chat template: a traceback); transformers gets
    tinyvlm's prompt ids from the exported tokenizer's chat template with an image part, and its Idefics3
    model answers them alike."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    tokenizer = base_tokenizer()
    chat_vlm(tokenizer).save_pretrained(tmp_path / "ours")
    tokenizer.save_pretrained(tmp_path / "ours")
    export_idefics3(tmp_path / "ours", tmp_path / "exported")
    photo(50, 40).save(tmp_path / "photo.png")
    answer = ask(tmp_path / "ours", tmp_path / "photo.png", capsys)
    assert ask(tmp_path / "exported", tmp_path / "photo.png", capsys) == answer and answer.strip()

    exported = AutoTokenizer.from_pretrained(tmp_path / "exported")
    messages = [{"role": "user", "content": [{"type": "text", "text": QUESTION}, {"type": "image"}]}]
    text = exported.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    _, processor = load_for_inference(tmp_path / "ours", torch.device("cpu"))
    ids, pixels = processor.encode(QUESTION, [Image.open(tmp_path / "photo.png")])
    assert exported.encode(text, add_special_tokens=False) == ids
    reference = AutoModelForImageTextToText.from_pretrained(tmp_path / "exported").eval()
    tokens = reference.generate(input_ids=torch.tensor([ids]), pixel_values=pixels[None], max_new_tokens=6,
                                do_sample=False)[0, len(ids):]
    assert exported.decode(tokens, skip_special_tokens=True).strip() == answer.strip()


def test_a_typed_image_token_in_training_data_is_a_bad_record_not_a_stopped_run(smolvlm):
    encoder = CheckpointProcessor.from_pretrained(smolvlm[0])
    records = [{"images": [photo(40, 40)], "texts": [{"user": user, "assistant": "red"}]}
               for user in ("what colour?", "see <image> here")]
    skipping = CheckedRecords(records, "skip", report=lambda _: None, check_texts=encoder.check_texts)
    assert skipping[0] is not None and skipping[1] is None and skipping.num_bad == 1
    assert VQACollator.for_encoder(encoder, 512)([skipping[0], skipping[1]])["images"].shape[0] > 0
    failing = CheckedRecords(records, "fail", check_texts=encoder.check_texts)
    with pytest.raises(BadRecordError, match=r"train record 1 is bad \(PromptError: the text holds <image>"):
        failing[1]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"model.vision.pretrained": "google/siglip-base-patch16-224"},
            "init_from (START) brings the whole model: model.vision.pretrained "
            "(google/siglip-base-patch16-224) must be null",
        ),
        (
            {"model.language.pretrained": "HuggingFaceTB/SmolLM2-135M"},
            "init_from (START) brings the whole model: model.language.pretrained "
            "(HuggingFaceTB/SmolLM2-135M) must be null",
        ),
        (
            {"tokenizer": "HuggingFaceTB/SmolLM2-135M"},
            "init_from (START) brings its own tokenizer: tokenizer",
        ),
        (
            {"train.vision_pretrain_steps": "10"},
            "init_from (START) brings a trained ViT: train.vision_pretrain_steps",
        ),
        ({"init_from": " "}, "init_from: expected a checkpoint directory or hub id"),
    ],
    ids=["vision", "language", "tokenizer", "vision-pretraining", "empty"],
)
def test_what_init_from_excludes_is_a_one_line_config_error(overrides, message):
    with pytest.raises(ConfigError) as error:
        load_run_config(SMOLVLM, {"init_from": "START", **overrides})
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_model_fields_beside_init_from_are_refused_before_any_work(tmp_path):
    config = load_run_config(SMOLVLM, {**SHRUNK, "init_from": str(tmp_path / "nowhere"),
                                       "model.language.num_layers": "3", "train.output_dir": str(tmp_path)})
    with pytest.raises(ConfigError) as error:
        train(config)
    assert str(error.value).endswith("brings the model's architecture and image splitting: leave "
                                     "model.language.num_layers out (it is set to 3)")
    assert "\n" not in str(error.value) and not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    "start, message",
    [
        ("nowhere", "nowhere: no such file or directory"),
        ("llama", "model_type 'llama' is not supported"),
        (
            "no-such-owner/no-such-vlm",
            "no-such-owner/no-such-vlm: not a local path, and the hub could not provide it",
        ),
    ],
    ids=["missing", "not-a-vlm", "hub-offline"],
)
def test_a_start_that_cannot_be_loaded_is_a_one_line_checkpoint_error(tmp_path, capsys, start, message):
    from train import main

    if start == "llama":
        save_tiny_llama(tmp_path / "llama", tie=True)
    if start != "no-such-owner/no-such-vlm":
        start = str(tmp_path / start)
    overrides = [arg for key, value in {**SHRUNK, "train.output_dir": str(tmp_path / "run")}.items()
                 for arg in (f"--{key}", value)]
    code = main(["--config", str(SMOLVLM), "--init_from", start, *overrides])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("error: ") and message in err[-1], err


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused(smolvlm, tmp_path):
    from transformers import AutoProcessor

    directory = shutil.copytree(smolvlm[0], tmp_path / "start")
    processor = AutoProcessor.from_pretrained(directory)
    processor.tokenizer.add_tokens(["<new>"])
    processor.save_pretrained(directory)
    with pytest.raises(CheckpointError) as error:
        train(load_run_config(SMOLVLM,
                              {**SHRUNK, "init_from": str(directory), "train.output_dir": str(tmp_path)}))
    assert (
        str(error.value) == f"{directory}: its tokenizer has 301 tokens, more than the model's 300 embeddings"
    )


def test_every_shipped_fine_tuning_config_is_tested_here():
    starts = {path.name for path in CONFIGS.glob("*.yaml") if load_run_config(path, {}).init_from}
    assert starts == {SMOLVLM.name, NANOVLM.name}
    assert load_run_config(SMOLVLM, {}).init_from == "HuggingFaceTB/SmolVLM-256M-Instruct"
    assert load_run_config(NANOVLM, {}).init_from == "lusxvr/nanoVLM-460M-8k"
