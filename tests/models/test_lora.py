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


def test_lora_prints_no_import_noise(tmp_path):
    """Regressions: every LoRA command printed bitsandbytes' "Failed to load CPU gemm_4bit_forward ... pip
    install kernels" (logged when peft imports it on a CPU with AVX512-BF16), about a kernel LoRA never uses;
    and, with torchao installed (the quantize extra), which peft imports, torch's pytree deprecation warning
    for each torchao enum."""
    noise = _stderr("import peft")
    logged = [words for words in (("gemm_4bit_forward", "kernels"), ("_pytree", "Enum subclass"))
              if words[0] in noise]
    if not logged:
        pytest.skip("importing peft logs nothing here (bitsandbytes and torchao not installed, or quiet)")
    stderr = _stderr(ADAPT_SAVE_LOAD_MERGE.format(directory=str(tmp_path / "adapter")))
    assert not any(word in stderr for words in logged for word in words), stderr
