"""benchmarks/gpu.sh: every command it runs on a lent GPU names what exists. A benchmark's options parse with
that script's own parser, and each test file and selection it runs holds GPU tests: a renamed or mistyped flag
found here costs nothing, found there minutes of a 15-minute loan."""

import argparse
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU_SH = ROOT / "benchmarks" / "gpu.sh"


def _commands(program: str) -> list[list[str]]:
    """The argument lists gpu.sh passes to `python3 PROGRAM` (continued lines joined; $out a folder; a loop's
    $flex each of its values)."""
    text = re.sub(r"\\\n\s*", " ", GPU_SH.read_text())
    commands = []
    for line in text.splitlines():
        match = re.search(rf"python3 {re.escape(program)} (.*?)(?: 2>&1|$)", line.split("#")[0])
        if match:
            words = match.group(1).replace('"$out"', "OUT")
            for flex in ("", "--flex") if "$flex" in words else ("",):
                commands.append(shlex.split(words.replace("$flex", flex)))
    return commands


BENCHMARKS = [(script, arguments) for script in sorted({m for m in re.findall(r"python3 (benchmarks/\w+\.py)",
                                                                                GPU_SH.read_text())})
              for arguments in _commands(script)]


class _Parsed(Exception):
    """Raised once a script's options have parsed: nothing after its parse_args runs."""


@pytest.mark.parametrize("script, arguments", BENCHMARKS,
                         ids=[f"{script} {' '.join(arguments)}"[:90] for script, arguments in BENCHMARKS])
def test_each_benchmark_command_parses_with_its_scripts_options(script, arguments, monkeypatch):
    parse = argparse.ArgumentParser.parse_args

    def parse_only(parser, args=None, namespace=None):
        parse(parser, args, namespace)  # exits 2 on an unknown option or a value out of its choices
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_only)
    monkeypatch.setattr(sys, "argv", [script, *arguments])
    monkeypatch.setattr(sys, "path", list(sys.path))  # the scripts put the repository first on it
    with pytest.raises(_Parsed):
        runpy.run_path(str(ROOT / script), run_name="__main__")


def test_the_benchmark_commands_are_found():
    scripts = {script for script, _ in BENCHMARKS}
    assert {"benchmarks/serving.py", "benchmarks/decode.py", "benchmarks/train_throughput.py",
            "benchmarks/host_overhead.py", "benchmarks/quantize.py", "benchmarks/seeds.py"} <= scripts
    assert len(BENCHMARKS) >= 12 and any("--flex" in arguments for _, arguments in BENCHMARKS)


@pytest.mark.slow  # a collection each (~6 s on 2 cores)
@pytest.mark.parametrize("arguments", _commands("-m pytest"), ids=lambda a: " ".join(a)[:90])
def test_each_gpu_test_selection_collects_gpu_tests(arguments):
    """Each `pytest -m gpu FILES [-k EXPRESSION]` collects GPU tests here as it would there (they are skipped,
    not deselected, without a GPU)."""
    assert all((ROOT / word).is_file() for word in arguments if word.startswith("tests/")), arguments
    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", *arguments], cwd=ROOT,
                               capture_output=True, text=True)
    assert collected.returncode == 0 and re.search(r"\b[1-9]\d*(/\d+)? tests? collected", collected.stdout), (
        collected.stdout[-2000:], collected.stderr[-2000:])
