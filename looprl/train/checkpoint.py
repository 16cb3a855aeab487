"""The looprl checkpoint (DESIGN.md §2): one directory, written atomically.

Layout of `CKPT/`:
  params/             Orbax PyTree checkpoint of the fp32 master parameter dict
                      (`looprl.model.looped.param_dict` layout)
  train_state/        optional Orbax PyTree checkpoint of a training checkpoint's extra state
                      (optimizer state, RNG key data, step, data position, ...): any pytree of
                      arrays and scalars the trainer passes as `train_state`
  model_config.json   `OuroConfig.to_dict()`
  tokenizer.json      HF `tokenizers` JSON (absent when the source had none)
  looprl_meta.json    {"format": "looprl-checkpoint", "version": 1, "has_tokenizer",
                      "has_train_state", "source_dtype", ...extra_meta}

`looprl_meta.json` is written last inside a temporary sibling directory which is then renamed
to `CKPT`, so a directory is either a complete checkpoint or absent; a directory without the
meta file (or with a part it names missing) is refused with a CheckpointError.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from looprl.errors import CheckpointError, ConfigError
from looprl.model.config import OuroConfig

FORMAT = "looprl-checkpoint"
VERSION = 1
META_FILE = "looprl_meta.json"
CONFIG_FILE = "model_config.json"
TOKENIZER_FILE = "tokenizer.json"
PARAMS_DIR = "params"
TRAIN_STATE_DIR = "train_state"


def _checkpointer():
    import orbax.checkpoint as ocp
    return ocp.PyTreeCheckpointer()


def _to_numpy(tree, dtype=None):
    import jax
    return jax.tree.map(lambda a: np.asarray(a) if dtype is None else np.asarray(a).astype(dtype),
                        tree)


def save_model_checkpoint(path: str | Path, params: dict[str, Any], cfg: OuroConfig,
                          tokenizer_json: str | None, extra_meta: dict[str, Any] | None = None,
                          train_state: Any = None, overwrite: bool = False) -> Path:
    """Write a complete looprl checkpoint at `path`, atomically.

    Args:
      params: parameter dict (any float dtype; stored as fp32 master weights, which is exact
        for bf16/fp16 values). Checked against `cfg`'s layout.
      cfg: the model config, stored as `model_config.json`.
      tokenizer_json: text of an HF `tokenizers` JSON, or None (no tokenizer stored).
      extra_meta: JSON-serialisable entries merged into `looprl_meta.json` (e.g. `source_dtype`,
        `source_dtypes`, `step`).
      train_state: optional pytree of arrays/scalars (optimizer state, RNG key *data*, step,
        data position) saved under `train_state/`; read back with `load_train_state`.
      overwrite: replace an existing checkpoint at `path` (the old one is removed only after
        the new one is complete).
    Raises: CheckpointError if `path` exists (and not `overwrite`) or params mismatch `cfg`.
    """
    from looprl.model.hf import check_param_tree

    path = Path(path)
    check_param_tree(params, cfg, source=f"{path}: params")
    if path.exists() and not overwrite and (not path.is_dir() or any(path.iterdir())):
        raise CheckpointError(f"{path}: already exists; refusing to overwrite a checkpoint")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        ckptr = _checkpointer()
        ckptr.save(tmp / PARAMS_DIR, _to_numpy(params, np.float32))
        if train_state is not None:
            ckptr.save(tmp / TRAIN_STATE_DIR, _to_numpy(train_state))
        (tmp / CONFIG_FILE).write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
        if tokenizer_json is not None:
            (tmp / TOKENIZER_FILE).write_text(tokenizer_json)
        meta = {"format": FORMAT, "version": VERSION, "has_tokenizer": tokenizer_json is not None,
                "has_train_state": train_state is not None, **(extra_meta or {})}
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        old = None
        if path.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
            os.replace(path, old / "ckpt")
        os.replace(tmp, path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def read_checkpoint_meta(path: str | Path) -> dict[str, Any]:
    """`looprl_meta.json` of a checkpoint, after checking the directory is a complete one.

    Raises: CheckpointError naming the directory and the missing or malformed part."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a looprl checkpoint directory (does not exist or "
                              f"is a file)")
    meta_path = path / META_FILE
    if not meta_path.exists():
        raise CheckpointError(f"{path}: not a complete looprl checkpoint ({META_FILE} missing; "
                              f"an interrupted save or a different kind of directory)")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{meta_path}: unreadable: {e}") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{meta_path}: format must be {FORMAT!r}, found "
                              f"{meta.get('format') if isinstance(meta, dict) else meta!r}")
    if meta.get("version") != VERSION:
        raise CheckpointError(f"{meta_path}: version {meta.get('version')!r} not supported "
                              f"(expected {VERSION})")
    needed = [PARAMS_DIR, CONFIG_FILE]
    if meta.get("has_tokenizer"):
        needed.append(TOKENIZER_FILE)
    if meta.get("has_train_state"):
        needed.append(TRAIN_STATE_DIR)
    for part in needed:
        if not (path / part).exists():
            raise CheckpointError(f"{path}: incomplete looprl checkpoint: {part} missing")
    return meta


