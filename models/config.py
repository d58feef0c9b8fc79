"""Typed configs for the vision tower, projector, language model and VLM.

Every config validates itself on construction and raises `ConfigError` with a message that names the field.
`Config.from_dict` checks keys and types (nested configs included); `to_dict` / `from_dict` round-trip through
`config.json`; `replace` sets fields from `section.field=value` strings (the CLI's `--section.field VALUE`);
`settings_help` lists every field with its type, value and the comment its class gives it (`train.py --help`).
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import json
import re
import tokenize
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

from models.errors import TinyVLMError

T = TypeVar("T", bound="Config")


class ConfigError(TinyVLMError, ValueError):
    """An unknown key, a value of the wrong type, or values that do not fit together."""


def check(condition: bool, message: str) -> None:
    """Raise `ConfigError(message)` unless `condition` holds."""
    if not condition:
        raise ConfigError(message)


def one_line(error: BaseException | str, limit: int = 500) -> str:
    """An error's text on one line (whitespace runs collapsed), cut at `limit` characters, for one-line CLI errors."""
    text = " ".join(str(error).split()) or (type(error).__name__ if isinstance(error, BaseException) else "")
    return text[:limit]


_TRUE, _FALSE = {"true", "yes", "on", "1"}, {"false", "no", "off", "0"}


def coerce(value: Any, annotation: Any, name: str) -> Any:
    """Return `value` as the type `annotation` names, parsing strings (CLI overrides); raise ConfigError otherwise."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            check(type(None) in args, f"{name}: may not be null")
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return coerce(value, arg, name)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{name}: {value!r} fits none of {annotation}")
    if origin is Literal:
        check(value in args, f"{name}: {value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if origin in (tuple, list):
        if isinstance(value, str):
            value = [v.strip() for v in value.strip("[]()").split(",") if v.strip()]
        check(isinstance(value, (list, tuple)), f"{name}: expected a list, got {value!r}")
        item_type = args[0] if args else Any
        items = [coerce(v, item_type, f"{name}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if dataclasses.is_dataclass(annotation):
        check(isinstance(value, dict), f"{name}: expected a mapping of fields, got {value!r}")
        return annotation.from_dict(value, prefix=f"{name}.")
    if annotation is Any:
        return value
    if annotation is bool:
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        check(isinstance(value, bool), f"{name}: expected true or false, got {value!r}")
        return value
    if annotation in (int, float):
        if isinstance(value, str):
            try:
                value = annotation(value)
            except ValueError:
                raise ConfigError(f"{name}: expected {annotation.__name__}, got {value!r}") from None
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        check(ok and (annotation is float or float(value).is_integer()),
              f"{name}: expected {annotation.__name__}, got {value!r}")
        return annotation(value)
    if annotation is str:
        check(isinstance(value, str), f"{name}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{name}: unsupported field type {annotation}")


class Config:
    """Base for config dataclasses: checked construction from dicts, JSON round trip, dotted overrides."""

    @classmethod
    def from_dict(cls: type[T], values: dict[str, Any], prefix: str = "") -> T:
        hints = typing.get_type_hints(cls)
        names = [f.name for f in dataclasses.fields(cls) if f.init]
        unknown = sorted(set(values) - set(names))
        if unknown:
            raise ConfigError(f"unknown key {prefix}{unknown[0]}; valid keys: {', '.join(prefix + n for n in names)}")
        return cls(**{k: coerce(v, hints[k], prefix + k) for k, v in values.items()})

    def check_at_least(self, section: str, minimum: float, names: tuple[str, ...]) -> None:
        """ConfigError unless every named field is >= minimum (minimum 1 for counts means "positive")."""
        for name in names:
            value = getattr(self, name)
            check(value >= minimum,
                  f"{section}.{name} must be {'positive' if minimum == 1 else f'>= {minimum}'}, got {value}")

    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(dataclasses.asdict(self)))  # tuples -> lists, as JSON holds them

    @classmethod
    def from_json(cls: type[T], path: str | Path) -> T:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None

    def save_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    def replace(self: T, overrides: dict[str, Any]) -> T:
        """Copy with dotted keys set (`{"language.num_layers": "4"}`); values may be strings; result is validated."""
        values = self.to_dict()
        for key, value in overrides.items():
            node, parts = values, key.split(".")
            for i, part in enumerate(parts):
                section = ".".join(parts[:i])
                if part not in node or (i < len(parts) - 1 and not isinstance(node[part], dict)):
                    valid = ", ".join(f"{section}.{k}" if section else k for k in node)
                    raise ConfigError(f"unknown key {'.'.join(parts[: i + 1])}; valid keys: {valid}")
                if i < len(parts) - 1:
                    node = node[part]
            node[parts[-1]] = value
        return type(self).from_dict(values)


def settings_help(config: Config) -> list[str]:
    """A line per setting of `config` and its nested configs: `--section.field TYPE (= value)  description`, the
    description being the first sentence of the field's comment in its class (see `field_comments`)."""
    rows = list(_settings(config, ""))
    width = max(len(f"--{name} {kind}") for name, kind, _, _ in rows)
    return [f"  {f'--{name} {kind}':<{width}}  (= {value})  {text}" for name, kind, value, text in rows]


