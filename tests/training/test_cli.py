"""The command lines: clear one-line errors with exit code 2, never a traceback."""

import subprocess
import sys

import pytest


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("argv, message", [
    (["train.py", "--train.bogus", "1"], "error: unknown key train.bogus"),
    (["train.py", "--config", "nope.yaml"], "error: nope.yaml: no such config file"),
    (["train.py", "--resume", "/nonexistent-run"], "error: /nonexistent-run: no checkpoint here"),
    (["generate.py", "--checkpoint", "/nonexistent-run", "--image", "README.md"], "error: README.md: "),
    (["generate.py", "--image", "missing.png"], "error: missing.png: no such file"),
    (["generate.py", "--image", "missing.png", "--prompt", "  "], "error: the prompt is empty"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message):
    result = _run(*argv)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(message), result.stderr
