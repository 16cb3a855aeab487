"""`key=value` overrides of an experiment config: a dotted path or a unique bare field name,
the value parsed by the field's declared type."""
from __future__ import annotations

import dataclasses
import difflib
from typing import Any

from looprl.legacy import RENAMED
from looprl.config.fields import convert_value, field_types, renamed_key, type_name
from looprl.config.sections import ExperimentConfig
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
    sections; an old key name (`RENAMED`) is read as its new one, with a ConfigRenameWarning.
    Raises ConfigError for unknown or ambiguous keys (listing the candidates)."""
    leaves = _leaf_paths(cfg_cls)
    path = tuple(key.split("."))
    for section, names in RENAMED.items():  # an old key name: read as the new one, warned
        if path[-1] in names and (len(path) == 1 or path[-2] == section):
            path = path[:-1] + (renamed_key(section, path[-1]),)
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


def parse_value(tp, text: str, key: str):
    """Parse the command-line string `text` as type `tp` (`convert_value(..., text=True)`);
    ConfigError naming key/type/value."""
    return convert_value(tp, text, key, text=True)


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
    `seed=1`, `resume=runs/x`, `fixed_depth=none`, `task.train_datasets=chain_sum,leg_counting`.

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
