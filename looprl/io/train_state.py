"""The flat train-state format of a training checkpoint (no file I/O: `looprl.io.checkpoint`
writes and reads it).

A training checkpoint's extra state (optimizer state, run PRNG key, step, data position) is a
pytree; on disk it is stored flat, leaf i as entry `leaf_{i:05d}`, with a record per leaf
({name, dtype, shape, prng_impl}) in the checkpoint's meta file. Names are the leaves' `/`-joined
pytree paths (`leaf_name`); a typed PRNG key is stored as its `jax.random.key_data` (uint32)
with the implementation's name recorded. Restoring checks every leaf against a template and
never casts (`tree_like_template`).
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np

from looprl.errors import CheckpointError


def leaf_name(key_path) -> str:
    """`/`-joined name of a pytree key path (dict keys, sequence indices, attribute names), e.g.
    `opt_state/0/inner_states/train/inner_state/1/0/mu/layers/q_proj`."""
    parts = []
    for k in key_path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def is_prng_key(x) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def flatten_train_state(state) -> tuple[dict[str, np.ndarray], list[dict[str, Any]]]:
    """(orbax tree {leaf_00000: array, ...}, leaf records [{name, dtype, shape, prng_impl}]).

    Every leaf becomes a numpy array (a Python or numpy scalar a 0-d array of its own dtype); a
    typed PRNG key becomes its `key_data` (uint32) with the implementation's name recorded."""
    flat, records = {}, []
    leaves = jax.tree_util.tree_flatten_with_path(state, is_leaf=is_prng_key)[0]
    for i, (path, leaf) in enumerate(leaves):
        impl = None
        if is_prng_key(leaf):
            impl = str(jax.random.key_impl(leaf))
            leaf = jax.random.key_data(leaf)
        # sharded arrays stay jax arrays (each process writes its shards), the rest numpy
        sharded = isinstance(leaf, jax.Array) and not leaf.is_fully_replicated
        a = leaf if sharded else np.asarray(leaf)
        flat[f"leaf_{i:05d}"] = a
        records.append({"name": leaf_name(path), "dtype": np.dtype(a.dtype).name,
                        "shape": list(a.shape), "prng_impl": impl})
    names = [r["name"] for r in records]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise CheckpointError(f"train_state: leaf names {dup[:3]} are ambiguous (a key holds '/')")
    return flat, records


def tree_like_template(stored: dict[str, Any], template: Any, where: str) -> Any:
    """`stored` ({leaf name: array or typed PRNG key}, names as `leaf_name` makes them) as a
    pytree with `template`'s structure, after checking that the names are the template's, and
    every leaf's dtype and shape (for a typed key: its impl and shape) equal the template's.

    Raises: CheckpointError naming the array, the expected and the found dtype/shape; never
    casts."""
    t_leaves, treedef = jax.tree_util.tree_flatten_with_path(template, is_leaf=is_prng_key)
    names = [leaf_name(p) for p, _ in t_leaves]
    extra = sorted(set(stored) - set(names))
    if extra:
        raise CheckpointError(f"{where}: unexpected array {extra[0]!r} (not in the template; "
                              f"{len(extra)} unexpected in all)")
    out = []
    for name, (_, t) in zip(names, t_leaves):
        if name not in stored:
            raise CheckpointError(f"{where}: array {name!r} missing (expected "
                                  f"{_describe(t)})")
        a = stored[name]
        if is_prng_key(a) != is_prng_key(t) or (
                is_prng_key(a) and str(jax.random.key_impl(a)) != str(jax.random.key_impl(t))):
            raise CheckpointError(f"{where}: array {name!r} is {_describe(a)}, expected "
                                  f"{_describe(t)}")
        if np.shape(a) != np.shape(t) or (not is_prng_key(a) and
                                          dtype_of(a) != dtype_of(t)):
            raise CheckpointError(f"{where}: array {name!r} is {_describe(a)}, expected "
                                  f"{_describe(t)} (restores never cast)")
        out.append(a)
    return jax.tree_util.tree_unflatten(treedef, out)


def _describe(leaf) -> str:
    if is_prng_key(leaf):
        return f"a PRNG key ({jax.random.key_impl(leaf)}) of shape {list(np.shape(leaf))}"
    return f"dtype {dtype_of(leaf).name} shape {list(np.shape(leaf))}"


def dtype_of(x) -> np.dtype:
    """A leaf's dtype without reading its values (a sharded array may span processes)."""
    return np.dtype(x.dtype) if hasattr(x, "dtype") else np.asarray(x).dtype
