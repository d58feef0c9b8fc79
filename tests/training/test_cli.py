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


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A one-step checkpoint of the small config, and a held-out image to ask about."""
    from tests.training.helpers import small_config
    from training.run import train

    run = tmp_path_factory.mktemp("run")
    train(small_config(run, **{"train.max_steps": "1", "train.save_every": "1", "train.eval_every": "1"}))
    return run / "step_000001", run / "heldout_example.png"


def _generate(capsys, *argv: str) -> tuple[int, str, str]:
    import generate

    code = generate.main(["--max-new-tokens", "4", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("extra, message", [
    (["--prompt", "word " * 300], "error: prompt ("),  # longer than the 256-token context
    (["--max-new-tokens", "100000"], "error: prompt ("),
    (["--temperature", "-1"], "error: temperature must be >= 0"),
    (["--top-p", "1.5"], "error: top_p must lie in (0, 1]"),
    (["--top-k", "-3"], "error: top_k must be >= 0"),
    (["--num-samples", "0"], "error: max_new_tokens and num_samples must be >= 1"),
    # how Python decodes invalid argv bytes
    (["--prompt", "caf\udcc3 au lait"], "error: the text is not valid UTF-8"),
])
def test_generate_settings_that_cannot_work_are_one_line_errors(checkpoint, capsys, extra, message):
    directory, image = checkpoint
    code, _, err = _generate(capsys, "--checkpoint", str(directory), "--image", str(image), *extra)
    assert code == 2 and err.strip().splitlines()[-1].startswith(message), err


def test_generate_refuses_a_truncated_checkpoint_and_a_corrupt_image(checkpoint, capsys, tmp_path):
    directory, image = checkpoint
    corrupt = tmp_path / "corrupt.png"
    corrupt.write_bytes(image.read_bytes()[:60])
    code, _, err = _generate(capsys, "--checkpoint", str(directory), "--image", str(corrupt))
    assert code == 2 and "corrupt or truncated image" in err.strip().splitlines()[-1]
    broken = tmp_path / "broken"
    broken.mkdir()
    for file in directory.iterdir():
        (broken / file.name).write_bytes(file.read_bytes())
    (broken / "model.safetensors").write_bytes((directory / "model.safetensors").read_bytes()[:5000])
    code, _, err = _generate(capsys, "--checkpoint", str(broken), "--image", str(image))
    assert code == 2 and "unreadable or truncated safetensors" in err.strip().splitlines()[-1]


def test_a_typed_image_token_is_accepted_as_text(checkpoint, capsys):
    """20 typed placeholders would break the image splice (16 image tokens expected) if they became image
    tokens."""
    directory, image = checkpoint
    code, out, err = _generate(capsys, "--checkpoint", str(directory), "--image", str(image),
                               "--prompt", "<|image|> " * 20)
    assert code == 0 and "error" not in err, err


def test_invalid_utf8_bytes_on_the_real_command_line(checkpoint):
    directory, image = checkpoint
    result = subprocess.run([sys.executable, "generate.py", "--checkpoint", str(directory), "--image",
                             str(image), "--prompt", b"caf\xc3 au lait"], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    expected = "error: the text is not valid UTF-8 (undecodable bytes at character 3)"
    assert result.stderr.strip().splitlines()[-1] == expected


def test_max_length_beyond_the_context_is_a_one_line_error(tmp_path, capsys):
    """Samples longer than the LM's context would fail deep in a batch (rotary tables, position ids): refused
    at start."""
    from tests.training.helpers import SMALL
    from train import main

    overrides = {**SMALL, "train.output_dir": str(tmp_path), "train.max_steps": "2",
                 "train.max_length": "257"}  # tiny.yaml's context: 256
    assert main([arg for key, value in overrides.items() for arg in (f"--{key}", value)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: train.max_length (257) exceeds the language model's context "
                   "(model.language.max_position_embeddings = 256)"], err
    assert not list(tmp_path.glob("step_*"))
