"""A small TOML writer for plain data, used where `tomli_w` is not installed."""

from __future__ import annotations

import json
import math
from typing import Any

_BARE = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")


def _key(k: str) -> str:
    return k if k and set(k) <= _BARE else json.dumps(k)


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return ("-" if v < 0 else "") + ("nan" if math.isnan(v) else "inf")
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)   # JSON escapes are valid TOML basic strings
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_key(k)} = {_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def _is_tables(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v)


def dump_toml(data: dict[str, Any]) -> str:
    """TOML for plain data (what tomllib reads back): scalars, arrays, tables, arrays of tables.
    Used where `tomli_w` is not installed."""
    lines: list[str] = []

    def table(d: dict[str, Any], path: list[str]) -> None:
        for k, v in d.items():
            if not isinstance(v, dict) and not _is_tables(v):
                lines.append(f"{_key(k)} = {_value(v)}")
        for k, v in d.items():
            name = ".".join(_key(p) for p in [*path, k])
            if isinstance(v, dict):
                if any(not isinstance(x, dict) and not _is_tables(x) for x in v.values()) or not v:
                    lines.extend(["", f"[{name}]"])
                table(v, [*path, k])
            elif _is_tables(v):
                for item in v:
                    lines.extend(["", f"[[{name}]]"])
                    table(item, [*path, k])

    table(data, [])
    return "\n".join(lines).lstrip("\n") + "\n"


def toml_text(data: dict[str, Any]) -> str:
    """`data` as TOML, by `tomli_w` when installed, else by `dump_toml`."""
    try:
        import tomli_w
    except ImportError:
        return dump_toml(data)
    return tomli_w.dumps(data)
