"""Experiment files (`experiments/*.py` defining `CONFIG`) and the resolved config as JSON."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

from looprl.legacy import CONFIG_KEYS_ABSENT, RENAMED
from looprl.config.fields import convert_value, field_types, renamed_key
from looprl.config.overrides import apply_overrides
from looprl.config.sections import ExperimentConfig
from looprl.errors import ConfigError


def load_experiment(path: str | Path) -> ExperimentConfig:
    """Import `path` (an `experiments/*.py` file) and return its `CONFIG`, or `config()`'s
    result. Raises ConfigError if the file is missing, does not import, or defines neither."""
    return load_experiment_module(path)[0]


def load_experiment_module(path: str | Path
                           ) -> tuple[ExperimentConfig, dict[str, list[str]] | None, bool]:
    """(config, variants, shared_warm_start) of an experiment file.

    An experiment file may declare variants of its `CONFIG` as
    `VARIANTS = {"name": ["key=value", ...], ...}` (each a list of overrides, checked here by
    applying it); `looprl train` then runs every variant into `out_dir/<name>`. With
    `SHARED_WARM_START = True` the warm start runs once (into `out_dir/warm_start_run`) and
    every variant starts from its checkpoint (`model.checkpoint=...`,
    `warm_start.enabled=false`), so only what the variants override differs.
    Raises ConfigError if the file is missing or is not a `.py` file, does not import, defines
    neither CONFIG nor config(), or has a malformed VARIANTS or a variant whose overrides fail.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"experiment file {str(path)!r} not found")
    if path.suffix != ".py":
        raise ConfigError(f"{str(path)!r} is not an experiment file: expected a .py file defining "
                          f"CONFIG (e.g. experiments/*.py), or a run directory's config.json")
    mod_name = f"looprl_experiment_{path.stem}_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"experiment file {str(path)!r} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    sys.path.insert(0, str(path.resolve().parent))  # so an experiment can import its siblings
    try:
        spec.loader.exec_module(module)
    except ConfigError as e:
        raise ConfigError(f"experiment file {str(path)!r}: {e}") from e
    except (SyntaxError, ImportError) as e:
        raise ConfigError(f"experiment file {str(path)!r} does not import: {e}") from e
    finally:
        sys.modules.pop(mod_name, None)
        sys.path.remove(str(path.resolve().parent))
    if hasattr(module, "CONFIG"):
        cfg = module.CONFIG
    elif callable(getattr(module, "config", None)):
        cfg = module.config()
    else:
        raise ConfigError(f"experiment file {str(path)!r} defines neither CONFIG nor config()")
    if not isinstance(cfg, ExperimentConfig):
        raise ConfigError(f"experiment file {str(path)!r}: CONFIG must be an ExperimentConfig, "
                          f"found {type(cfg).__name__}")
    variants = getattr(module, "VARIANTS", None)
    if variants is not None:
        ok = isinstance(variants, dict) and len(variants) > 0 and all(
            isinstance(k, str) and k and "/" not in k and isinstance(v, (list, tuple))
            and all(isinstance(x, str) for x in v) for k, v in variants.items())
        if not ok:
            raise ConfigError(f"experiment file {str(path)!r}: VARIANTS must be a non-empty dict "
                              f"{{name: [\"key=value\", ...]}} (names without '/'), found "
                              f"{variants!r}")
        variants = {k: list(v) for k, v in variants.items()}
        for name, over in variants.items():
            try:
                apply_overrides(cfg, over)
            except ConfigError as e:
                raise ConfigError(f"experiment file {str(path)!r}: variant {name!r}: {e}") from e
    shared = getattr(module, "SHARED_WARM_START", False)
    if not isinstance(shared, bool):
        raise ConfigError(f"experiment file {str(path)!r}: SHARED_WARM_START must be a bool, "
                          f"found {shared!r}")
    return cfg, variants, shared


def to_dict(cfg) -> dict[str, Any]:
    """Nested plain dict (tuples become lists)."""
    return json.loads(to_json(cfg))


def to_json(cfg: ExperimentConfig, indent: int | None = 2) -> str:
    """The resolved config as JSON text (sections nested, keys in declaration order)."""
    return json.dumps(dataclasses.asdict(cfg), indent=indent)


def _from_dict(cls, d: Any, where: str):
    if not isinstance(d, dict):
        raise ConfigError(f"config section {where or 'root'!r}: expected an object, found {d!r}")
    hints = field_types(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    renamed = {renamed_key(where, k): k for k in d if k in RENAMED.get(where, {})}
    for new, old in renamed.items():  # a file written before a key was renamed
        if new in d:
            raise ConfigError(f"config section {where!r}: both {old!r} and its new name "
                              f"{new!r} given")
    d = {RENAMED.get(where, {}).get(k, k): v for k, v in d.items()}
    unknown = sorted(set(d) - names)
    if unknown:
        prefix = f"{where}." if where else ""
        raise ConfigError(f"unknown config keys {[prefix + u for u in unknown]}")
    kw = {}
    for name, value in CONFIG_KEYS_ABSENT.get(where, {}).items():  # an older file's meaning
        if name not in d:
            kw[name] = value
    for name, value in d.items():
        tp = hints[name]
        key = f"{where}.{name}" if where else name
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            kw[name] = _from_dict(tp, value, key)
        else:
            kw[name] = convert_value(tp, value, key)
    return cls(**kw)


def from_json(text: str, source: str = "config.json") -> ExperimentConfig:
    """Inverse of `to_json`: `from_json(to_json(cfg)) == cfg`. Missing keys take their defaults;
    unknown keys and wrong types raise ConfigError (the message names `source`)."""
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{source}: not valid JSON ({e})") from e
    try:
        return _from_dict(ExperimentConfig, d, "")
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from e


def save_json(cfg: ExperimentConfig, path: str | Path) -> None:
    """Write `to_json(cfg)` to `path` (the run directory's `config.json`)."""
    Path(path).write_text(to_json(cfg) + "\n")


def load_json(path: str | Path) -> ExperimentConfig:
    """Read a config written by `save_json`. Raises ConfigError naming the file."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {e}") from e
    return from_json(text, source=str(path))
