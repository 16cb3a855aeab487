"""`key=value` overrides of an experiment config: a dotted path or a unique bare field name,
the value parsed by the field's declared type."""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Literal

from looprl.config.sections import ExperimentConfig, field_types, type_name
from looprl.errors import ConfigError


def _leaf_paths(cls, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    """Every leaf field of a section class: path tuple -> declared type."""
    out = {}
    for name, tp in field_types(cls).items():
        if name == "SECTION":
            continue
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            out.update(_leaf_paths(tp, prefix + (name,)))
        else:
            out[prefix + (name,)] = tp
    return out


def resolve_key(cfg_cls, key: str) -> tuple[str, ...]:
    """The leaf path a key names: a full dotted path, or a bare field name unique across
    sections. Raises ConfigError for unknown or ambiguous keys (listing the candidates)."""
    leaves = _leaf_paths(cfg_cls)
    path = tuple(key.split("."))
    if path in leaves:
        return path
    matches = [p for p in leaves if len(p) >= len(path) and p[-len(path):] == path]
    if len(matches) == 1:
        return matches[0]
    dotted = sorted(".".join(p) for p in leaves)
    if len(matches) > 1:
        raise ConfigError(f"config key {key!r} is ambiguous: it matches "
                          f"{sorted('.'.join(p) for p in matches)}; use the dotted path")
    near = difflib.get_close_matches(key, dotted + sorted({p[-1] for p in leaves}), n=3)
    hint = f"; did you mean {near}?" if near else ""
    raise ConfigError(f"unknown config key {key!r}{hint} (every key: looprl train CONFIG "
                      f"--list-keys)")


def config_key_lines(cfg) -> list[str]:
    """One line per leaf key of an experiment config: `section.key = value  (type)`, for
    `looprl train CONFIG --list-keys`."""
    lines = []
    for path, tp in _leaf_paths(type(cfg)).items():
        value = cfg
        for p in path:
            value = getattr(value, p)
        lines.append(f"{'.'.join(path)} = {value!r}  ({type_name(tp)})")
    return lines


_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}
_NONE = {"none", "null"}


def parse_value(tp, text: str, key: str):
    """Parse the command-line string `text` as type `tp`; ConfigError naming key/type/value."""
    def bad():
        return ConfigError(f"config key {key!r}: expected {type_name(tp)}, found {text!r}")

    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        if text.strip().lower() in _NONE:
            return None
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        try:
            return parse_value(inner[0], text, key)
        except ConfigError:
            raise bad() from None
    if origin is Literal:
        if text not in typing.get_args(tp):
            raise bad()
        return text
    if origin is tuple:
        parts = [p.strip() for p in text.split(",") if p.strip()]
        return tuple(parse_value(typing.get_args(tp)[0], p, key) for p in parts)
    if tp is bool:
        low = text.strip().lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise bad()
    if tp is int:
        try:
            return int(text)
        except ValueError:
            raise bad() from None
    if tp is float:
        try:
            return float(text)
        except ValueError:
            raise bad() from None
    if tp is str:
        return text
    raise bad()


def _rebuild(obj, updates: dict[tuple[str, ...], Any]):
    """`obj` with the leaf updates applied, every section rebuilt once (validated once)."""
    kw = {}
    for f in dataclasses.fields(obj):
        sub = {p[1:]: v for p, v in updates.items() if p[0] == f.name and len(p) > 1}
        if (f.name,) in updates:
            kw[f.name] = updates[(f.name,)]
        elif sub:
            kw[f.name] = _rebuild(getattr(obj, f.name), sub)
    return dataclasses.replace(obj, **kw) if kw else obj


def apply_overrides(cfg: ExperimentConfig, overrides: list[str] | tuple[str, ...]
                    ) -> ExperimentConfig:
    """`cfg` with `key=value` overrides applied (later ones win), e.g. `grpo.eps_high=0.28`,
    `seed=1`, `resume=runs/x`, `fixed_exit_loop=none`, `task.train_datasets=chain_sum,leg_counting`.

    Raises ConfigError for a malformed item, an unknown or ambiguous key, a value that does
    not parse as the field's type or choices, or a resulting config that fails validation.
    """
    updates: dict[tuple[str, ...], Any] = {}
    leaves = _leaf_paths(type(cfg))
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"override {item!r}: expected key=value")
        path = resolve_key(type(cfg), key)
        updates[path] = parse_value(leaves[path], text, ".".join(path))
    return _rebuild(cfg, updates)
