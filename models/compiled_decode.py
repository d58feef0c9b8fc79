"""What `generate(compile=True)` runs through torch.compile: the shape-static decode step and the prefill.

The decode step as gpt-fast and CUDA-graph servers do it: the position lives in a device tensor and attention
spans the whole preallocated cache under a mask, so every step of a call has one shape; the cache's capacity
is rounded up to `CACHE_BUCKET` tokens and the batch to a bucket (1, 2, 4, 8, then multiples of 16; padded
rows are masked out and dropped), so a process that sees many prompt lengths and batch sizes compiles a
handful of graphs (CUDA graphs on a GPU). The prefill (image + prompt into the cache) is compiled with its
sizes symbolic (prompt length, batch, images, capacity), without CUDA graphs: new prompts reuse its graphs
(a size of 1, and calls with or without a mask or images, take their own). Past dynamo's recompile limit a new
shape runs eagerly, with a one-time warning, instead of failing. The compiled functions take the model as an
argument: the model holds no compiled state.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from models.kv_cache import Preallocated, tensors, with_layout

CACHE_BUCKET = 256  # the cache's capacity is rounded up to a multiple of this (never past the context)


def bucket_rows(rows: int) -> int:
    """The batch size a compiled or graphed decode step of `rows` rows runs at: the next of 1, 2, 4, 8, then
    the next multiple of 16 (the engine's CUDA graphs take the same buckets, up to its max_num_seqs)."""
    return 1 << (rows - 1).bit_length() if rows <= 8 else -(-rows // 16) * 16


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


def _decode_step(model: nn.Module, token: Tensor, mask: Tensor, cache: list[dict],
                 position: Tensor) -> Tensor:
    return model.decode_step(token, mask, cache, position)


def _prefill(model: nn.Module, input_ids: Tensor, images: Tensor | None, mask: Tensor | None,
             cache: list[dict]) -> tuple[Tensor, Tensor]:
    return model.prefill_logits(input_ids, images, mask, cache)


_COMPILED: dict[tuple[str, str], CompiledCall] = {}  # per (step, device type), for every model


def compiled_step(name: str, device_type: str) -> CompiledCall:
    """gpt-fast's `torch.compile(decode_one_token)`: a function of the model and its inputs, compiled once
    per process and device type, not state of the model (its parameters are the graph's inputs, so copies
    and reloaded weights decode with their own). "decode": `(model, token [B], mask [B, S], cache, position)`
    shape-static (dynamic=False; CUDA graphs on a GPU). "prefill": `(model, input_ids [B, T], images | None,
    mask [B, S] | None, cache)` with every size symbolic (dynamic=True: no marks on the caller's tensors,
    which the decode step then takes shape-static), without CUDA graphs, whose one shape a prompt would not
    reuse."""
    key = (name, device_type)
    if key not in _COMPILED:
        if name == "decode":
            _COMPILED[key] = CompiledCall(_decode_step, "decode steps (batch, cache)",
                                          lambda model, token, mask, cache, position: mask.shape,
                                          mode="reduce-overhead" if device_type == "cuda" else None,
                                          dynamic=False)
        else:
            _COMPILED[key] = CompiledCall(_prefill, "prefills (batch, prompt, images, mask)",
                                          lambda model, ids, images, mask, cache: (
                                              *ids.shape, None if images is None else len(images),
                                              mask is not None), dynamic=True)
    return _COMPILED[key]


def mark_static(cache: list[dict[str, Tensor]]) -> None:
    """Lets CUDA graphs write the cache in place instead of copying it each step."""
    for block_cache in cache:
        for tensor in (block_cache["key"], block_cache["value"]):
            torch._dynamo.mark_static_address(tensor)
