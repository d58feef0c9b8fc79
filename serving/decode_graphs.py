"""CUDA graphs of the engine's decode forward, one per batch-size bucket, captured once at start-up.

As nano-vllm and vLLM do it: the decode step's inputs live at fixed device addresses
(serving/input_buffers.py), so a graph recorded once per bucket replays every later step of that many rows or
fewer (padded rows write to the null block); a replay is one launch where the eager forward is hundreds.
Graphs are captured largest first into one memory pool, which the smaller ones share.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from models.compiled_decode import bucket_rows


def batch_buckets(max_rows: int) -> list[int]:
    """The compiled decode step's buckets (models/compiled_decode.py `bucket_rows`: 1, 2, 4, 8, then multiples
    of 16) up to `max_rows`, and `max_rows` itself."""
    return sorted({min(bucket_rows(rows), max_rows) for rows in range(1, max_rows + 1)})


class DecodeGraphs:
    """`forward(rows)` (reading the static inputs, padded to `rows`) captured for every bucket; `run(n)`
    replays the smallest bucket that holds n rows and returns the first n rows of its output."""

    def __init__(self, forward: Callable[[int], Tensor], max_rows: int) -> None:
        self.buckets = batch_buckets(max_rows)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, Tensor] = {}
        pool = torch.cuda.graph_pool_handle()
        for rows in reversed(self.buckets):
            forward(rows)  # warm-up: kernels compiled and autotuned outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[rows] = forward(rows)
            self.graphs[rows] = graph
        torch.cuda.synchronize()

    def bucket(self, rows: int) -> int:
        return min(bucket_rows(rows), self.buckets[-1])

    def run(self, rows: int) -> Tensor:
        bucket = self.bucket(rows)
        self.graphs[bucket].replay()
        return self.outputs[bucket][:rows]