def _settings(config: Config, prefix: str):
    hints, comments = typing.get_type_hints(type(config)), field_comments(type(config))
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if isinstance(value, Config):
            yield from _settings(value, f"{prefix}{field.name}.")
        else:
            shown = json.dumps(list(value) if isinstance(value, tuple) else value)
            yield prefix + field.name, _type_name(hints[field.name]), shown, _first_sentence(comments.get(field.name))


def _first_sentence(text: str | None, limit: int = 110) -> str:
    """Up to the first full stop that a capital follows (or the end), cut at a word within `limit` characters."""
    sentence = re.split(r"(?<=[\w)])\.(?:\s+(?=[A-Z])|$)", text or "", maxsplit=1)[0]
    return sentence if len(sentence) <= limit else sentence[: sentence.rfind(" ", 0, limit)] + " ..."


def _type_name(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (Union, types.UnionType):
        return "|".join(_type_name(arg) for arg in args if arg is not type(None)) + "|null"
    if origin is Literal:
        return "|".join(map(str, args))
    if origin in (tuple, list):
        return f"list[{_type_name(args[0])}]"
    return {bool: "true|false", str: "text"}.get(annotation, getattr(annotation, "__name__", str(annotation)))


def field_comments(cls: type) -> dict[str, str]:
    """Each field's comment in the source of dataclass `cls`: the comment that ends its line, else the comment lines
    just above it."""
    source = inspect.getsource(cls)
    indent = len(source) - len(source.lstrip()) + 4  # the class body's
    comments = {token.start[0]: (token.start[1], token.string.lstrip("#").strip())
                for token in tokenize.generate_tokens(io.StringIO(source).readline) if token.type == tokenize.COMMENT}
    names, found = {field.name for field in dataclasses.fields(cls)}, {}
    for number, line in enumerate(source.splitlines(), 1):
        match = re.match(rf" {{{indent}}}(\w+)\s*:", line)
        if not match or match.group(1) not in names:
            continue
        column, text = comments.get(number, (0, ""))
        if column <= indent:  # no comment at the end of the line: the block just above
            above, row = [], number - 1
            while comments.get(row, (0, ""))[0] == indent:
                above.insert(0, comments[row][1])
                row -= 1
            text = " ".join(above)
        found[match.group(1)] = text
    return found


ImagePosition = Literal["before_text", "after_text"]


@dataclasses.dataclass
class VisionConfig(Config):
    """A SigLIP-style ViT (defaults: SigLIP-B/16 at 224 px)."""

    image_size: int = 224  # input side in pixels (images are resized to it; one tile when splitting)
    patch_size: int = 16  # side of a square patch in pixels: (image_size / patch_size)^2 patch tokens
    hidden_size: int = 768  # width of the ViT's tokens
    intermediate_size: int = 3072  # width of each MLP's hidden layer
    num_layers: int = 12  # transformer blocks
    num_heads: int = 12  # attention heads per block
    num_channels: int = 3  # colour channels of the input
    layer_norm_eps: float = 1e-6  # epsilon of each LayerNorm
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)  # per-channel mean subtracted from pixels in [0, 1]
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)  # per-channel standard deviation the pixels are divided by
    pretrained: str | None = None  # SigLIP checkpoint to load: local directory or hub id

    def __post_init__(self) -> None:
        self.check_at_least("vision", 1, ("image_size", "patch_size", "hidden_size", "intermediate_size", "num_layers",
                                          "num_heads", "num_channels"))
        check(self.image_size % self.patch_size == 0,
              f"vision.image_size ({self.image_size}) must be divisible by vision.patch_size ({self.patch_size})")
        check(self.hidden_size % self.num_heads == 0,
              f"vision.hidden_size ({self.hidden_size}) must be divisible by vision.num_heads ({self.num_heads})")
        check(len(self.image_mean) == len(self.image_std) == self.num_channels,
              f"vision.image_mean and vision.image_std need {self.num_channels} values each")
        check(all(s > 0 for s in self.image_std), "vision.image_std values must be positive")

    @property
    def grid_size(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.grid_size**2


@dataclasses.dataclass
class ProjectorConfig(Config):
    """Pixel shuffle by `pixel_shuffle_factor` (fewer, wider patch tokens), then a linear map to the LM width, plus
    (with `position_embedding`) a learned embedding per image token, which tells the LM where each token came from."""

    pixel_shuffle_factor: int = 2  # merge factor x factor neighbouring patches into one image token
    position_embedding: bool = False  # add a learned embedding per image token (which cell it shows)

    def __post_init__(self) -> None:
        check(self.pixel_shuffle_factor >= 1,
              f"projector.pixel_shuffle_factor must be >= 1, got {self.pixel_shuffle_factor}")


SplitLayout = Literal["idefics3", "nanovlm"]
Resample = Literal["lanczos", "bicubic", "bilinear"]


@dataclasses.dataclass
class SplitConfig(Config):
    """Image splitting (SmolVLM / Idefics3, nanoVLM): an image is resized so that its longer side is `max_image_size`,
    then up to whole multiples of the encoder's `vision.image_size`, cut into that grid of tiles, and shown with one
    extra tile-sized global (downscaled) image; each tile's tokens are marked in the prompt with its row and column.
    `layout` names whose order and marker tokens are used: "idefics3" (tiles row by row, then the global image;
    `<fake_token_around_image>`, `<row_R_col_C>`, `<global-img>`) or "nanovlm" (the global image, then the tiles;
    nanoVLM's `global_image_token` and `rRcC` tokens). Disabled: one square resize per image."""

    enabled: bool = False  # split images into tiles plus a global image (else one square resize)
    max_image_size: int = 1536  # the longer side an image is resized to before it is cut into tiles
    layout: SplitLayout = "idefics3"  # whose tile order and marker tokens: idefics3 or nanovlm
    resample: Resample = "lanczos"  # the resizing filter

    def __post_init__(self) -> None:
        self.check_at_least("splitting", 1, ("max_image_size",))


@dataclasses.dataclass
class LanguageConfig(Config):
    """A Llama-style decoder (defaults: SmolLM2-135M)."""

    vocab_size: int = 49152  # token embeddings (training sets it from the tokenizer)
    hidden_size: int = 576  # width of the residual stream
    intermediate_size: int = 1536  # width of each SwiGLU MLP's hidden layer
    num_layers: int = 30  # decoder blocks
    num_heads: int = 9  # query heads per block
    num_kv_heads: int = 3  # key/value heads per block (grouped-query attention: num_heads / num_kv_heads share one)
    max_position_embeddings: int = 8192  # the context length
    rope_theta: float = 100000.0  # base of the rotary position embedding's frequencies
    rms_norm_eps: float = 1e-5  # epsilon of each RMSNorm
    tie_word_embeddings: bool = True  # the output head reuses the token embedding matrix
    eos_token_id: int | None = None  # the tokenizer's end-of-sequence id (training sets it from the tokenizer)
    pretrained: str | None = None  # Llama checkpoint: local directory, hub id, .gguf path or package://pkg/file.gguf

    def __post_init__(self) -> None:
        self.check_at_least("language", 1, ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                                            "num_kv_heads", "max_position_embeddings"))
        check(self.hidden_size % self.num_heads == 0,
              f"language.hidden_size ({self.hidden_size}) must be divisible by language.num_heads ({self.num_heads})")
        check(self.num_heads % self.num_kv_heads == 0,
              f"language.num_heads ({self.num_heads}) must be divisible by language.num_kv_heads ({self.num_kv_heads})")
        check(self.head_dim % 2 == 0, f"language head_dim ({self.head_dim}) must be even for rotary embeddings")
        check(self.rope_theta > 0 and self.rms_norm_eps > 0,
              "language.rope_theta and language.rms_norm_eps must be positive")
        check(self.eos_token_id is None or 0 <= self.eos_token_id < self.vocab_size,
              f"language.eos_token_id ({self.eos_token_id}) must lie in [0, vocab_size={self.vocab_size})")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclasses.dataclass
