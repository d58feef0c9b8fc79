"""Held-out evaluation: validation loss, exact-match answers per question type, and the plots a run leaves
behind."""

from __future__ import annotations

import textwrap
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from data import ImageInputs, ImageProcessor, left_pad
from data.chat_processors import ChatProcessor, ConversationEncoder
from data.image_splitting import as_image_inputs
from models import VisionLanguageModel
from training.loss import LossWeight, target_weights

CELL_INCHES = 3.2  # width of a grid cell, and height of its image
TITLE_POINTS = 7
TITLE_CHARS = 48  # a title line's characters: fits CELL_INCHES at TITLE_POINTS
TITLE_LINE_INCHES = 1.4 * TITLE_POINTS / 72


def normalize(answer: str) -> str:
    return " ".join(answer.lower().strip().rstrip(".").split())


@torch.no_grad()
def validation_loss(model: VisionLanguageModel, batches: Iterable[dict], device: torch.device, autocast,
                    per: LossWeight = "token", chunked_loss: bool = False) -> float:
    """Cross-entropy over every answer token of `batches`, weighted as in training (see `target_weights`),
    chunked as in training."""
    model.eval()
    total, weight = 0.0, 0.0
    for batch in batches:
        weights = target_weights(batch["targets"], batch["attention_mask"], per)
        with autocast:
            inputs = {k: v.to(device) for k, v in batch.items()}
            _, losses = model(**inputs, reduction="none", return_logits=False, chunked_loss=chunked_loss)
        total += float((losses * weights.to(device)).sum())
        weight += float(weights.sum())
    return total / (weight or 1)


def answer(model: VisionLanguageModel, tokenizer,
           processor: ConversationEncoder | ImageProcessor | ImageInputs, records: list[dict],
           device: torch.device, max_new_tokens: int = 64, batch_size: int = 64,
           stopped: Callable[[], bool] | None = None) -> list[str]:
    """Greedy answers to the first question of each record, in batches of left-padded prompts asked the way
    the model was trained: `processor` is the run's chat processor (data/chat_processors.py: its `encode`
    builds each prompt), or an ImageProcessor (one square per image) / ImageInputs (split when the model's
    config says so) for tinyvlm's ChatML with the model's image position. Once `stopped()` is true, no further
    batch is asked (fewer answers)."""
    model.eval()
    answers = []
    if not hasattr(processor, "encode"):
        inputs = as_image_inputs(processor, model.config.tokens_per_image, tokenizer)
        processor = ChatProcessor(tokenizer, inputs, model.config.image_position)
    for start in range(0, len(records), batch_size):
        if stopped is not None and stopped():
            break
        chunk = records[start : start + batch_size]
        encoded = [processor.encode(r["texts"][0]["user"], r["images"], r.get("video")) for r in chunk]
        ids, mask = left_pad([prompt for prompt, _ in encoded], tokenizer.pad_token_id)
        pixels = [p for _, p in encoded if p is not None]
        images = torch.cat(pixels).to(device) if pixels else None
        room = model.config.language.max_position_embeddings - ids.shape[1]
        tokens = model.generate(ids.to(device), images, mask.to(device),
                                max_new_tokens=min(max_new_tokens, room), greedy=True,
                                eos_token_id=model.config.stop_ids, pad_token_id=tokenizer.pad_token_id)
        answers += tokenizer.batch_decode(tokens.tolist(), skip_special_tokens=True)
    return answers


def exact_match(records: list[dict], predictions: list[str]) -> dict[str, float]:
    """Accuracy per question type, and `accuracy` over every question that is not a caption."""
    hits: dict[str, list[bool]] = defaultdict(list)
    for record, prediction in zip(records, predictions):
        right = normalize(prediction) == normalize(record["texts"][0]["assistant"])
        hits[record.get("question_type") or "question"].append(right)
    scores = {f"accuracy/{kind}": sum(h) / len(h) for kind, h in sorted(hits.items())}
    questions = [h for kind, values in hits.items() if kind != "caption" for h in values]
    if questions:
        scores["accuracy"] = sum(questions) / len(questions)
    scores["num_questions"] = len(questions)
    return scores


def save_loss_curve(train: list[tuple[int, float]], validation: list[tuple[int, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    axes.plot(*zip(*train), label="train", linewidth=1)
    if validation:
        axes.plot(*zip(*validation), "o-", label="validation")
    axes.set(xlabel="step", ylabel="loss", yscale="log", title="tinyvlm training loss")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def save_prediction_grid(records: list[dict], predictions: list[str], path: Path, columns: int = 4) -> None:
    """Held-out images with question, expected answer and prediction (green when right, red when wrong).
    Titles are wrapped to their column, and each row of the figure is as tall as its longest title needs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    titles = [_title(record["texts"][0], prediction) for record, prediction in zip(records, predictions)]
    rows = (len(titles) + columns - 1) // columns
    heights = [
        CELL_INCHES
        + TITLE_LINE_INCHES * max(t.count("\n") + 1 for t in titles[r * columns : (r + 1) * columns])
        for r in range(rows)
    ]
    figure, axes = plt.subplots(
        rows,
        columns,
        figsize=(CELL_INCHES * columns, sum(heights)),
        dpi=110,
        squeeze=False,
        gridspec_kw={"height_ratios": heights},
    )
    # room for every title above its own image, none overlapping
    figure.set_layout_engine("constrained", h_pad=0.1)
    for ax in axes.flat:
        ax.axis("off")
    for ax, record, prediction, title in zip(axes.flat, records, predictions, titles):
        if record["images"] or record.get("video"):  # a clip: its last frame
            ax.imshow(record["images"][0] if record["images"] else record["video"].frames[-1])
        right = normalize(prediction) == normalize(record["texts"][0]["assistant"])
        # parse_math off: a "$" in a question or answer (chartqa's "$5") is text, not the start of mathtext
        ax.set_title(title, fontsize=TITLE_POINTS, color="green" if right else "red", parse_math=False)
    figure.savefig(path)
    plt.close(figure)


def _title(turn: dict[str, str], prediction: str) -> str:
    parts = (f"Q: {turn['user']}", f"expected: {turn['assistant']}", f"predicted: {prediction}")
    return "\n".join(textwrap.fill(part, TITLE_CHARS) for part in parts)
