"""Finding and reading checkpoints: local paths, hub ids, package files; safetensors only; checked, atomic
writes."""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import re
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from models.errors import TinyVLMError

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
PICKLE_REFUSED = ("pickle files can run code and are refused; convert to safetensors, or opt in with "
                  "allow_pickle=True (--allow-pickle) to read them with torch.load(weights_only=True)")


class CheckpointError(TinyVLMError, ValueError):
    """A checkpoint that is missing, incomplete, unsafe, or does not fit the model."""


def resolve(source: str | Path, allow_patterns: list[str] | None = None) -> Path:
    """A local file or directory for `source`: a path, `package://pkg/relative/file`, or a Hugging Face hub
    id."""
    source = str(source)
    if source.startswith("package://"):
        package, _, relative = source.removeprefix("package://").partition("/")
        spec = importlib.util.find_spec(package)  # finds the package without importing it
        if spec is None or not spec.submodule_search_locations:
            raise CheckpointError(f"{source}: package {package!r} is not installed")
        path = Path(spec.submodule_search_locations[0]) / relative
        if not path.exists():
            raise CheckpointError(f"{source}: no file {relative!r} in package {package!r}")
        return path
    path = Path(source).expanduser()
    if path.exists():
        return path
    if not looks_like_hub_id(source):
        raise CheckpointError(f"{source}: no such file or directory{_siblings(path)}")
    from huggingface_hub import snapshot_download  # a hub id such as "HuggingFaceTB/SmolLM2-135M"

    try:
        return Path(snapshot_download(source, allow_patterns=allow_patterns))
    except Exception as e:  # offline, unknown repo, gated repo, ...
        raise CheckpointError(f"{source}: not a local path, and the hub could not provide it "
                              f"({type(e).__name__})") from None


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}$")  # "owner/name", as the hub allows


def looks_like_hub_id(source: str) -> bool:
    """Whether `source`, which is no local path, is meant as a hub id ("owner/name"): not a path's form, and
    its owner part is no local directory (`runs/nope` is a typo of a run, not a repository)."""
    return (HUB_ID.match(source) is not None and ".." not in source and "--" not in source
            and not Path(source.partition("/")[0]).is_dir())


def _siblings(path: Path, most: int = 8) -> str:
    """What `path`'s parent directory holds, as a hint after a typo (nothing when it does not exist)."""
    parent = path.parent
    if not parent.is_dir():
        return ""
    names = sorted(p.name for p in parent.iterdir() if not p.name.startswith("."))
    shown = ", ".join(names[:most]) + (", ..." if len(names) > most else "")
    return f" ({parent}/ holds: {shown})" if names else f" ({parent}/ is empty)"


def weight_patterns(allow_pickle: bool) -> list[str]:
    """Hub files worth downloading for a checkpoint: configs, safetensors, tokenizer files and chat templates,
    plus pickles when allowed."""
    return ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", *(["*.bin"] if allow_pickle else [])]


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"{path.parent}: missing {path.name}")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None


def read_weights(path: Path, allow_pickle: bool = False) -> dict[str, torch.Tensor]:
    """Tensors of a weights file or directory: safetensors (single or sharded with an index), never unpickled.

    Pickle files (`.bin`, `.pt`, ...) can run code when loaded, so they are refused unless `allow_pickle`, and
    even then read with `torch.load(weights_only=True)`, which only rebuilds tensors and plain containers.
    """
    if path.is_dir():
        layouts = [("model.safetensors.index.json", "model.safetensors")]
        if allow_pickle:
            layouts.append(("pytorch_model.bin.index.json", "pytorch_model.bin"))
        for index, single in layouts:
            if (path / index).is_file():
                shards = sorted(set(read_json(path / index)["weight_map"].values()))
                return {k: v for shard in shards for k, v in read_weights(path / shard, allow_pickle).items()}
            if (path / single).is_file():
                return read_weights(path / single, allow_pickle)
        pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
        hint = f" (found {', '.join(pickles)}: {PICKLE_REFUSED})" if pickles else ""
        raise CheckpointError(f"{path}: no model.safetensors{hint}")
    if not path.is_file():
        raise CheckpointError(f"{path}: missing weights file")
    if path.suffix in PICKLE_SUFFIXES:
        if not allow_pickle:
            raise CheckpointError(f"{path}: {PICKLE_REFUSED}")
        return _read_pickle(path)
    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable or truncated safetensors file ({e})") from None


def _read_pickle(path: Path) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    # weights_only met an object that is not a tensor or a plain container
    except pickle.UnpicklingError as e:
        culprit = next(
            (line for line in str(e).splitlines() if "GLOBAL" in line), "it holds objects other than tensors"
        )
        raise CheckpointError(
            f"{path}: refused by torch.load(weights_only=True): {culprit.strip()}"
        ) from None
    except (RuntimeError, OSError, EOFError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable or truncated pickle file ({type(e).__name__})") from None
    if not (isinstance(state, dict) and all(isinstance(v, torch.Tensor) for v in state.values())):
        raise CheckpointError(f"{path}: expected a state dict of tensors, got {type(state).__name__}")
    return state


def rename_keys(state_dict: dict[str, torch.Tensor], rules: list[tuple[str, str]],
                ignore: str = r"$^") -> dict[str, torch.Tensor]:
    """Apply the first matching regex rule to each key; keys matching `ignore` are dropped, others kept as
    they are."""
    renamed = {}
    for key, value in state_dict.items():
        if re.search(ignore, key):
            continue
        for pattern, replacement in rules:
            if re.match(pattern, key):
                key = re.sub(pattern, replacement, key)
                break
        renamed[key] = value
    return renamed


def _listing(names: list[str], limit: int = 5) -> str:
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def load_checked(module: nn.Module, state_dict: dict[str, torch.Tensor],
                 source: str | Path = "checkpoint") -> None:
    """Copy weights into `module`, or raise CheckpointError naming every key that is missing, unexpected
    or misshapen."""
    expected = {name: p.shape for name, p in module.state_dict().items()}
    for tied in getattr(module, "tied_weight_keys", lambda: [])():
        expected.pop(tied, None)
        state_dict = {k: v for k, v in state_dict.items() if k != tied}
    problems = []
    if missing := sorted(set(expected) - set(state_dict)):
        problems.append(f"missing keys: {_listing(missing)}")
    if unexpected := sorted(set(state_dict) - set(expected)):
        problems.append(f"unexpected keys: {_listing(unexpected)}")
    if misshapen := [f"{k} {tuple(state_dict[k].shape)} vs {tuple(s)}" for k, s in expected.items()
                     if k in state_dict and state_dict[k].shape != s]:
        problems.append(f"shape mismatch (checkpoint vs model): {_listing(misshapen)}")
    if problems:
        raise CheckpointError(f"{source}: weights do not fit the config; " + "; ".join(problems))
    module.load_state_dict(state_dict, strict=False)


def atomic_write(path: Path, write: callable) -> None:
    """Call `write(tmp_path)`, fsync, and rename over `path`: readers see the old file or the new one, never
    half. The file gets the permissions any new file gets under the umask (mkstemp's own are owner-only)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _umask() -> int:
    mask = os.umask(0)  # reading the umask means setting it: put it straight back
    os.umask(mask)
    return mask


def save_weights(module: nn.Module, path: Path) -> None:
    """Write `module`'s weights (tied copies once) as safetensors, atomically."""
    tied = set(getattr(module, "tied_weight_keys", lambda: [])())
    tensors = {k: v.detach().contiguous() for k, v in module.state_dict().items() if k not in tied}
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
