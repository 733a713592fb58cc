"""Configuration files as schemas: dataclasses checked field by field, with one line per mistake.

A person's typo must produce one line that names the key and says what is allowed, never a traceback and
never silence: unknown sections and keys are refused (with the closest known name), values of the wrong
type are refused, and ranges and choices come from each field's ``metadata`` (``min``, ``max``,
``choices``). Used by ``fleet.toml`` (coordinator/config.py) and ``device.toml`` (the device CLI).
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import tomllib
import types
import typing
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A mistake in a configuration file or a command line; the text is the one line to show."""


def load_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{path}: no such file")
    try:
        with open(p, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    except UnicodeDecodeError:  # a binary file, or another encoding than TOML's UTF-8
        raise ConfigError(f"{path}: not valid TOML: not UTF-8 text") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror or e}") from None


def unknown(key: str, allowed: list[str], where: str, noun: str = "key") -> ConfigError:
    close = difflib.get_close_matches(key, allowed, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return ConfigError(f"{where}: unknown {noun} {key!r} (allowed: {', '.join(sorted(allowed))}){hint}")


def _type_name(t: Any) -> str:
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    if t in names:
        return names[t]
    origin = typing.get_origin(t)
    if origin in (list, tuple):
        return "a list"
    if origin is dict:
        return "a table"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(t))
    if t is type(None):
        return '"none"'
    return getattr(t, "__name__", str(t))


def coerce(value: Any, t: Any, what: str) -> Any:
    """``value`` as type ``t`` (from a dataclass annotation), or ConfigError naming ``what``."""
    if t is Any:
        return value
    origin = typing.get_origin(t)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(t)
        if type(None) in args and (value is None or (isinstance(value, str) and value.lower() == "none")):
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return coerce(value, a, what)
            except ConfigError:
                pass
        raise ConfigError(f"{what} = {_show(value)}: expected {_type_name(t)}")
    if t is bool:
        if isinstance(value, bool):
            return value
    elif t is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif t is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
    elif t is str:
        if isinstance(value, str):
            return value
    elif origin in (list, tuple):
        if isinstance(value, (list, tuple)):
            args = typing.get_args(t)
            inner = args[0] if args else Any
            items = [coerce(v, inner, f"{what}[{i}]") for i, v in enumerate(value)]
            return tuple(items) if origin is tuple else items
    elif origin is dict:
        if isinstance(value, dict):
            kt, vt = typing.get_args(t) or (Any, Any)
            out = {}
            for k, v in value.items():
                if kt is int:
                    try:
                        k = int(k)
                    except (TypeError, ValueError):
                        raise ConfigError(f"{what}: key {k!r} is not an integer") from None
                out[k] = coerce(v, vt, f"{what}.{k}")
            return out
    else:
        return value
    raise ConfigError(f"{what} = {_show(value)}: expected {_type_name(t)}")


def _show(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 40 else r[:40] + "..."


def check_field(f: dataclasses.Field, value: Any, what: str) -> None:
    m = f.metadata
    if value is None:
        return
    if "choices" in m and value not in m["choices"]:
        raise ConfigError(f"{what} = {_show(value)}: must be one of {', '.join(map(str, m['choices']))}")
    if "min" in m and isinstance(value, (int, float)) and value < m["min"]:
        raise ConfigError(f"{what} = {_show(value)}: must be at least {m['min']}")
    if "max" in m and isinstance(value, (int, float)) and value > m["max"]:
        raise ConfigError(f"{what} = {_show(value)}: must be at most {m['max']}")


def from_dict(cls: type, data: Any, where: str, *, skip: tuple[str, ...] = ()) -> Any:
    """An instance of dataclass ``cls`` from a TOML table, every key checked (``skip``: fields the file may
    not set)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a table")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init and f.name not in skip}
    kw = {}
    for k, v in data.items():
        if k not in fields:
            raise unknown(k, list(fields), where)
        val = coerce(v, hints[k], f"{where} {k}")
        check_field(fields[k], val, f"{where} {k}")
        kw[k] = val
    try:
        return cls(**kw)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from None
