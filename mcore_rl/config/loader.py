"""YAML -> typed dataclasses: ``${...}`` interpolation, dotted command-line overrides, errors that name the key.

    config = load_config(RunConfig, "run.yaml", ["models.policy.temperature=0.8"])

Order: parse the YAML (syntax errors carry file and line), apply overrides (each value parsed as a YAML
scalar), resolve ``${dotted.key}`` references (and ``${env:NAME}``), then build the dataclass tree, refusing
unknown keys (with the closest known one) and values of the wrong type. Nothing here knows the schema.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml

_REF = re.compile(r"\$\{([^}]+)\}")


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's floats: 1.1 wants a dot and a signed exponent (``1.0e-5``), so ``1e-5``
    and ``2e-5`` loaded as strings and the typed config refused them."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def _parse(text: str):
    return yaml.load(text, Loader=_Loader)  # safe: _Loader constructs plain data only


class ConfigError(ValueError):
    """A config problem, named by its dotted key (and file/line where YAML syntax is at fault)."""


def load_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        data = _parse(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise ConfigError(f"{where}: malformed YAML: {getattr(err, 'problem', err)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """``a.b.c=value`` sets a nested key (intermediate mappings are created); the value is parsed as YAML."""
    data = _copy(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r}: expected dotted.key=value")
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part!r} is a value, not a section")
            node = child
        node[parts[-1]] = _parse(raw) if raw else ""
    return data


def _copy(value):
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def _lookup(root: dict, dotted: str, at: str):
    if dotted.startswith("env:"):
        name = dotted[4:]
        if name not in os.environ:
            raise ConfigError(f"{at}: environment variable {name!r} referenced by ${{{dotted}}} is not set")
        return os.environ[name]
    node: Any = root
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            raise ConfigError(f"{at}: ${{{dotted}}} refers to a key that does not exist")
        node = node[part]
    return node


def interpolate(data: dict) -> dict:
    """Resolve ``${dotted.key}`` (a whole value keeps the referenced type; inside text it is formatted in)."""

    def resolve(value, at: str, active: tuple[str, ...]):
        if isinstance(value, dict):
            return {k: resolve(v, f"{at}.{k}" if at else k, active) for k, v in value.items()}
        if isinstance(value, list):
            return [resolve(v, f"{at}[{i}]", active) for i, v in enumerate(value)]
        if not isinstance(value, str) or "${" not in value:
            return value

        def target(ref: str):
            if ref in active:
                raise ConfigError(f"{at}: circular reference {' -> '.join((*active, ref))}")
            return resolve(_lookup(data, ref, at), ref, (*active, ref))

        whole = _REF.fullmatch(value)
        if whole:
            return target(whole.group(1))
        return _REF.sub(lambda m: str(target(m.group(1))), value)

    return resolve(data, "", ())


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(value, tp, at: str):
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(value, option, at)
            except ConfigError as err:
                errors.append(err)
        raise errors[0]
    if origin is typing.Literal:  # a choice: the schema's type lists the options
        options = typing.get_args(tp)
        if value not in options:
            raise ConfigError(f"{at}={value!r}: expected one of {list(options)}")
        return value
    if dataclasses.is_dataclass(tp):
        return build(tp, value, at)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{at}: expected a list, got {value!r}")
        (item,) = typing.get_args(tp)
        return [_convert(v, item, f"{at}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{at}: expected a mapping, got {value!r}")
        _, item = typing.get_args(tp)
        return {k: _convert(v, item, f"{at}.{k}") for k, v in value.items()}
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is Path and isinstance(value, str):
        return Path(value)
    if tp in (int, float, str, bool) and (type(value) is not tp):
        raise ConfigError(f"{at}: expected {_type_name(tp)}, got {value!r} ({type(value).__name__})")
    return value


def check_bounds(prefix: str, section, keys: tuple[str, ...], low: float, expected: str, strict: bool = False) -> None:
    """Each of ``section``'s ``keys`` at least ``low`` (above it if ``strict``; NaN never passes), else an error
    ``{prefix}.{key}={value}: expected {expected}``: the one place of the schema's lower bounds."""
    for key in keys:
        value = getattr(section, key)
        if not (value > low if strict else value >= low):
            raise ConfigError(f"{prefix}.{key}={value}: expected {expected}")


def build(cls, data, at: str = ""):
    """Instantiate dataclass ``cls`` from a mapping: unknown keys and wrong types are errors naming the key."""
    if not isinstance(data, dict):
        raise ConfigError(f"{at or cls.__name__}: expected a mapping for {cls.__name__}, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    for key in data:
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {sorted(fields)}"
            raise ConfigError(f"{at + '.' if at else ''}{key}: unknown key{hint}")
    kwargs = {name: _convert(value, hints[name], f"{at + '.' if at else ''}{name}") for name, value in data.items()}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as err:  # a dataclass's own __post_init__ checks
        raise ConfigError(f"{at or cls.__name__}: {err}") from None


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def load_config(cls, path: str | Path, overrides: list[str] | None = None):
    """The whole pipeline: ``cls``'s defaults <- YAML file <- overrides, interpolated, built into ``cls``.

    Defaults take part in interpolation, so a default like ``log_dir: ${output_dir}/logs`` follows the file.
    """
    data = apply_overrides(_merge(to_dict(cls()), load_yaml(path)), overrides or [])
    return build(cls, interpolate(data))


def to_dict(config) -> dict:
    """The resolved config as plain data (saved with every run)."""
    return _plain(dataclasses.asdict(config))


def _plain(value):
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value
