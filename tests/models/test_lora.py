"""models/lora.py's imports: peft (which imports bitsandbytes wherever it is installed) without third-party
noise. The adapters' behaviour is tested in tests/training/test_lora.py."""

import subprocess
import sys

import pytest

ADAPT_SAVE_LOAD_MERGE = """
from pathlib import Path
from models.lora import add_adapters, load_adapter, merge_adapters, save_adapter, LANGUAGE_PROJECTIONS
from tests.models.helpers import tiny_vlm
model = tiny_vlm()
add_adapters(model, 4, 8, LANGUAGE_PROJECTIONS)
save_adapter(model, Path({directory!r}), base="base")
other = tiny_vlm()
load_adapter(other, Path({directory!r}))
merge_adapters(other)
"""


def _stderr(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stderr


def test_lora_prints_no_bitsandbytes_warning(tmp_path):
    """Regression: every LoRA command printed bitsandbytes' "Failed to load CPU gemm_4bit_forward ... pip
    install kernels" (logged when peft imports it on a CPU with AVX512-BF16), about a kernel LoRA never
    uses."""
    if "gemm_4bit_forward" not in _stderr("import peft"):
        pytest.skip("bitsandbytes logs nothing on import here (not installed, or this CPU lacks AVX512-BF16)")
    stderr = _stderr(ADAPT_SAVE_LOAD_MERGE.format(directory=str(tmp_path / "adapter")))
    assert "gemm_4bit_forward" not in stderr and "kernels" not in stderr, stderr


def test_lora_prints_no_torchao_pytree_warning(tmp_path):
    """Regression: with torchao installed (the quantize extra), peft imports it, and torch's pytree logged a
    deprecation warning per torchao enum on every LoRA command."""
    if "_pytree" not in _stderr("import peft"):
        pytest.skip("importing peft logs nothing from torch's pytree here (torchao not installed)")
    stderr = _stderr(ADAPT_SAVE_LOAD_MERGE.format(directory=str(tmp_path / "adapter")))
    assert "_pytree" not in stderr and "Enum subclass" not in stderr, stderr
