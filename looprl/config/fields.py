"""The config's field types: their readable names, the one type dispatch that checks a Python
value or parses a command-line string (`convert_value`), and the reading of an old key name
(`renamed_key`; the names are `looprl.legacy.RENAMED`)."""
from __future__ import annotations

import dataclasses
import types
import typing
import warnings
from typing import Any, Literal

from looprl.legacy import RENAMED
from looprl.errors import ConfigError


class ConfigRenameWarning(UserWarning):
    """A config key was given by its old name (`RENAMED`)."""


def renamed_key(section: str, name: str) -> str:
    """`name`'s current name in `section` (a warning when it is an old one), else `name`."""
    new = RENAMED.get(section, {}).get(name)
    if new is None:
        return name
    warnings.warn(f"config key '{section}.{name}' is the old name of '{section}.{new}'; read as "
                  f"'{section}.{new}' (write that instead)", ConfigRenameWarning, stacklevel=3)
    return new


# --- typed, self-checking sections --------------------------------------------------------------

def type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(c) for c in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return "optional " + " or ".join(type_name(a) for a in args) + " (or none)"
    if origin is tuple:
        return f"tuple of {type_name(typing.get_args(tp)[0])} (comma-separated)"
    return getattr(tp, "__name__", str(tp))


_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}
_NONE = {"none", "null"}


def _bool_text(text: str):
    low = text.strip().lower()
    return True if low in _TRUE else False if low in _FALSE else None


def _number_text(kind, text: str):
    try:
        return kind(text)
    except ValueError:
        return None


# per leaf type: (Python value -> value or None if it is not one, command-line text -> the same)
_LEAVES = {
    bool: (lambda v: v if isinstance(v, bool) else None, _bool_text),
    int: (lambda v: v if isinstance(v, int) and not isinstance(v, bool) else None,
          lambda t: _number_text(int, t)),
    float: (lambda v: float(v) if isinstance(v, (int, float)) and not isinstance(v, bool)
            else None, lambda t: _number_text(float, t)),
    str: (lambda v: v if isinstance(v, str) else None, lambda t: t),
}


def convert_value(tp, value, key: str, *, text: bool = False):
    """`value` as the declared field type `tp` (bool, int, float, str, Optional[...],
    Literal[...] choices, tuple[X, ...], a section dataclass): the one type dispatch of the
    config. `text=False`: a Python value (an experiment file, JSON, a constructor) is checked,
    an int accepted for a float. `text=True`: a command-line string is parsed (`none`/`null`
    for None, true/false/yes/no/on/off/1/0 for a bool, a comma list for a tuple).

    Raises ConfigError naming the key, the expected type and the value found (for text, an
    optional field's error names the whole optional type and text); TypeError for a field
    type the config does not support."""
    def bad():
        return ConfigError(f"config key {key!r}: expected {type_name(tp)}, found {value!r}")

    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        if (value.strip().lower() in _NONE) if text else value is None:
            return None
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        if not text:
            return convert_value(inner[0], value, key)
        try:
            return convert_value(inner[0], value, key, text=True)
        except ConfigError:
            raise bad() from None
    if origin is Literal:
        if value not in typing.get_args(tp) or isinstance(value, bool):
            raise bad()
        return value
    if origin is tuple:
        if text:
            parts = [p.strip() for p in value.split(",") if p.strip()]
        elif isinstance(value, (tuple, list)):
            parts = value
        else:
            raise bad()
        return tuple(convert_value(typing.get_args(tp)[0], v, key, text=text) for v in parts)
    if tp in _LEAVES:
        out = _LEAVES[tp][1 if text else 0](value)
        if out is None:
            raise bad()
        return out
    if dataclasses.is_dataclass(tp) and not text:
        if not isinstance(value, tp):
            raise bad()
        return value
    if text:
        raise bad()
    raise TypeError(f"config key {key!r}: unsupported field type {tp!r}")


def field_types(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)
