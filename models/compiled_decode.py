"""What `generate(compile=True)` runs through torch.compile: the shape-static decode step and the prefill.

The decode step as gpt-fast and CUDA-graph servers do it: the position lives in a device tensor and attention
spans the whole preallocated cache under a mask, so every step of a call has one shape; the cache's capacity
is rounded up to `CACHE_BUCKET` tokens and the batch to a power of two (padded rows are masked out and
dropped), so a process that sees many prompt lengths and batch sizes compiles a handful of graphs (CUDA graphs
on a GPU). The prefill (image + prompt into the cache) is compiled with its sizes symbolic (prompt length,
batch, images, capacity), without CUDA graphs: new prompts reuse its graphs (a size of 1, and calls with or
without a mask or images, take their own). Past dynamo's recompile limit a new shape runs eagerly, with a one-
time warning, instead of failing.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from models.kv_cache import Preallocated, tensors, with_layout

CACHE_BUCKET = 256  # the cache's capacity is rounded up to a multiple of this (never past the context)


def bucket_rows(rows: int) -> int:
    """The batch size a compiled step runs at: the next power of two."""
    return 1 << (rows - 1).bit_length()


def bucket_capacity(tokens: int, context: int) -> int:
    return min(context, -(-tokens // CACHE_BUCKET) * CACHE_BUCKET)


def pad_rows(tensor: Tensor, rows: int, value: int | float = 0) -> Tensor:
    """`tensor` with rows of `value` appended along dim 0 up to `rows`."""
    missing = rows - tensor.shape[0]
    return tensor if missing == 0 else torch.cat([tensor,
                                                  tensor.new_full((missing, *tensor.shape[1:]), value)])


def shape_static(mask: Tensor | None, cache: list[dict], rows: int,
                 capacity: int) -> tuple[Tensor, list[dict]]:
    """A prefilled generation's mask [rows, capacity] and preallocated cache, padded to the rows' bucket (the
    padded rows masked out) and marked shape-static: the inputs the compiled step takes every decode step."""
    bucket, device = bucket_rows(rows), cache[0]["key"].device
    mask = pad_rows(torch.ones(rows, capacity, dtype=torch.long, device=device) if mask is None else mask,
                    bucket)
    cache = with_layout([{name: pad_rows(t, bucket) for name, t in tensors(block_cache).items()}
                         for block_cache in cache], Preallocated(shape_static=True))
    mark_static(cache)
    return mask, cache


class CompiledCall:
    """`function` compiled with fullgraph=True (and `options`); a call whose shape (`shape_of(*args)`) the
    recompile limit refuses runs `function` itself, with a one-time warning."""

    def __init__(self, function: Callable[..., Any], what: str, shape_of: Callable[..., tuple],
                 **options: Any) -> None:
        self.function, self.what, self.shape_of = function, what, shape_of
        self.compiled = torch.compile(function, fullgraph=True, **options)
        self.eager_shapes: set[tuple] = set()
        # Imported here, not at the top: importing torch._dynamo takes ~2 s, which eager decoding need not
        # pay.
        from torch._dynamo.exc import FailOnRecompileLimitHit

        self.recompile_limit_hit = FailOnRecompileLimitHit

    def __call__(self, *args: Any) -> Any:
        shape = self.shape_of(*args)
        if shape not in self.eager_shapes:
            try:
                return self.compiled(*args)
            except self.recompile_limit_hit:
                self.eager_shapes.add(shape)
                warnings.warn(f"torch.compile's recompile limit is reached: {self.what} of shape "
                              f"{tuple(shape)} run eagerly (raise torch._dynamo.config.recompile_limit to "
                              "compile more shapes)", stacklevel=2)
        return self.function(*args)


def compiled_decode_step(step: Callable[..., Tensor], device_type: str) -> CompiledCall:
    """`step(token [B], mask [B, S], cache, position)` compiled shape-static (dynamic=False; CUDA graphs on a
    GPU)."""
    return CompiledCall(step, "decode steps (batch, cache)", lambda token, mask, cache, position: mask.shape,
                        mode="reduce-overhead" if device_type == "cuda" else None, dynamic=False)


def compiled_prefill(prefill: Callable[..., Any]) -> CompiledCall:
    """`prefill(input_ids [B, T], images [N, ...] | None, mask [B, S] | None, cache)` compiled with every size
    symbolic (dynamic=True: no marks on the caller's tensors, which the decode step then takes shape-static),
    without CUDA graphs, whose one shape a prompt would not reuse."""
    return CompiledCall(prefill, "prefills (batch, prompt, images, mask)", lambda ids, images, mask, cache: (
        *ids.shape, None if images is None else len(images), mask is not None), dynamic=True)


def mark_static(cache: list[dict[str, Tensor]]) -> None:
    """Lets CUDA graphs write the cache in place instead of copying it each step."""
    for block_cache in cache:
        for tensor in (block_cache["key"], block_cache["value"]):
            torch._dynamo.mark_static_address(tensor)
