"""Typed configuration: dataclasses loaded from TOML, with unknown keys rejected by name.

Each component owns a small dataclass whose annotations are the schema (int, float, str, bool,
`Literal[...]`, `X | None`, `list[X]`, nested dataclasses). `from_dict` checks every key and type
and names the file and dotted key path in its error; cross-field checks live in each dataclass's
`__post_init__` and raise `ConfigError` via `check`.
"""

from __future__ import annotations

import dataclasses
import math
import reprlib  # values echoed in errors are cut short: a 4,000-digit integer, a long list
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin, get_type_hints

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from ..errors import ConfigError

T = TypeVar("T")


def check(condition: bool, key: str, expected: str) -> None:
    """Raise a ConfigError for `key` unless `condition`; `from_dict` adds the file name."""
    if not condition:
        raise ConfigError(key, f"expected {expected}")


def read_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        if not path.is_file():  # asked first: open() would block on a FIFO
            raise ConfigError(str(path), "file not found" if not path.exists() else "not a file")
        with path.open("rb") as f:
            return tomllib.load(f)
    except (OSError, UnicodeDecodeError) as e:  # is_file() too raises some, e.g. a name too long
        reason = getattr(e, "strerror", None) or e  # an OSError's without the path again
        raise ConfigError(str(path), f"cannot be read ({reason})") from None
    except ValueError as e:  # TOMLDecodeError, or an integer of more than 4,300 digits
        raise ConfigError(str(path), f"not valid TOML ({e})") from None
    except RecursionError:  # tomllib parses nested arrays and tables by recursion
        raise ConfigError(str(path), "not valid TOML (arrays or tables nested too deep)") from None


def load(cls: type[T], path: str | Path) -> T:
    """Read a TOML file into dataclass `cls`; every error names the file and the key."""
    return from_dict(cls, read_toml(path), source=str(path))


def from_dict(cls: type[T], data: Any, source: str = "", prefix: str = "") -> T:
    try:
        return _build(cls, data, prefix)
    except ConfigError as e:
        if source and not e.where.startswith(source):
            where = f"{source}: {e.where}" if e.where else source
            raise ConfigError(where, e.problem) from None
        raise


def _describe(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " or ".join(repr(a) for a in get_args(tp))
    if origin in (typing.Union, types.UnionType):
        text = " or ".join(_describe(a) for a in get_args(tp) if a is not type(None))
        return text + " (optional)" if type(None) in get_args(tp) else text
    if origin is dict:
        return f"a table of {_describe(get_args(tp)[1])}"
    if origin is list:
        return f"a list of {_describe(get_args(tp)[0])}"
    if dataclasses.is_dataclass(tp):
        return "a table"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def _convert(tp: Any, value: Any, key: str) -> Any:
    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in get_args(tp) if a is not type(None)]
        for option in options:
            try:
                return _convert(option, value, key)
            except ConfigError:
                continue
        raise ConfigError(key, f"expected {_describe(tp)}, got {reprlib.repr(value)}")
    if origin is Literal:
        if value in get_args(tp) and type(value) is not bool:
            return value
        raise ConfigError(key, f"expected {_describe(tp)}, got {reprlib.repr(value)}")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(key, f"expected {_describe(tp)}, got {reprlib.repr(value)}")
        (inner,) = get_args(tp)
        return [_convert(inner, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(key, f"expected a table, got {reprlib.repr(value)}")
        _, inner = get_args(tp)
        return {k: _convert(inner, v, f"{key}.{k}") for k, v in value.items()}
    ok = {
        bool: lambda v: isinstance(v, bool),
        int: lambda v: isinstance(v, int) and not isinstance(v, bool),
        float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        str: lambda v: isinstance(v, str),
    }.get(tp)
    if ok is None:
        raise TypeError(f"config field {key}: unsupported annotation {tp!r}")
    if not ok(value):
        raise ConfigError(key, f"expected {_describe(tp)}, got {reprlib.repr(value)}")
    if tp is float:
        # TOML has nan and inf, but no setting means them: `bucket_mb = inf` would fail only
        # later, deep in the planner, and `lr = nan` would train to nan without a word.
        try:
            number = float(value)
        except OverflowError:  # an integer beyond any float
            number = math.inf
        if not math.isfinite(number):
            raise ConfigError(key, f"expected a finite number, got {reprlib.repr(value)}")
        return number
    if tp is int and not -(2**63) <= value < 2**63:
        # TOML's integers are 64-bit; tomllib reads any size, which torch and numpy cannot take.
        raise ConfigError(key, f"expected a 64-bit integer, got {reprlib.repr(value)}")
    return value


def _build(cls: Any, data: Any, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(prefix, f"expected a table, got {reprlib.repr(data)}")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        key = f"{prefix}.{unknown[0]}" if prefix else unknown[0]
        raise ConfigError(key, f"unknown key (expected one of: {', '.join(fields)})")
    kwargs = {}
    for name, field in fields.items():
        key = f"{prefix}.{name}" if prefix else name
        if name not in data:
            no_default = (
                field.default is dataclasses.MISSING
                and field.default_factory is dataclasses.MISSING
            )
            if no_default:
                raise ConfigError(key, f"missing (expected {_describe(hints[name])})")
            continue
        kwargs[name] = _convert(hints[name], data[name], key)
    try:
        return cls(**kwargs)
    except ConfigError as e:
        # __post_init__ names the field; qualify it with where the table sits.
        if prefix and e.where and not e.where.startswith(prefix):
            raise ConfigError(f"{prefix}.{e.where}", e.problem) from None
        raise