def load_model_checkpoint(path: str | Path
                          ) -> tuple[dict[str, Any], OuroConfig, str | None, dict[str, Any]]:
    """Read a looprl checkpoint (model or training): (params, cfg, tokenizer_json, meta).

    params: nested dict of fp32 numpy arrays in the `param_dict` layout, checked against cfg.
    tokenizer_json: the stored `tokenizer.json` text, or None. meta: `looprl_meta.json`.
    Raises: CheckpointError for an incomplete directory, bad config, or param mismatch.
    """
    from looprl.model.hf import check_param_tree

    path = Path(path)
    meta = read_checkpoint_meta(path)
    try:
        cfg = OuroConfig.from_dict(json.loads((path / CONFIG_FILE).read_text()),
                                   source=str(path / CONFIG_FILE))
    except (OSError, json.JSONDecodeError, ConfigError, TypeError) as e:
        raise CheckpointError(f"{path / CONFIG_FILE}: {e}") from e
    try:
        params = _checkpointer().restore(path / PARAMS_DIR)
    except Exception as e:  # orbax raises several types for a damaged directory
        raise CheckpointError(f"{path / PARAMS_DIR}: cannot restore parameters: {e}") from e
    params = _to_numpy(params)
    check_param_tree(params, cfg, source=f"{path / PARAMS_DIR}")
    tokenizer_json = (path / TOKENIZER_FILE).read_text() if meta.get("has_tokenizer") else None
    return params, cfg, tokenizer_json, meta


def load_train_state(path: str | Path) -> Any:
    """The `train_state` pytree stored with a training checkpoint (numpy leaves).

    Raises: CheckpointError if the checkpoint is incomplete or holds no train state."""
    path = Path(path)
    meta = read_checkpoint_meta(path)
    if not meta.get("has_train_state"):
        raise CheckpointError(f"{path}: a model checkpoint without train_state (not a "
                              f"training checkpoint)")
    try:
        return _to_numpy(_checkpointer().restore(path / TRAIN_STATE_DIR))
    except Exception as e:
        raise CheckpointError(f"{path / TRAIN_STATE_DIR}: cannot restore: {e}") from e


def params_sha256(params: dict[str, Any]) -> str:
    """SHA-256 (hex) of a parameter tree (DESIGN.md §5): leaves in sorted path order, each fed as
    `path|dtype|shape|` (path `/`-joined keys, dtype numpy name, shape comma-joined) followed by
    its little-endian bytes."""
    import hashlib

    import jax

    flat = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        flat.append((name, np.asarray(leaf)))
    h = hashlib.sha256()
    for name, a in sorted(flat, key=lambda x: x[0]):
        a = np.ascontiguousarray(a)
        h.update(f"{name}|{a.dtype.name}|{','.join(map(str, a.shape))}|".encode())
        h.update(a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes())
    return h.hexdigest()
