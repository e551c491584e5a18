"""Typed configuration: dataclass sections, loaded from TOML and overridden by CLI flags.

A config is a dataclass whose fields are section dataclasses (``[rollout]``, ``[algo]`` ... in TOML). Every
leaf field becomes a CLI flag ``--field-name`` (slime's names where slime has the concept), so leaf names are
unique across sections. Values are checked against the field types when they enter, and errors name the
file, line and key.
"""

import dataclasses
import re
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal

import click


class ConfigError(ValueError):
    """A configuration value or key is invalid; the message names where it came from."""


def option(default: Any, help: str, **metadata) -> Any:
    """Declare a config field with its help text (shown by ``--help``)."""
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata={"help": help, **metadata})
    return dataclasses.field(default=default, metadata={"help": help, **metadata})


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def leaf_fields(config_cls) -> dict[str, tuple[str, dataclasses.Field, type]]:
    """Map each leaf field name to (section name, field, resolved type) and check names are unique."""
    leaves: dict[str, tuple[str, dataclasses.Field, type]] = {}
    for section in dataclasses.fields(config_cls):
        section_cls = section.type
        hints = typing.get_type_hints(section_cls)
        for leaf in dataclasses.fields(section_cls):
            if leaf.name in leaves:
                raise TypeError(f"config field '{leaf.name}' appears in sections "
                                f"'{leaves[leaf.name][0]}' and '{section.name}'")
            leaves[leaf.name] = (section.name, leaf, hints[leaf.name])
    return leaves


def _optional_inner(kind: Any) -> Any:
    """``X`` for ``X | None``, else ``kind``."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return next(a for a in typing.get_args(kind) if a is not type(None))
    return kind


class CommaList(click.ParamType):
    """A command-line list: ``a,b,c``, each item parsed with ``item`` (an empty string is the empty list)."""

    def __init__(self, item: click.ParamType):
        self.item = item
        self.name = f"{item.name},..."

    def convert(self, value, param, ctx):
        if isinstance(value, list):
            return value
        return [self.item.convert(v, param, ctx) for v in value.split(",") if v]


def flag_type(kind: Any) -> click.ParamType:
    """The click type that parses a command-line string into a value of the field type ``kind``."""
    kind = _optional_inner(kind)
    if typing.get_origin(kind) is Literal:
        return click.Choice(typing.get_args(kind))
    if typing.get_origin(kind) in (list, tuple):
        return CommaList(flag_type(typing.get_args(kind)[0]))
    types_ = {bool: click.BOOL, int: click.INT, float: click.FLOAT, str: click.STRING}
    if kind not in types_:
        raise TypeError(f"unsupported config type {kind!r}")
    return types_[kind]


def parse_flag(value: str, kind: Any, where: str) -> Any:
    """A command-line string as a value of ``kind`` (click's parsing, the CLI's), checked by ``coerce``."""
    try:
        parsed = flag_type(kind).convert(value, None, None)
    except click.BadParameter as exc:
        raise ConfigError(f"{where}: {exc.message}") from None
    return coerce(parsed, kind, where)


def coerce(value: Any, kind: Any, where: str) -> Any:
    """Check ``value`` (as TOML typed it, or parsed by ``parse_flag``) against the annotation ``kind``; return
    it typed. Strings are not numbers here: ``"25"`` for an integer key is refused like ``"25x"``."""
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(kind):
            return None
        return coerce(value, _optional_inner(kind), where)
    if origin is Literal:
        choices = typing.get_args(kind)
        if value not in choices:
            raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(repr, choices))}")
        return value
    if origin in (list, tuple):
        (inner,) = typing.get_args(kind)[:1]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__} {value!r}")
        return [coerce(v, inner, f"{where}[{i}]") for i, v in enumerate(value)]
    if kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true/false, got {type(value).__name__} {value!r}")
        return value
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {type(value).__name__} {value!r}")
        return value
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {type(value).__name__} {value!r}")
        return float(value)
    if kind is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {type(value).__name__} {value!r}")
        return value
    raise TypeError(f"unsupported config type {kind!r} at {where}")


def _line_of(text: str, section: str | None, key: str) -> int | None:
    """1-based line of ``key = ...`` inside ``[section]`` of a TOML text (None when not found)."""
    current = None
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        header = re.fullmatch(r"\[\s*([A-Za-z0-9_.-]+)\s*\]", stripped)
        if header:
            current = header.group(1)
        elif current == section and re.match(rf"{re.escape(key)}\s*=", stripped):
            return number
    return None


def _where(path: Path, text: str, section: str | None, key: str) -> str:
    line = _line_of(text, section, key)
    location = f"{path}:{line}" if line else str(path)
    return f"{location}: [{section}] {key}" if section else f"{location}: {key}"


def load_toml(config_cls, path: str | Path):
    """Read a TOML file into ``config_cls``; unknown sections/keys and mistyped values raise ConfigError."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    text = path.read_text(encoding="utf-8")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    return from_mapping(config_cls, data, source=(path, text))


def from_mapping(config_cls, data: dict, source: tuple[Path, str] | None = None):
    """Build ``config_cls`` from ``{section: {key: value}}``; ``source`` (path, text) is used in errors."""
    path, text = source if source else (Path("<mapping>"), "")
    sections = {f.name: f for f in dataclasses.fields(config_cls)}
    built = {}
    for name, values in data.items():
        if name not in sections:
            raise ConfigError(f"{path}: unknown section [{name}]; known sections: {', '.join(sections)}")
        if not isinstance(values, dict):
            raise ConfigError(f"{_where(path, text, None, name)}: expected a [{name}] table")
        section_cls = sections[name].type
        hints = typing.get_type_hints(section_cls)
        known = {f.name for f in dataclasses.fields(section_cls)}
        kwargs = {}
        for key, value in values.items():
            where = _where(path, text, name, key)
            if key not in known:
                close = [k for k in known if k.replace("_", "") == key.replace("-", "").replace("_", "")]
                hint = f" (did you mean '{close[0]}'?)" if close else ""
                raise ConfigError(f"{where}: unknown key{hint}")
            kwargs[key] = coerce(value, hints[key], where)
        built[name] = section_cls(**kwargs)
    return config_cls(**built)


def apply_overrides(config, overrides: dict[str, Any], source: str = "command line"):
    """Return a copy of ``config`` with leaf fields replaced: strings are parsed as the command line parses
    them (``"64"`` for an integer flag), typed values are checked like TOML values."""
    leaves = leaf_fields(type(config))
    changes: dict[str, dict[str, Any]] = {}
    for key, value in overrides.items():
        if key not in leaves:
            raise ConfigError(f"{source}: unknown option {flag_name(key)}")
        section, _, kind = leaves[key]
        where = f"{source}: {flag_name(key)}"
        changes.setdefault(section, {})[key] = (parse_flag(value, kind, where) if isinstance(value, str)
                                                else coerce(value, kind, where))
    replaced = {s: dataclasses.replace(getattr(config, s), **v) for s, v in changes.items()}
    return dataclasses.replace(config, **replaced)


def to_mapping(config) -> dict:
    """The config as ``{section: {key: value}}``, the inverse of ``from_mapping`` (None values dropped)."""
    return {
        section.name: {k: v for k, v in dataclasses.asdict(getattr(config, section.name)).items() if v is not None}
        for section in dataclasses.fields(config)
    }