class VLMConfig(Config):
    """The whole model: which pieces, the id of the image placeholder token in the LM vocabulary, and where a
    prompt's image tokens go (a property of how the model was trained, so it travels with the checkpoint)."""

    vision: VisionConfig = dataclasses.field(default_factory=VisionConfig)
    projector: ProjectorConfig = dataclasses.field(default_factory=ProjectorConfig)
    language: LanguageConfig = dataclasses.field(default_factory=LanguageConfig)
    splitting: SplitConfig = dataclasses.field(default_factory=SplitConfig)
    image_token_id: int | None = None  # the image placeholder token's id (training sets it from the tokenizer)
    # before_text: image tokens open the user turn (nanoVLM, Idefics3). after_text: they close it, so that in a causal
    # LM each image token can attend to the question and the image is read with the question in mind.
    image_position: ImagePosition = "before_text"
    # Tokens that end an answer (the chat format's end of turn and the tokenizer's EOS); empty in configs written
    # before this field, where the language model's eos_token_id is used (see `stop_ids`).
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        grid, factor = self.vision.grid_size, self.projector.pixel_shuffle_factor
        check(grid % factor == 0,
              f"the patch grid ({grid}x{grid}) must be divisible by projector.pixel_shuffle_factor ({factor})")
        vocab = self.language.vocab_size
        check(self.image_token_id is None or 0 <= self.image_token_id < vocab,
              f"image_token_id ({self.image_token_id}) must lie in [0, language.vocab_size={vocab})")
        check(all(0 <= i < vocab for i in self.stop_token_ids),
              f"stop_token_ids {list(self.stop_token_ids)} must lie in [0, language.vocab_size={vocab})")
        split, tile = self.splitting, self.vision.image_size
        if split.enabled:
            check(split.max_image_size >= tile, f"splitting.max_image_size ({split.max_image_size}) must be at least "
                  f"vision.image_size ({tile}), the size of one tile")
            check(split.layout != "nanovlm" or split.max_image_size % tile == 0,
                  f"splitting.max_image_size ({split.max_image_size}) must be a multiple of vision.image_size ({tile}) "
                  f"for splitting.layout nanovlm (nanoVLM resizes the longer side to it, in whole tiles)")

    @property
    def stop_ids(self) -> list[int]:
        """The token ids generation stops at: `stop_token_ids`, else the language model's EOS (if any)."""
        if self.stop_token_ids:
            return list(self.stop_token_ids)
        return [] if self.language.eos_token_id is None else [self.language.eos_token_id]

    @property
    def tokens_per_image(self) -> int:
        return self.vision.num_patches // self.projector.pixel_shuffle_factor**2
