"""The runner's settings, resolved from the device type and the weights' dtype alone (a pure function), so
that the GPU's defaults are checked on a CPU."""

import pytest
import torch

from serving.runner import StepSettings, resolve_step_settings


def test_the_default_gpu_engine_takes_the_triton_kernel_cuda_graphs_and_batched_admission():
    """Before: with attention "auto" (the engine's, the server's and lmms-eval's default) CUDA graphs tested
    the argument for "triton" instead of the resolved kernel, so the default GPU engine captured no graph
    and admitted one request at a time."""
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert resolve_step_settings("cuda", dtype, 256) == StepSettings(
            attention="triton", cuda_graphs=True, compile_decode=False, pack_weights=False,
            admission_batch=32)
    assert resolve_step_settings("cuda", torch.bfloat16, 4).admission_batch == 1
    compiled = resolve_step_settings("cuda", torch.bfloat16, 64, compile_decode=True)
    assert (compiled.attention, compiled.cuda_graphs, compiled.pack_weights) == ("triton", True, False)
    gathered = resolve_step_settings("cuda", torch.bfloat16, 64, attention="gather")
    assert (gathered.cuda_graphs, gathered.admission_batch) == (False, 1)  # a graph gathers every context


@pytest.mark.parametrize("dtype, onednn, attention, packed", [
    (torch.float32, True, "sparse", True),
    (torch.float32, False, "sparse", False),
    (torch.float64, True, "sparse", False),
    (torch.bfloat16, True, "gather", False),
])
def test_the_cpu_defaults(dtype, onednn, attention, packed):
    assert resolve_step_settings("cpu", dtype, 64, onednn=onednn) == StepSettings(
        attention=attention, cuda_graphs=False, compile_decode=False, pack_weights=packed, admission_batch=1)
    compiled = resolve_step_settings("cpu", dtype, 64, compile_decode=True, onednn=onednn)
    assert (compiled.attention, compiled.pack_weights) == ("gather", False)


@pytest.mark.parametrize("device, dtype, settings, message", [
    ("cpu", torch.float32, {"attention": "flash"}, "attention must be one of"),
    ("cpu", torch.float32, {"attention": "triton"}, "triton paged attention needs a CUDA device"),
    ("cpu", torch.bfloat16, {"attention": "sparse"}, "sparse paged attention needs float32 or float64"),
    ("cpu", torch.float32, {"attention": "sparse", "compile_decode": True}, "sparse paged attention needs"),
    ("cuda", torch.float32, {"attention": "sparse"}, "sparse paged attention needs"),
    ("cpu", torch.float32, {"cuda_graphs": True}, "CUDA graphs need the model on a CUDA device"),
    ("cpu", torch.float32, {"pack_weights": True, "compile_decode": True}, "pack_weights needs"),
    ("cpu", torch.bfloat16, {"pack_weights": True}, "pack_weights needs"),
    ("cuda", torch.float32, {"pack_weights": True}, "pack_weights needs"),
])
def test_settings_that_cannot_run_there_are_refused(device, dtype, settings, message, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # which runs Triton on a CPU, for tests
    with pytest.raises(ValueError, match=message):
        resolve_step_settings(device, dtype, 64, **settings)


def test_given_settings_are_kept():
    settings = resolve_step_settings("cuda", torch.bfloat16, 64, cuda_graphs=False, admission_batch=5)
    assert (settings.attention, settings.cuda_graphs, settings.admission_batch) == ("triton", False, 5)
