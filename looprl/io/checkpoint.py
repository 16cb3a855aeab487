"""The looprl checkpoint (docs/DESIGN.md §2): one directory, written atomically.

`CKPT/` holds `params/` (Orbax tree of the fp32 master parameters, `param_dict` layout),
optionally `train_state/` (a training checkpoint's extra state, flat: `looprl.io.train_state`),
`model_config.json`, `tokenizer.json` (when the source had one), extra text files the writer
names, and `looprl_meta.json` (format, version, the parts present, `params_sha256`, and every
file's size and SHA-256).

The meta file is written last inside a temporary sibling directory, which is then renamed to
`CKPT`: a directory is a complete checkpoint or absent. Every load checks the manifest (a part
missing or of another size) and the digests (bytes damaged in place), raising a CheckpointError
that names the file and both values. Restores never cast: parameters are stored as fp32, and
`load_train_state` checks every array's name, shape and dtype against a template. An older
checkpoint without digests (`looprl.legacy`) loads with a one-line warning. Paths are made
absolute here (orbax refuses relative ones).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import jax
import numpy as np

from looprl import legacy
from looprl.distributed.mesh import param_shardings, to_host
from looprl.distributed.multihost import sync
from looprl.errors import CheckpointError, ConfigError
from looprl.io.digest import ParamsSha256, file_sha256, leaf_path_name, params_sha256
from looprl.io.orbax_tree import checkpointer, restore_tree, save_tree, to_saveable
from looprl.io.slabs import LeafSlabs
from looprl.io.train_state import flatten_train_state, tree_like_template
from looprl.model.config import OuroConfig
from looprl.model.looped import check_param_tree, expected_param_shapes

FORMAT = "looprl-checkpoint"
VERSION = 1
# {"format", "version", "has_tokenizer", "has_train_state", "train_state_leaves" (name, dtype,
# shape, prng_impl per leaf), "extra_files", ...extra_meta, "params_sha256",
# "files": {relative path: bytes}, "file_sha256": {relative path: SHA-256 hex}}
META_FILE = "looprl_meta.json"
CONFIG_FILE = "model_config.json"
TOKENIZER_FILE = "tokenizer.json"
PARAMS_DIR = "params"
TRAIN_STATE_DIR = "train_state"


def _to_numpy(tree, dtype=None):
    return jax.tree.map(lambda a: np.asarray(a, dtype=dtype), tree)  # no copy if it has dtype


def _abs(path: str | Path) -> Path:
    """`path` made absolute (orbax refuses relative paths)."""
    return Path(os.path.abspath(Path(path).expanduser()))


def save_model_checkpoint(path: str | Path, params: dict[str, Any], cfg: OuroConfig,
                          tokenizer_json: str | None, extra_meta: dict[str, Any] | None = None,
                          train_state: Any = None, overwrite: bool = False,
                          extra_files: dict[str, str] | None = None) -> Path:
    """Write a complete looprl checkpoint at `path`, atomically.

    Args:
      params: parameter dict (any float dtype; stored as fp32 master weights, which is exact
        for bf16/fp16 values). Checked against `cfg`'s layout.
      cfg: the model config, stored as `model_config.json`.
      tokenizer_json: text of an HF `tokenizers` JSON, or None (no tokenizer stored).
      extra_meta: JSON-serialisable entries merged into `looprl_meta.json` (e.g. `source_dtype`,
        `source_dtypes`, `step`).
      train_state: optional pytree of arrays/scalars/typed PRNG keys (optimizer state, run key,
        step, data position) saved under `train_state/` with every leaf's dtype kept (a Python
        int is stored as numpy's default int); read back with `load_train_state`.
      overwrite: replace an existing checkpoint at `path` (the old one is removed only after
        the new one is complete).
      extra_files: {file name: text} written into the checkpoint (and required on load).
    Raises: CheckpointError if `path` exists (and not `overwrite`) or params mismatch `cfg`.
    """
    path = _abs(path)
    extra_files = dict(extra_files or {})
    reserved = {PARAMS_DIR, TRAIN_STATE_DIR, CONFIG_FILE, TOKENIZER_FILE, META_FILE}
    for name in extra_files:
        if name in reserved or "/" in name or name.startswith("."):
            raise CheckpointError(f"{path}: extra file name {name!r} is reserved or not a plain "
                                  f"file name")
    check_param_tree(params, cfg, source=f"{path}: params")
    extra_meta = dict(extra_meta or {})
    if "params_sha256" not in extra_meta:  # every checkpoint records it (checked on load)
        extra_meta["params_sha256"] = params_sha256(
            jax.tree.map(lambda a: np.asarray(to_host(a), np.float32), params))
    if path.exists() and not overwrite and (not path.is_dir() or any(path.iterdir())):
        raise CheckpointError(f"{path}: already exists; refusing to overwrite a checkpoint")
    path.parent.mkdir(parents=True, exist_ok=True)
    multi = jax.process_count() > 1
    main = jax.process_index() == 0
    if multi:  # every process writes its own shards into one directory (a name all of them
        # agree on, on a filesystem they share); process 0 writes the rest and renames it
        tmp = path.parent / f".{path.name}.tmp-multiprocess"
        if main and tmp.exists():
            shutil.rmtree(tmp)
        sync(f"looprl-checkpoint-start:{path}")
    else:
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        save_tree(tmp / PARAMS_DIR, to_saveable(params, np.float32))
        records = None
        if train_state is not None:
            flat, records = flatten_train_state(train_state)
            save_tree(tmp / TRAIN_STATE_DIR, flat)
        if main:
            _finish_checkpoint(path, tmp, cfg, tokenizer_json, extra_meta, extra_files,
                               train_state is not None, records)
        if multi:
            sync(f"looprl-checkpoint-done:{path}")
    except BaseException:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _finish_checkpoint(path: Path, tmp: Path, cfg: OuroConfig, tokenizer_json, extra_meta,
                       extra_files: dict[str, str], has_train_state: bool, records) -> None:
    """Process 0's part of a save: the JSON files, the manifest, the meta, the rename."""
    (tmp / CONFIG_FILE).write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    if tokenizer_json is not None:
        (tmp / TOKENIZER_FILE).write_text(tokenizer_json)
    for name, text in extra_files.items():
        (tmp / name).write_text(text)
    meta = {"format": FORMAT, "version": VERSION, "has_tokenizer": tokenizer_json is not None,
            "has_train_state": has_train_state, "train_state_leaves": records,
            "extra_files": sorted(extra_files), **(extra_meta or {})}
    meta["files"], meta["file_sha256"] = _synced_manifest(tmp)
    (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    _fsync(tmp / META_FILE)
    _fsync(tmp)
    old = None
    if path.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
        os.replace(path, old / "ckpt")
    os.replace(tmp, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def _synced_manifest(root: Path) -> tuple[dict[str, int], dict[str, str]]:
    """({relative path: size in bytes}, {relative path: SHA-256 hex}) of every file under
    `root`, each fsync'ed (so that a crash after the rename cannot leave a complete-looking
    checkpoint with truncated files)."""
    files, digests = {}, {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            p = Path(dirpath) / name
            _fsync(p)
            rel = p.relative_to(root).as_posix()
            files[rel] = p.stat().st_size
            digests[rel] = file_sha256(p)
        _fsync(Path(dirpath))
    return dict(sorted(files.items())), dict(sorted(digests.items()))


def check_file_digests(path: str | Path, meta: dict[str, Any], train_state: bool = False
                       ) -> None:
    """Compare each file's SHA-256 with the one `meta["file_sha256"]` recorded at save (none in
    an older checkpoint: `looprl.legacy.checkpoint_records`): the files under `train_state/`
    with `train_state`, else every other file. Raises CheckpointError naming the first damaged
    file and both digests."""
    path = _abs(path)
    _, file_digests, _ = legacy.checkpoint_records(meta)
    for rel, recorded in file_digests.items():
        if rel.startswith(TRAIN_STATE_DIR + "/") != train_state:
            continue
        found = file_sha256(path / rel)
        if found != recorded:
            raise CheckpointError(f"{path / rel}: damaged checkpoint file: SHA-256 {found} "
                                  f"differs from {recorded} recorded in {META_FILE} when it was "
                                  f"saved")


def _check_params_digest(path: Path, params, meta: dict[str, Any], found=None) -> None:
    """`params_sha256` of the restored tree (or `found`, streamed as it was read) against the
    recorded one; a checkpoint that records no digest at all loads with a warning on stderr."""
    _, file_digests, recorded = legacy.checkpoint_records(meta)
    if recorded is None:
        if not file_digests:
            print(f"looprl: warning: {path}: written before checkpoints recorded digests; its "
                  f"bytes cannot be checked for damage", file=sys.stderr, flush=True)
        return
    found = found or params_sha256(params)
    if found != recorded:
        raise CheckpointError(f"{path / PARAMS_DIR}: damaged parameters: params_sha256 {found} "
                              f"differs from {recorded} recorded in {META_FILE} when it was "
                              f"saved")


def read_checkpoint_meta(path: str | Path) -> dict[str, Any]:
    """`looprl_meta.json` of a checkpoint, after checking the directory is a complete one.

    Raises: CheckpointError naming the directory and the missing or malformed part."""
    path = _abs(path)
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
    needed.extend(meta.get("extra_files") or [])
    for part in needed:
        if not (path / part).exists():
            raise CheckpointError(f"{path}: incomplete looprl checkpoint: {part} missing")
    for rel, size in legacy.checkpoint_records(meta)[0].items():
        f = path / rel
        found = f.stat().st_size if f.is_file() else None
        if found != size:
            raise CheckpointError(f"{path}: incomplete looprl checkpoint: {rel} "
                                  f"{'missing' if found is None else f'has {found} bytes'}, "
                                  f"{META_FILE} lists {size}")
    return meta


def load_model_checkpoint(path: str | Path, mesh=None, leaf_fn=None
                          ) -> tuple[dict[str, Any], OuroConfig, str | None, dict[str, Any]]:
    """Read a looprl checkpoint (model or training): (params, cfg, tokenizer_json, meta).

    params: nested dict of fp32 numpy arrays in the `param_dict` layout, checked against cfg
    (shapes) and fp32 (a stored array of another dtype is refused, never cast); with a `mesh`,
    global jax arrays with `looprl.distributed.mesh.param_shardings` (each process reads only
    its shards). Either way from a checkpoint written on any device count. With `leaf_fn`
    (`leaf_fn(keys, looprl.io.slabs.LeafSlabs) -> array`, not with a mesh), each leaf, in
    sorted path order and after its dtype check, is handed over as chunk-aligned fp32 slabs
    and replaced by what `leaf_fn` returns, so neither the fp32 tree nor a whole fp32 leaf
    exists at once (bf16 sampling weights, `looprl.sampling.resident`); the file digests then
    cover every byte (a checkpoint without them is read a whole leaf at a time and checked by
    `params_sha256`).
    tokenizer_json: the stored `tokenizer.json` text, or None. meta: `looprl_meta.json`.
    `path` may be relative. Raises: CheckpointError for an incomplete directory, bad config, a
    param mismatch (naming the array), or a file or parameter digest that differs from the one
    recorded at save (naming the file and both digests).
    """
    if mesh is not None and leaf_fn is not None:
        raise ValueError("load_model_checkpoint: leaf_fn is for one-device numpy loads, not a mesh")
    path = _abs(path)
    meta = read_checkpoint_meta(path)
    check_file_digests(path, meta)
    try:
        cfg = OuroConfig.from_dict(json.loads((path / CONFIG_FILE).read_text()),
                                   source=str(path / CONFIG_FILE))
    except (OSError, json.JSONDecodeError, ConfigError, TypeError) as e:
        raise CheckpointError(f"{path / CONFIG_FILE}: {e}") from e
    sha = ParamsSha256()
    files_digested = bool(legacy.checkpoint_records(meta)[1])  # then every byte is checked

    def streamed(keys, slabs):
        _require_fp32(path, keys, slabs)
        if files_digested:
            return leaf_fn(keys, slabs)
        leaf = slabs.full()  # an older checkpoint: only the tree digest can check the bytes
        sha.update(leaf_path_name(keys), leaf)
        return leaf_fn(keys, LeafSlabs.whole(leaf))

    try:
        shardings = None
        if mesh is not None:
            shardings = param_shardings(expected_param_shapes(cfg), mesh)
        params = restore_tree(path / PARAMS_DIR, shardings, leaf_fn and streamed)
    except CheckpointError:
        raise
    except Exception as e:  # orbax raises several types for a damaged directory
        raise CheckpointError(f"{path / PARAMS_DIR}: cannot restore parameters: {e}") from e
    if mesh is None and leaf_fn is None:
        params = _to_numpy(params)
    check_param_tree(params, cfg, source=f"{path / PARAMS_DIR}")
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(params)[0] if not leaf_fn else ():
        _require_fp32(path, [k.key for k in key_path], leaf)
    if mesh is None and not (leaf_fn and files_digested):  # else the file digests did it
        _check_params_digest(path, params, meta, sha.hexdigest() if leaf_fn else None)
    tokenizer_json = (path / TOKENIZER_FILE).read_text() if meta.get("has_tokenizer") else None
    return params, cfg, tokenizer_json, meta


def _require_fp32(path: Path, keys, leaf) -> None:
    if leaf.dtype != np.float32:
        raise CheckpointError(f"{path / PARAMS_DIR}: parameter {''.join(f'[{k!r}]' for k in keys)}"
                              f" stored as {leaf.dtype.name}, expected float32 (fp32 master "
                              f"weights)")


def load_train_state(path: str | Path, template: Any = None) -> Any:
    """The `train_state` pytree stored with a training checkpoint.

    Without `template`: nested dicts keyed by the leaves' path components (strings), numpy
    leaves, typed PRNG keys rewrapped (`jax.random.wrap_key_data` with the stored impl).
    With `template` (a pytree shaped like the saved state, e.g. a fresh `opt.init(params)`):
    every stored leaf is checked against the template's leaf of the same name (same set of
    names, equal shape, equal dtype; a typed key against a typed key of the same impl) and the
    result has the template's structure. Nothing is ever cast.

    Raises: CheckpointError if the checkpoint is incomplete, holds no train state, or (with a
    template) an array is missing, unexpected, or of another shape or dtype: the message names
    the array, the expected and the found shape/dtype.
    """
    import orbax.checkpoint as ocp

    path = _abs(path)
    meta = read_checkpoint_meta(path)
    if not meta.get("has_train_state"):
        raise CheckpointError(f"{path}: a model checkpoint without train_state (not a "
                              f"training checkpoint)")
    records = meta.get("train_state_leaves")
    if not isinstance(records, list):
        raise CheckpointError(f"{path / META_FILE}: train_state_leaves missing (a checkpoint "
                              f"written before the flat train-state format)")
    check_file_digests(path, meta, train_state=True)
    keys = [f"leaf_{i:05d}" for i in range(len(records))]
    try:
        flat = checkpointer().restore(
            path / TRAIN_STATE_DIR,
            restore_args={k: ocp.RestoreArgs(restore_type=np.ndarray) for k in keys})
    except Exception as e:
        raise CheckpointError(f"{path / TRAIN_STATE_DIR}: cannot restore: {e}") from e
    if not isinstance(flat, dict) or sorted(flat) != keys:
        raise CheckpointError(f"{path / TRAIN_STATE_DIR}: holds {len(flat)} arrays, "
                              f"{META_FILE} lists {len(records)}")
    stored = {}
    for k, rec in zip(keys, records):
        a = np.asarray(flat[k])
        if a.dtype.name != rec["dtype"] or list(a.shape) != list(rec["shape"]):
            raise CheckpointError(f"{path / TRAIN_STATE_DIR}: array {rec['name']!r} restored as "
                                  f"{a.dtype.name}{list(a.shape)}, {META_FILE} says "
                                  f"{rec['dtype']}{rec['shape']}")
        impl = rec.get("prng_impl")
        stored[rec["name"]] = a if impl is None else jax.random.wrap_key_data(a, impl=impl)
    if template is None:
        out: dict[str, Any] = {}
        for name, leaf in stored.items():
            *parents, last = name.split("/")
            d = out
            for p in parents:
                d = d.setdefault(p, {})
            d[last] = leaf
        return out
    return tree_like_template(stored, template, where=str(path / TRAIN_STATE_DIR))
