"""The engine's settings (serving/config.py ServingConfig), resolved from the device type, the weights' dtype
and the model's KV-cache size alone (a pure function), so that the GPU's defaults are checked on a CPU."""

import pytest
import torch

from serving.config import ServingConfig
from typed_config import ConfigError

KV_TOKEN_BYTES = 2 * 3 * 2 * 16 * 4  # keys and values of 3 layers, 2 kv heads of 16 float32s
CONTEXT = 128


def resolve(device: str, dtype: torch.dtype, max_num_seqs: int, onednn: bool = True,
            **fields) -> ServingConfig:
    return ServingConfig(max_num_seqs=max_num_seqs, **fields).resolve(
        device, dtype, kv_token_bytes=KV_TOKEN_BYTES, context=CONTEXT, onednn=onednn)


def step(settings: ServingConfig) -> dict:
    """How the runner computes a step: kernel, graphs, compile, packing, overlap, admission."""
    return {name: getattr(settings, name) for name in ("attention", "cuda_graphs", "compile_decode",
                                                       "compile_prefill", "pack_weights", "overlap",
                                                       "admission_batch")}


def test_the_default_gpu_engine_takes_the_triton_kernel_cuda_graphs_overlap_and_batched_admission():
    """Before: with attention "auto" (the engine's, the server's and lmms-eval's default) CUDA graphs tested
    the argument for "triton" instead of the resolved kernel, so the default GPU engine captured no graph
    and admitted one request at a time."""
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert step(resolve("cuda", dtype, 256)) == dict(
            attention="triton", cuda_graphs=True, compile_decode=False, compile_prefill=False,
            pack_weights=False, overlap=True, admission_batch=32)
    assert resolve("cuda", torch.bfloat16, 4).admission_batch == 1
    compiled = resolve("cuda", torch.bfloat16, 64, compile_decode=True)
    assert (compiled.attention, compiled.cuda_graphs, compiled.pack_weights) == ("triton", True, False)
    assert compiled.compile_prefill  # --compile compiles the prompt chunks too
    gathered = resolve("cuda", torch.bfloat16, 64, attention="gather")
    assert (gathered.cuda_graphs, gathered.admission_batch) == (False, 1)  # a graph gathers every context


@pytest.mark.parametrize("dtype, onednn, attention, packed", [
    (torch.float32, True, "sparse", True),
    (torch.float32, False, "sparse", False),
    (torch.float64, True, "sparse", False),
    (torch.bfloat16, True, "gather", False),
])
def test_the_cpu_defaults(dtype, onednn, attention, packed):
    assert step(resolve("cpu", dtype, 64, onednn=onednn)) == dict(
        attention=attention, cuda_graphs=False, compile_decode=False, compile_prefill=False,
        pack_weights=packed, overlap=False, admission_batch=1)
    compiled = resolve("cpu", dtype, 64, compile_decode=True, onednn=onednn)
    assert (compiled.attention, compiled.pack_weights, compiled.compile_prefill) == ("gather", False, True)
    # compiled prompt chunks alone: decode rows keep the default kernel, the linears their plain weights
    prefill = resolve("cpu", dtype, 64, compile_prefill=True, onednn=onednn)
    assert (prefill.attention, prefill.compile_decode, prefill.pack_weights) == (attention, False, False)
    assert not resolve("cpu", dtype, 64, compile_decode=True, compile_prefill=False).compile_prefill


@pytest.mark.parametrize("device, dtype, settings, message", [
    ("cpu", torch.float32, {"attention": "flash"}, "attention must be one of"),
    ("cpu", torch.float32, {"attention": "triton"}, "triton paged attention needs a CUDA device"),
    ("cpu", torch.bfloat16, {"attention": "sparse"}, "sparse paged attention needs float32 or float64"),
    ("cpu", torch.float32, {"attention": "sparse", "compile_decode": True}, "sparse paged attention needs"),
    ("cuda", torch.float32, {"attention": "sparse"}, "sparse paged attention needs"),
    ("cpu", torch.float32, {"cuda_graphs": True}, "CUDA graphs need the model on a CUDA device"),
    ("cpu", torch.float32, {"pack_weights": True, "compile_decode": True}, "pack_weights needs"),
    ("cpu", torch.float32, {"pack_weights": True, "compile_prefill": True}, "pack_weights needs"),
    ("cpu", torch.bfloat16, {"pack_weights": True}, "pack_weights needs"),
    ("cuda", torch.float32, {"pack_weights": True}, "pack_weights needs"),
])
def test_settings_that_cannot_run_there_are_refused(device, dtype, settings, message, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # which runs Triton on a CPU, for tests
    with pytest.raises(ConfigError, match=message) as refused:
        resolve(device, dtype, 64, **settings)
    assert "\n" not in str(refused.value)


def test_given_settings_are_kept():
    settings = resolve("cuda", torch.bfloat16, 64, cuda_graphs=False, admission_batch=5, num_blocks=9,
                       overlap=False)
    assert (settings.attention, settings.cuda_graphs, settings.admission_batch) == ("triton", False, 5)
    assert not settings.overlap and resolve("cpu", torch.float32, 64, overlap=True).overlap
    assert settings.num_blocks == 9


def test_the_kv_blocks_are_what_the_memory_budget_holds_at_most_max_num_seqs_full_contexts():
    """As many blocks as the budget holds, + the null block."""
    budget = resolve("cpu", torch.float32, 64, kv_cache_mib=1)
    assert budget.num_blocks == 2**20 // (KV_TOKEN_BYTES * 16) + 1
    assert resolve("cpu", torch.float32, 2, kv_cache_mib=1).num_blocks == 2 * CONTEXT // 16 + 1
    # a context of 128 spans 3 blocks of 48
    assert resolve("cpu", torch.float32, 2, kv_cache_mib=1, block_size=48).num_blocks == 2 * 3 + 1


@pytest.mark.parametrize("fields, message", [
    ({"max_num_seqs": 0}, "serving.max_num_seqs must be positive, got 0"),
    ({"num_blocks": 1}, "serving.num_blocks must be null (from kv_cache_mib) or at least 2"),
    ({"max_num_seqs": 64, "max_batch_tokens": 32}, "serving.max_batch_tokens (32) must be >= serving.max"),
    ({"max_num_seqs": 4, "admission_batch": 5}, "serving.admission_batch must be in 1..max_num_seqs (4)"),
    ({"cuda_graphs": "sometimes"}, "cuda_graphs: expected true or false, got 'sometimes'"),
    ({"attention": "flash"}, "attention: 'flash' is not one of 'auto', 'gather'"),
    ({"kv_cache_gib": 1}, "unknown key kv_cache_gib; valid keys: attention, cuda_graphs"),
])
def test_a_config_that_does_not_fit_is_one_line_naming_the_field(fields, message):
    with pytest.raises(ConfigError) as refused:
        ServingConfig.from_dict(fields)
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value)
