"""The tinyvlm_shapes tasks' document functions: a document is a line of evaluation/shapes_task.py's
test.jsonl."""

from PIL import Image

from training.evaluate import normalize


def doc_to_visual(doc: dict) -> list[Image.Image]:
    return [Image.open(doc["image"]).convert("RGB")]


def doc_to_text(doc: dict, lmms_eval_specific_kwargs: dict | None = None) -> str:
    return doc["question"]


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    return {"exact_match": float(normalize(results[0]) == normalize(doc["answer"]))}
