"""Typed configuration: dataclasses that validate themselves, for every package (the model's configs in
models/config.py, data/, training/ and serving/ settings).

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
    """An error's text on one line (whitespace runs collapsed), cut at `limit` characters, for one-line CLI
    errors."""
    text = " ".join(str(error).split()) or (type(error).__name__ if isinstance(error, BaseException) else "")
    return text[:limit]


_TRUE, _FALSE = {"true", "yes", "on", "1"}, {"false", "no", "off", "0"}


def coerce(value: Any, annotation: Any, name: str) -> Any:
    """Return `value` as the type `annotation` names, parsing strings (CLI overrides); raise ConfigError
    otherwise."""
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
            raise ConfigError(f"unknown key {prefix}{unknown[0]}; valid keys: "
                              f"{', '.join(prefix + n for n in names)}")
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
        """Copy with dotted keys set (`{"language.num_layers": "4"}`); values may be strings; result is
        validated."""
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
    """A line per setting of `config` and its nested configs: `--section.field TYPE (= value)  description`,
    the description being the first sentence of the field's comment in its class (see `field_comments`)."""
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
            yield (
                prefix + field.name,
                _type_name(hints[field.name]),
                shown,
                _first_sentence(comments.get(field.name)),
            )


def _first_sentence(text: str | None, limit: int = 110) -> str:
    """Up to the first full stop that a capital follows (or the end), cut at a word within `limit`
    characters."""
    sentence = re.split(r"(?<=[\w)])\.(?:\s+(?=[A-Z])|$)", text or "", maxsplit=1)[0]
    return sentence if len(sentence) <= limit else sentence[: sentence.rfind(" ", 0, limit)] + " ..."


def _type_name(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (Union, types.UnionType):
        return "|".join(_type_name(arg) for arg in args if arg is not type(None)) + (
            "|null" if type(None) in args else "")
    if origin is Literal:
        return "|".join(map(str, args))
    if origin in (tuple, list):
        return f"list[{_type_name(args[0])}]"
    return {bool: "true|false", str: "text"}.get(annotation, getattr(annotation, "__name__", str(annotation)))


def field_comments(cls: type) -> dict[str, str]:
    """Each field's comment in the source of dataclass `cls`: the comment that ends its line, else the comment
    lines just above it."""
    source = inspect.getsource(cls)
    indent = len(source) - len(source.lstrip()) + 4  # the class body's
    comments = {
        token.start[0]: (token.start[1], token.string.lstrip("#").strip())
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
    }
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
