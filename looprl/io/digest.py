"""The checkpoint digests (docs/DESIGN.md §5): `params_sha256` of a parameter tree, whole or
streamed, and `file_sha256` of a file.

The digest feeds the leaves in sorted path order, each as `path|dtype|shape|` (path `/`-joined
keys, dtype numpy name, shape comma-joined) followed by its little-endian bytes. `ParamsSha256`
takes the same leaves one at a time, so a loader that casts each leaf as it arrives (bf16
sampling weights, `looprl.sampling.resident`) still checks the fp32 bytes it read.
"""
from __future__ import annotations

import hashlib
from typing import Any

import jax
import numpy as np


def leaf_path_name(path) -> str:
    """`/`-joined keys of a `tree_flatten_with_path` path (or a tuple of plain keys)."""
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


class ParamsSha256:
    """`params_sha256` fed one leaf at a time, in sorted name order.

    Raises: ValueError for a leaf out of order (its name not after the previous one)."""

    def __init__(self):
        self._h = hashlib.sha256()
        self._last: str | None = None

    def update(self, name: str, leaf) -> None:
        if self._last is not None and name <= self._last:
            raise ValueError(f"params_sha256: leaf {name!r} after {self._last!r} (sorted name "
                             f"order required)")
        self._last = name
        a = np.asarray(leaf)
        a = np.ascontiguousarray(a.astype(a.dtype.newbyteorder("<"), copy=False))
        self._h.update(f"{name}|{a.dtype.name}|{','.join(map(str, a.shape))}|".encode())
        self._h.update(a.reshape(-1).view(np.uint8).data)  # the bytes, not a copy of them

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def file_sha256(path) -> str:
    """SHA-256 (hex) of a file's bytes, read in 4 MiB blocks (checkpoint manifests)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def params_sha256(params: dict[str, Any]) -> str:
    """SHA-256 (hex) of a parameter tree (module docstring)."""
    flat = sorted(((leaf_path_name(path), leaf) for path, leaf in
                   jax.tree_util.tree_flatten_with_path(params)[0]), key=lambda x: x[0])
    h = ParamsSha256()
    for name, leaf in flat:
        h.update(name, leaf)
    return h.hexdigest()
