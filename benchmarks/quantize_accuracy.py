"""Held-out accuracy of trained runs in float32, int8 and int4 (models/quantize.py: the language model's
linears, as --quantize does), on the questions each run scored when it finished (training/results.py: the
first train.eval_questions validation records of its run_config.json, greedy, exact match), and int8's greedy
tokens against float32's on the README's two prompts (`make demo`: "What color is the circle?" and the
caption, on the run's heldout_example.png), with the logit gap where they first differ.

    python benchmarks/quantize_accuracy.py runs/tiny [runs/tiny-seed1 ...]

Each run's float32 accuracy is shown beside its metrics.json's (the same questions asked the same way).
Writes benchmarks/results/quantize-accuracy-cpu.{md,json}: each run, and min / median / max over the runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import hardware, write_result  # noqa: E402
from data import CAPTION_PROMPT, CheckedRecords  # noqa: E402
from data.sources import build_datasets, stream_sources  # noqa: E402
from loading import find_checkpoint, load_for_inference  # noqa: E402
from models.weights import read_json  # noqa: E402
from training.config import RunConfig  # noqa: E402
from training.evaluate import answer, exact_match  # noqa: E402

METHODS = (None, "int8", "int4")  # None: float32
README_PROMPTS = ("What color is the circle?", CAPTION_PROMPT)
MAX_NEW_TOKENS = 64  # generate.py's default


def heldout_records(checkpoint: Path, processor) -> list[dict]:
    """The validation records the run scored at its end: the first train.eval_questions readable ones."""
    config = RunConfig.from_json(checkpoint / "run_config.json")
    validation = (stream_sources(config.data)[1] if config.data.source == "stream"
                  else build_datasets(config.data)[1])
    records = CheckedRecords(validation, config.data.on_bad_record, "validation",
                             check_texts=processor.check_texts, video=config.model.video)
    count = min(config.train.eval_questions, len(records))
    return [record for record in map(records.__getitem__, range(count)) if record]


@torch.no_grad()
def readme_answers(model, processor, image: Image.Image) -> dict[str, list[int]]:
    """Greedy tokens for each README prompt, as generate.py asks them."""
    found = {}
    for prompt in README_PROMPTS:
        ids, pixels = processor.encode(prompt, [image])
        tokens = model.generate(torch.tensor([ids]), pixels, max_new_tokens=MAX_NEW_TOKENS, greedy=True,
                                eos_token_id=model.config.stop_ids)
        found[prompt] = tokens[0].tolist()
    return found


@torch.no_grad()
def first_divergence(model, processor, image: Image.Image, prompt: str, ours: list[int],
                     theirs: list[int]) -> dict | None:
    """Where `theirs` (int8's tokens) first leaves `ours` (float32's, from `model`): the step, and float32's
    logit of its own token minus its logit of int8's token there (the margin int8's rounding overcame)."""
    step = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if step is None:
        return None
    ids, pixels = processor.encode(prompt, [image])
    logits = model(torch.tensor([ids + ours[:step]]), pixels)[0][0, -1]
    return dict(step=step, float_token=ours[step], int8_token=theirs[step],
                gap=float(logits[ours[step]] - logits[theirs[step]]))


def measure(run: Path) -> dict:
    checkpoint = find_checkpoint(run)
    device = torch.device("cpu")
    result = dict(run=str(run), checkpoint=str(checkpoint))
    image = Image.open(run / "heldout_example.png").convert("RGB")
    tokens, records = {}, None
    for method in METHODS:
        model, processor = load_for_inference(checkpoint, device, quantization=method)
        records = records or heldout_records(checkpoint, processor)
        predictions = answer(model, processor.tokenizer, processor, records, device)
        name, scores = method or "float32", exact_match(records, predictions)
        result[name] = scores["accuracy"]
        print(f"{run}: {name} accuracy {result[name]:.4f} on {scores['num_questions']} questions", flush=True)
        if method in (None, "int8"):
            tokens[name] = readme_answers(model, processor, image)
        if method is None:
            float_model, float_processor = model, processor
    result["metrics_accuracy"] = read_json(run / "metrics.json").get("accuracy")
    result["readme"] = {prompt: dict(float32=float_processor.tokenizer.decode(tokens["float32"][prompt],
                                                                              skip_special_tokens=True),
                                     int8_equal=tokens["float32"][prompt] == tokens["int8"][prompt],
                                     divergence=first_divergence(float_model, float_processor, image, prompt,
                                                                 tokens["float32"][prompt],
                                                                 tokens["int8"][prompt]))
                        for prompt in README_PROMPTS}
    return result


def table(results: list[dict]) -> list[str]:
    title = (f"Held-out exact match, float32 / int8 / int4 (weight-only, the language model's linears); "
             f"{hardware(torch.device('cpu'))}; torch {torch.__version__}")
    lines = [f"**{title}**", "", "| run | metrics.json | float32 | int8 | int4 | int8 - float32 | "
             "int4 - float32 | README prompts: int8 tokens = float32's |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        readme = "; ".join(f"{prompt!r}: " + ("yes" if a["int8_equal"] else
                                             f"no, from step {a['divergence']['step']} "
                                             f"(float32 logit gap {a['divergence']['gap']:.3f})")
                           for prompt, a in r["readme"].items())
        lines.append(f"| {r['run']} | {r['metrics_accuracy']} | {100 * r['float32']:.2f} | "
                     f"{100 * r['int8']:.2f} | {100 * r['int4']:.2f} | "
                     f"{100 * (r['int8'] - r['float32']):+.2f} | {100 * (r['int4'] - r['float32']):+.2f} | "
                     f"{readme} |")
    if len(results) > 1:
        for name in ("float32", "int8", "int4"):
            values = [100 * r[name] for r in results]
            lines.append(f"\n{name}: min {min(values):.2f} / median {statistics.median(values):.2f} / "
                         f"max {max(values):.2f} over {len(values)} runs")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", type=Path, nargs="+", help="finished run directories (metrics.json written)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    results = [measure(run) for run in args.runs]
    write_result(args.out, "quantize-accuracy-cpu", table(results), dict(results=results))


if __name__ == "__main__":
    main()
