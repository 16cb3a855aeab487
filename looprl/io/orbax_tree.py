"""Orbax PyTree I/O under a looprl checkpoint's `params/` and `train_state/`: a synchronous
checkpointer, saves with small OCDBT data files, and restores as numpy, as placed jax arrays,
or leaf by leaf in chunk-aligned slabs for a loader's `leaf_fn`.

The on-disk layout is orbax's (OCDBT + zarr, one array per leaf, named by its `.`-joined
keys); `looprl.io.checkpoint` owns the directory around it (meta, manifest, digests).
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
from pathlib import Path

import jax
import numpy as np

from looprl.io.digest import leaf_path_name
from looprl.io.slabs import LeafSlabs

# OCDBT data files of <= 64 MiB: tensorstore holds a data file's bytes until it is written,
# so its default (2 GiB) would hold a second copy of a whole tree on every save.
OCDBT_DATA_FILE_BYTES = 64 << 20


def checkpointer():
    """A synchronous orbax PyTree checkpointer that writes numpy leaves without first
    deep-copying them (orbax's default guards asynchronous saves against later mutation; ours
    return only after the bytes are written, so the copy would only double the peak)."""
    import orbax.checkpoint as ocp
    th = ocp.type_handlers
    handlers = [(np.ndarray, th.NumpyHandler(deepcopy_host_arrays=False))]
    handlers += [(t, th.get_type_handler(t)) for t in (int, float, bytes, np.number,
                                                        jax.Array, str)]
    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(
        type_handler_registry=th.create_type_handler_registry(*handlers)))


def save_tree(directory: Path, tree) -> None:
    import orbax.checkpoint as ocp
    checkpointer().save(directory, args=ocp.args.PyTreeSave(tree,
                         ocdbt_target_data_file_size=OCDBT_DATA_FILE_BYTES))


def to_saveable(tree, dtype=None):
    """Leaves as orbax writes them: a jax array sharded over devices stays one (every process
    writes its own shards; needed across hosts, where no process holds the whole array), the
    rest become numpy. On disk both are the same tensorstore arrays; `restore_tree` reads either
    on any device count."""
    def one(a):
        if isinstance(a, jax.Array) and not a.is_fully_replicated:
            return a if dtype is None else a.astype(dtype)
        return np.asarray(a, dtype=dtype)  # no copy when it already has the dtype
    return jax.tree.map(one, tree)


def restore_tree(directory: Path, shardings=None, leaf_fn=None):
    """Restore an orbax PyTree as numpy (default) or, with `shardings` (a tree of
    `jax.sharding.Sharding` matching the stored tree), as global jax arrays placed so. Restore
    arguments are always explicit, so a tree written on N devices restores on any M (orbax's
    default would reuse the writer's device shardings). Numpy trees are restored leaf by leaf
    (tensorstore's read holds a second copy of what it reads: the tree plus ~1 leaf, not ~1.8x),
    in sorted path-name order; with `leaf_fn(keys, LeafSlabs)` each leaf is instead read in
    chunk-aligned slabs (`stored_leaf_slabs`, or whole through orbax where
    tensorstore cannot open it) and replaced by what `leaf_fn` returns."""
    import orbax.checkpoint as ocp

    ckptr = checkpointer()
    stored = ckptr.metadata(directory)
    stored = getattr(getattr(stored, "item_metadata", stored), "tree", stored)
    if shardings is not None:
        args = jax.tree.map(lambda _, sh: ocp.ArrayRestoreArgs(sharding=sh), stored, shardings)
        return ckptr.restore(directory, restore_args=args)
    paths = sorted((p for p, _ in jax.tree_util.tree_flatten_with_path(stored)[0]),
                   key=leaf_path_name)
    if not paths or not all(isinstance(k, jax.tree_util.DictKey) for p in paths for k in p):
        args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), stored)
        return ckptr.restore(directory, restore_args=args)

    def whole(path):  # a one-leaf tree along `path`: a partial restore of that leaf
        item, args = 0, ocp.RestoreArgs(restore_type=np.ndarray)
        for k in reversed(path):
            item, args = {k.key: item}, {k.key: args}
        src = ckptr.restore(directory, args=ocp.args.PyTreeRestore(
            item=item, restore_args=args, partial_restore=True))
        for k in path:
            src = src[k.key]
        return src

    out: dict = {}
    with _large_blocks_returned() if leaf_fn is not None else contextlib.nullcontext():
        for path in paths:
            _restore_leaf(out, path, stored, whole, leaf_fn, directory)
    return out


def _restore_leaf(out: dict, path, stored, whole, leaf_fn, directory: Path) -> None:
    keys, dst, meta = tuple(k.key for k in path), out, stored
    for k in keys[:-1]:
        dst, meta = dst.setdefault(k, {}), meta[k]
    if leaf_fn is None:
        dst[keys[-1]] = whole(path)
        return
    try:
        slabs = stored_leaf_slabs(directory, keys, meta[keys[-1]])
    except (ValueError, KeyError, TypeError, AttributeError, OSError):
        # not an OCDBT zarr2 leaf tensorstore can open: orbax reads it whole
        slabs = LeafSlabs.whole(whole(path))
    dst[keys[-1]] = leaf_fn(keys, slabs)


@contextlib.contextmanager
def _large_blocks_returned():
    """While reading slabs: glibc maps blocks of 1 MiB and more, and unmaps them when freed.
    Tensorstore decompresses on its own threads, and glibc's per-thread arenas (their mmap
    threshold raised by the first large frees) would keep each stack read after it is freed
    (benchmarks/memory.py measures the load's peak). glibc cannot read back or re-enable its
    dynamic threshold, so afterwards the threshold stays fixed at 32 MiB, the ceiling the
    dynamic one rises to (then `malloc_trim`): blocks of 1-32 MiB allocated later come from
    the arenas, as they do once the dynamic threshold has risen. A user's own
    `MALLOC_MMAP_THRESHOLD_` is left alone, and so is any libc without `mallopt`."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        libc = None
    mallopt = getattr(libc, "mallopt", None)
    if (mallopt is None or "MALLOC_MMAP_THRESHOLD_" in os.environ
            or not mallopt(_M_MMAP_THRESHOLD, 1 << 20)):
        yield
        return
    try:
        yield
    finally:
        mallopt(_M_MMAP_THRESHOLD, 32 << 20)
        trim = getattr(libc, "malloc_trim", None)
        if trim is not None:
            trim(0)


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def stored_leaf_slabs(directory: Path, keys: tuple[str, ...], stored) -> LeafSlabs:
    """The leaf `keys` of the orbax (OCDBT, zarr) tree in `directory`, read with tensorstore
    in chunk-aligned slabs along the axis its chunk grid splits most (each chunk read once;
    one slab if the leaf is one chunk). `stored` is the leaf's orbax `ArrayMetadata` (shape,
    dtype, `storage.chunk_shape`). Raises what tensorstore raises for a leaf it cannot open
    (the caller falls back to orbax's whole-leaf restore)."""
    import orbax.checkpoint as ocp
    import tensorstore as ts
    from etils import epath

    ctx = ocp.type_handlers.get_ts_context(use_ocdbt=True)
    info = ocp.type_handlers.ParamInfo(name=".".join(keys), parent_dir=epath.Path(directory),
                                       is_ocdbt_checkpoint=True, use_zarr3=False,
                                       ts_context=ctx)
    array = ts.open(ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=True), open=True,
                    read=True, context=ctx).result()
    shape = tuple(int(d) for d in array.shape)
    if shape != tuple(stored.shape):
        raise ValueError(f"{'/'.join(keys)}: tensorstore shape {shape} differs from the "
                         f"metadata's {tuple(stored.shape)}")
    chunk = tuple(getattr(getattr(stored, "storage", None), "chunk_shape", None) or shape)
    counts = [-(-n // max(c, 1)) for n, c in zip(shape, chunk)]
    axis = max(range(len(shape)), key=lambda a: (counts[a], -a)) if shape else 0

    def read(start, stop):
        index = [slice(None)] * len(shape)
        index[axis] = slice(start, stop)
        return np.asarray(array[tuple(index)].read().result())

    return LeafSlabs.along(shape, axis, chunk[axis] if counts[axis] > 1 else shape[axis],
                           read, array.dtype.numpy_dtype)
