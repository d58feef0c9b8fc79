"""The serving engine's settings: one typed config for the engine and its runner, the server's command line,
lmms-eval's model arguments and the benchmarks. `ServingConfig.resolve` decides every "auto" and null once, at
start-up, from the model's device, dtype and KV-cache size; the engine runs on the resolved copy, which the
server prints and /health reports.

    engine = Engine(model, processor, ServingConfig(num_blocks=512, attention="gather"))
    engine.settings          # the resolved config: ServingConfig(attention='gather', cuda_graphs=False, ...)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import typing
from typing import Any, Literal

import torch

from serving.paged_layout import PAGED_LAYOUTS
from typed_config import Config, check, field_comments

ATTENTION = ("auto", *PAGED_LAYOUTS)
Attention = Literal[ATTENTION]  # "auto" or a paged kernel's name
OPTION = "serving."  # the argparse destinations of `add_arguments`: serving.FIELD


@dataclasses.dataclass(frozen=True)
class ServingConfig(Config):
    """How the engine serves: its paged attention kernel and decode fast paths, its KV cache and its batch
    limits (null and "auto": decided by `resolve` for the device and dtype)."""

    # The paged attention kernel: gather (each sequence's blocks gathered, then SDPA: exact, any device),
    # triton (one kernel over the pool in place: GPUs) or sparse (sparse kernels over the pool in place for a
    # CPU's decode rows, prompt chunks gathered); auto: triton on a GPU, sparse on a CPU with float32 or
    # float64 weights and no compile_decode, else gather.
    attention: Attention = "auto"
    # A CUDA graph of the decode step per batch bucket, captured at start-up (null: on a GPU with the triton
    # kernel; a graph of gather + SDPA would gather every row's whole context).
    cuda_graphs: bool | None = None
    # The decode forward through torch.compile, compiled at start-up before any graph capture (fewer, fused
    # kernels a step).
    compile_decode: bool = False
    # Prompt chunks' forward through torch.compile, compiled once at start-up with symbolic sizes (tokens,
    # sequences, table width; no CUDA graph): fewer kernels and a lighter host for the steps that prefill
    # (null: as compile_decode).
    compile_prefill: bool | None = None
    # The host schedules and prepares step N + 1 while the device runs step N, whose sampled ids it reads
    # after launching N + 1 (a sample that stopped at N wastes one row of N + 1; null: on a GPU, where the
    # host and the device run side by side).
    overlap: bool | None = None
    # The language model's linears through oneDNN on weights packed once (serving/packed_linear.py; as much
    # memory again): float32 weights on a CPU and an eager decode only (null: wherever they can).
    pack_weights: bool | None = None
    # Free seats that waiting requests need before they join running decodes (null: max_num_seqs / 8 with
    # CUDA graphs, else 1).
    admission_batch: int | None = None
    block_size: int = 16  # tokens per KV-cache block
    # KV-cache blocks, the null block included (null: as many as kv_cache_mib holds, at most max_num_seqs
    # sequences of the full context).
    num_blocks: int | None = None
    kv_cache_mib: int = 1024  # KV-cache memory (MiB) when num_blocks is null
    max_num_seqs: int = 64  # sequences decoded together (a request of n samples takes n)
    # Tokens a step computes at most: each decode row's one, and prompt chunks in the rest.
    max_batch_tokens: int = 512

    def __post_init__(self) -> None:
        check(self.attention in ATTENTION,
              f"serving.attention must be one of {', '.join(ATTENTION)}, got {self.attention!r}")
        self.check_at_least("serving", 1, ("block_size", "kv_cache_mib", "max_num_seqs", "max_batch_tokens"))
        check(self.num_blocks is None or self.num_blocks >= 2,
              f"serving.num_blocks must be null (from kv_cache_mib) or at least 2 (one is the null block), "
              f"got {self.num_blocks}")
        check(self.max_batch_tokens >= self.max_num_seqs,
              f"serving.max_batch_tokens ({self.max_batch_tokens}) must be >= serving.max_num_seqs "
              f"({self.max_num_seqs}): every running sequence decodes a token each step")
        check(self.admission_batch is None or 1 <= self.admission_batch <= self.max_num_seqs,
              f"serving.admission_batch must be in 1..max_num_seqs ({self.max_num_seqs}), got "
              f"{self.admission_batch}")

    def resolve(self, device_type: str, dtype: torch.dtype, *, kv_token_bytes: int, context: int,
                onednn: bool = True) -> ServingConfig:
        """This config with every "auto" and null decided, for `dtype` weights on a `device_type` device whose
        KV cache takes `kv_token_bytes` a token, sequences of up to `context` tokens and a torch build with
        oneDNN or not (`onednn`). The defaults: on a GPU the Triton kernel, CUDA graphs, overlapped steps
        and admission in batches of max_num_seqs / 8; on a CPU sparse decode attention (float32 / float64,
        eager; else gather) and, for float32 with oneDNN, prepacked linears; as many blocks as kv_cache_mib
        holds. A pure function of its arguments (and TRITON_INTERPRET, which runs Triton on a CPU for tests);
        ConfigError for settings that cannot run there or together."""
        cuda, cpu = device_type == "cuda", device_type == "cpu"
        sparse_usable = cpu and dtype in (torch.float32, torch.float64) and not self.compile_decode
        attention = self.attention
        if attention == "auto":
            attention = "triton" if cuda else "sparse" if sparse_usable else "gather"
        check(attention != "triton" or cuda or os.environ.get("TRITON_INTERPRET") == "1",
              "triton paged attention needs a CUDA device (serving.attention gather runs anywhere)")
        check(attention != "sparse" or sparse_usable,
              "sparse paged attention needs float32 or float64 weights on a CPU and an eager decode (no "
              "serving.compile_decode); serving.attention gather runs anywhere")
        cuda_graphs = self.cuda_graphs
        if cuda_graphs is None:  # gather + SDPA in a graph would gather every row's whole context
            cuda_graphs = cuda and attention == "triton"
        check(not cuda_graphs or cuda, "CUDA graphs need the model on a CUDA device")
        compile_prefill = self.compile_decode if self.compile_prefill is None else self.compile_prefill
        packable = cpu and dtype == torch.float32 and onednn
        eager = not (self.compile_decode or compile_prefill)
        pack_weights = packable and eager if self.pack_weights is None else self.pack_weights
        check(not pack_weights or (packable and eager),
              "pack_weights needs float32 weights on a CPU (in a torch built with oneDNN) and an eager "
              "forward (no serving.compile_decode or compile_prefill)")
        overlap = cuda if self.overlap is None else self.overlap
        admission_batch = self.admission_batch
        if admission_batch is None:
            admission_batch = max(1, self.max_num_seqs // 8) if cuda_graphs else 1
        num_blocks = self.num_blocks
        if num_blocks is None:  # the budget's blocks, at most max_num_seqs full contexts, + the null block
            fit = self.kv_cache_mib * 2**20 // (kv_token_bytes * self.block_size)
            num_blocks = max(min(fit, self.max_num_seqs * -(-context // self.block_size)) + 1, 2)
        return dataclasses.replace(self, attention=attention, cuda_graphs=cuda_graphs, overlap=overlap,
                                   compile_prefill=compile_prefill, pack_weights=pack_weights,
                                   admission_batch=admission_batch, num_blocks=num_blocks)

    def summary(self) -> str:
        """The settings on one line, `name=value` each (JSON values, text as it is)."""
        return " ".join(f"{name}={value if isinstance(value, str) else json.dumps(value)}"
                        for name, value in self.to_dict().items())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """An option `--field-name VALUE` for each ServingConfig field (the value parsed as the field's type, its
    comment as help), and the switches --enforce-eager (no CUDA graphs, as vLLM's) and --compile
    (compile_decode, and with it compile_prefill); `from_arguments` makes the config."""
    group = parser.add_argument_group("engine (serving/config.py ServingConfig, resolved at start-up)")
    hints, comments, defaults = typing.get_type_hints(ServingConfig), field_comments(ServingConfig), \
        ServingConfig()
    for field in dataclasses.fields(ServingConfig):
        name, hint = field.name, hints[field.name]
        literal = typing.get_origin(hint) is Literal
        group.add_argument(f"--{name.replace('_', '-')}", dest=OPTION + name,
                           choices=typing.get_args(hint) if literal else None,
                           metavar=None if literal else _metavar(hint),
                           help=f"{comments[name]} (default: {json.dumps(getattr(defaults, name))})"
                           .replace("%", "%%"))
    group.add_argument("--enforce-eager", dest=OPTION + "cuda_graphs", action="store_const", const=False,
                       help="no CUDA graphs for the decode step, as vLLM's (--cuda-graphs false)")
    group.add_argument("--compile", dest=OPTION + "compile_decode", action="store_const", const=True,
                       help="the decode forward and prompt chunks through torch.compile (--compile-decode "
                       "true)")


def from_arguments(args: argparse.Namespace) -> ServingConfig:
    """The config of the options `add_arguments` made (those not given keep their defaults); ConfigError for
    a value that does not fit its field."""
    return ServingConfig.from_dict({name.removeprefix(OPTION): value for name, value in vars(args).items()
                                    if name.startswith(OPTION) and value is not None})


def _metavar(hint: Any) -> str:
    """An option's value as --help shows it: N, true|false, with |null where the field may be null."""
    kinds = [kind for kind in typing.get_args(hint) or (hint,) if kind is not type(None)]
    shown = "|".join("true|false" if kind is bool else "N" for kind in kinds)
    return shown + ("|null" if len(kinds) < len(typing.get_args(hint)) else "")
