"""Small records for the streaming tests (written with data/shards.py)."""

from __future__ import annotations

from PIL import Image


def tiny_records(count: int, turns: int = 1) -> list[dict]:
    """`count` records, each one 8x8 image of its own colour and `turns` question/answer pairs naming it."""
    return [{"images": [Image.new("RGB", (8, 8), (i % 256, i // 256 % 256, 7))],
             "texts": [{"user": f"What is {i}.{t}?", "assistant": f"It is {i}.{t}."} for t in range(turns)]}
            for i in range(count)]
