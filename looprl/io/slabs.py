"""A parameter leaf handed to a loader's `leaf_fn` in slabs along one axis, so a consumer that
holds its weights in another form (bf16 sampling weights on the device) never holds
the fp32 leaf whole.

The loaders choose the slabs from how the leaf is stored: a looprl checkpoint's leaf along the
axis its chunk grid splits into the most chunks (`looprl.io.orbax_tree`: tensorstore reads whole
chunks, each once), an HF checkpoint's layer stack one layer per slab (`looprl.io.hf`: one
tensor per layer), any other leaf as one slab.

    def leaf_fn(keys, leaf: LeafSlabs):
        for start, slab_fp32 in leaf:   # slab = leaf[..., start:start + n, ...] along leaf.axis
            ...
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import numpy as np

_FP32 = np.dtype(np.float32)


@dataclasses.dataclass(frozen=True)
class LeafSlabs:
    """One leaf of `shape` and `dtype`, read as the slabs `[start, stop)` along `axis` in
    `bounds` (in order, covering the axis). `read(start, stop)` returns that slab as a numpy
    array (`shape` with `stop - start` along `axis`); iterating yields `(start, slab)`."""
    shape: tuple[int, ...]
    axis: int
    bounds: tuple[tuple[int, int], ...]
    read: Callable[[int, int], np.ndarray]
    dtype: np.dtype = _FP32  # as stored (loaders refuse all but fp32)

    def __iter__(self) -> Iterator[tuple[int, np.ndarray]]:
        for start, stop in self.bounds:
            yield start, self.read(start, stop)

    def full(self) -> np.ndarray:
        """The whole leaf, `[*shape]` in `dtype` (one slab: that slab itself, no copy)."""
        if len(self.bounds) == 1:
            return self.read(*self.bounds[0])
        out = np.empty(self.shape, self.dtype)
        for start, slab in self:
            index = [slice(None)] * len(self.shape)
            index[self.axis] = slice(start, start + slab.shape[self.axis])
            out[tuple(index)] = slab
        return out

    @classmethod
    def whole(cls, array: np.ndarray) -> LeafSlabs:
        """`array` (fp32, rank >= 1) as one slab."""
        return cls(tuple(array.shape), 0, ((0, array.shape[0]),), lambda start, stop: array,
                   array.dtype)

    @classmethod
    def along(cls, shape, axis: int, step: int, read, dtype=np.float32) -> LeafSlabs:
        """Slabs of `step` (the last one shorter) along `axis` of a leaf of `shape`."""
        n = shape[axis]
        return cls(tuple(shape), axis,
                   tuple((s, min(s + step, n)) for s in range(0, n, max(step, 1))), read,
                   np.dtype(dtype))
