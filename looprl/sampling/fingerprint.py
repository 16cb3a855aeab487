"""The parameter fingerprint a schedule records: a cheap on-device digest of a parameter tree.

`params_fingerprint` hashes a whole tree. `FingerprintStream` gives the same value for leaves
that arrive one at a time, or in slabs. The rest is the hashing engine: chunked integer sums,
whose value no chunking, slab order or device count changes.
"""
from __future__ import annotations

import weakref

import jax
import jax.numpy as jnp
import numpy as np


def params_fingerprint(params) -> str:
    """A cheap on-device digest of a parameter tree, as 16 hex digits.

    Each leaf is bitcast to uint32 words (bf16 leaves are widened bit-exactly), multiplied by
    position-dependent odd constants and summed modulo 2**32 (integer addition is associative,
    so the reduction order, the chunking and the device count cannot change the result), with
    two independent multiplier streams. Not cryptographic; `looprl.io.checkpoint` computes a
    full SHA-256 at checkpoints.

    Cost: one streaming pass per leaf, in chunks of `_CHUNK` words, so fp32 leaves need no
    temporary larger than two chunks (8 MiB) and are read in place (XLA CPU copies a bf16 leaf
    of rank > 1 once as uint16: at most one leaf-sized temporary); a numpy leaf is copied to
    the device one leaf at a time. The chunks change no bit of the sum, so committed rollouts
    (reproducibility/cpu/rollouts) match their checkpoints. Trees of jax arrays (immutable)
    are remembered: the same tree costs one pass per parameter version; a numpy tree (mutable)
    is hashed on every call, so callers place parameters on the device once
    (`jax.device_put`) and pass those."""
    leaves = jax.tree_util.tree_leaves_with_path(params)
    leaves.sort(key=lambda kv: jax.tree_util.keystr(kv[0]))
    arrays = tuple(leaf for _, leaf in leaves)
    key = tuple(id(x) for x in arrays)
    hit = _FINGERPRINTS.get(key)
    if hit is not None and all(ref() is x for ref, x in zip(hit[0], arrays)):
        return hit[1]
    if all(isinstance(x, jax.Array) for x in arrays):
        digest = _tree_digest(arrays, np.uint32(1))  # one program per tree layout
    else:  # numpy leaves: one leaf on the device at a time (one program per leaf shape)
        digest = sum(_one_leaf_digest(x, i + 1) for i, x in enumerate(arrays))
    fp = _hex(digest)
    if arrays and all(isinstance(x, jax.Array) for x in arrays):  # immutable: safe to remember
        if len(_FINGERPRINTS) >= 8:
            _FINGERPRINTS.pop(next(iter(_FINGERPRINTS)))
        _FINGERPRINTS[key] = (tuple(weakref.ref(x) for x in arrays), fp)
    return fp


class FingerprintStream:
    """`params_fingerprint` of a tree whose leaves arrive one at a time (a loader's order), so
    the tree itself never has to exist at once: a sampler that holds its weights in bf16 still
    records the fingerprint of the fp32 master they were cast from.

    `paths` are the tree's key paths (tuples of dict keys, e.g. `("layers", "q_proj")`), all of
    them; `add(path, leaf)` digests one leaf (numpy or jax, any position in the order), and
    `add(path, slab, shape=, axis=, start=)` one slab of it (`slab` is the part
    `[start, start + slab.shape[axis])` along `axis` of a leaf of `shape`; slabs in any order),
    so a loader that reads a leaf in parts never holds it whole; `hexdigest()` is the value
    `params_fingerprint` gives for the whole tree (the same sum of the same per-leaf digests,
    each salted by its place in sorted path order). Raises ValueError for a path not in
    `paths`, a part overlapping one already added (a leaf or slab added twice), parts of one
    leaf with different shapes or axes, or a leaf not complete at `hexdigest()`."""

    def __init__(self, paths):
        keyed = sorted((jax.tree_util.keystr(tuple(jax.tree_util.DictKey(k) for k in p)),
                        tuple(p)) for p in paths)
        self._salt = {p: i + 1 for i, (_, p) in enumerate(keyed)}
        self._sum = np.zeros(2, np.uint64)
        self._parts: dict[tuple, tuple] = {}  # leaf -> (shape, axis, [(start, stop), ...])

    def add(self, path, leaf, *, shape=None, axis: int = 0, start: int = 0) -> None:
        path = tuple(path)
        name = "/".join(path)
        if path not in self._salt:
            raise ValueError(f"fingerprint stream: parameter {name} not in the tree")
        whole = shape is None
        shape = tuple(int(d) for d in (leaf.shape if whole else shape))
        if whole:  # the whole of axis 0 (a scalar: one position)
            axis, start, stop = 0, 0, shape[0] if shape else 1
        else:
            axis, start = int(axis), int(start)
            stop = start + int(leaf.shape[axis])
        prev_shape, prev_axis, spans = self._parts.get(path, (shape, axis, []))
        if spans and (prev_shape, prev_axis) != (shape, axis):
            raise ValueError(f"fingerprint stream: parameter {name}: a part of shape {shape} "
                             f"along axis {axis} after parts of {prev_shape} along {prev_axis}")
        if any(start < b and a < stop for a, b in spans):
            raise ValueError(f"fingerprint stream: parameter {name} added twice (positions "
                             f"{start}..{stop} along axis {axis} already added)")
        self._parts[path] = (shape, axis, spans + [(start, stop)])
        salt = self._salt[path]
        self._sum += (_one_leaf_digest(leaf, salt) if whole else
                      _slab_digest(leaf, shape, axis, start, salt))

    def _complete(self, path) -> bool:
        if path not in self._parts:
            return False
        shape, axis, spans = self._parts[path]
        return sum(b - a for a, b in spans) == (shape[axis] if shape else 1)

    def hexdigest(self) -> str:
        missing = sorted("/".join(p) for p in self._salt if not self._complete(p))
        if missing:
            raise ValueError(f"fingerprint stream: {len(missing)} parameters never added "
                             f"or incomplete (first {missing[0]})")
        return _hex(self._sum)


def _one_leaf_digest(leaf, salt) -> np.ndarray:
    """uint64 [2]: one leaf's digest (numpy or jax, copied to the device alone) at `salt`, its
    1-based place in sorted path order; sums of these, reduced mod 2**32, are the tree's."""
    return np.asarray(_tree_digest((jnp.asarray(leaf),), np.uint32(salt)), np.uint64)


def _hex(digest) -> str:
    """The 16 hex digits of a two-stream digest (each reduced mod 2**32)."""
    a, b = (int(x) % 2**32 for x in np.asarray(digest, np.uint64))
    return f"{a:08x}{b:08x}"


# Digests of the last few parameter trees made of jax arrays (immutable), keyed by the leaves'
# ids and checked through weak references, so a tree that was freed and whose ids were reused
# is hashed again. Evaluation and verify sample many batches with the same parameters.
_FINGERPRINTS: dict[tuple[int, ...], tuple[tuple[weakref.ref, ...], str]] = {}

_CHUNK = 1 << 20  # words per streamed slice: 4 MiB temporaries whatever the leaf's size


def _digest_words(words, start, salt):
    """The two streams' sums over `words` (uint32 [..., n]) at flat positions
    start..start+n-1 (`start` uint32, or uint32 [...] per row: rows of one leaf)."""
    first = jnp.asarray(start, jnp.uint32)[..., None]
    idx = jnp.arange(words.shape[-1], dtype=jnp.uint32) + first + salt * jnp.uint32(0x9E3779B9)
    m1 = idx * jnp.uint32(2654435761) | jnp.uint32(1)
    m2 = (idx ^ jnp.uint32(0x5BD1E995)) * jnp.uint32(40503) | jnp.uint32(1)
    return jnp.stack([jnp.sum(words * m1, dtype=jnp.uint32),
                      jnp.sum((words ^ (words >> 16)) * m2, dtype=jnp.uint32)])


def _words(x, tag):
    """uint32 words of a flat slice `x`: 4-byte leaves bitcast, 2-byte ones widened, others
    through float32; xor-ed with the leaf's shape tag."""
    if x.dtype.itemsize == 4:
        w = jax.lax.bitcast_convert_type(x, jnp.uint32)
    elif x.dtype == jnp.uint16:
        w = x.astype(jnp.uint32)
    elif x.dtype.itemsize == 2:
        w = jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
    else:
        w = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return w ^ tag


@jax.jit
def _tree_digest(leaves, first_salt):
    """uint32 [2]: the sum of the leaves' digests (salts first_salt (uint32), first_salt + 1,
    ...)."""
    acc = jnp.zeros(2, jnp.uint32)
    for i, leaf in enumerate(leaves):
        acc = acc + _leaf_digest(leaf, first_salt + jnp.uint32(i))
    return acc


def _leaf_digest(leaf, salt):
    """uint32 [2]: one leaf's digest (salt = its 1-based position in sorted path order), as a
    `fori_loop` over `_CHUNK`-word slices plus the tail."""
    if leaf.dtype.itemsize == 2:  # slice raw uint16 words: XLA CPU would widen a whole bf16 leaf
        leaf = jax.lax.bitcast_convert_type(leaf, jnp.uint16)
    return _run_digest(leaf.ravel(), jnp.uint32(0), salt, _shape_tag(leaf.shape))


def _shape_tag(shape) -> jax.Array:
    """uint32: the leaf shape's tag, xor-ed into every word of the leaf."""
    size = int(np.prod(shape, dtype=np.int64))
    return jnp.uint32((len(shape) * 7919 + size) % 2**32)


def _run_digest(flat, first, salt, tag):
    """uint32 [2]: the digest of `flat`, the words at flat positions first..first+n-1 of a
    leaf (`first` uint32, traced), in `_CHUNK`-word slices plus the tail."""
    n = flat.shape[0]
    full = n // _CHUNK

    def body(c, acc):
        start = first + (c * _CHUNK).astype(jnp.uint32)
        x = jax.lax.dynamic_slice(flat, (c * _CHUNK,), (_CHUNK,))
        return acc + _digest_words(_words(x, tag), start, salt)

    acc = jax.lax.fori_loop(0, full, body, jnp.zeros(2, jnp.uint32)) if full else \
        jnp.zeros(2, jnp.uint32)
    if n % _CHUNK:
        acc = acc + _digest_words(_words(flat[full * _CHUNK:], tag),
                                  first + jnp.uint32(full * _CHUNK), salt)
    return acc


@jax.jit
def _runs_digest(runs_RxN, firsts_R, salt, tag):
    """uint32 [2]: the digest of the rows of `runs_RxN` (row r: the words at positions
    firsts_R[r].. of one leaf): long rows one at a time (`_run_digest`), short ones in blocks
    of about `_CHUNK` words, so temporaries stay chunk-sized either way."""
    if runs_RxN.dtype.itemsize == 2:
        runs_RxN = jax.lax.bitcast_convert_type(runs_RxN, jnp.uint16)
    R, n = runs_RxN.shape
    acc = jnp.zeros(2, jnp.uint32)
    if n >= _CHUNK:
        return jax.lax.fori_loop(
            0, R, lambda r, a: a + _run_digest(runs_RxN[r], firsts_R[r], salt, tag), acc)
    rows = max(1, min(R, _CHUNK // n))

    def block(b, a):
        x = jax.lax.dynamic_slice_in_dim(runs_RxN, b * rows, rows)
        f = jax.lax.dynamic_slice_in_dim(firsts_R, b * rows, rows)
        return a + _digest_words(_words(x, tag), f, salt)

    acc = jax.lax.fori_loop(0, R // rows, block, acc)
    if R % rows:
        tail = R - R % rows
        acc = acc + _digest_words(_words(runs_RxN[tail:], tag), firsts_R[tail:], salt)
    return acc


def _slab_digest(slab, shape, axis: int, start: int, salt) -> np.ndarray:
    """uint64 [2]: the digest of `slab`, the part `[start, start + slab.shape[axis])` along
    `axis` of a leaf of `shape`, as the whole leaf's digest counts it (the same words at the
    same flat positions), so the sum over a leaf's slabs is `_one_leaf_digest` of the leaf.
    A slab along axis a is prod(shape[:a]) contiguous runs of the leaf's C-order words."""
    shape = tuple(int(d) for d in shape)
    rows = int(np.prod(shape[:axis], dtype=np.int64))
    inner = int(np.prod(shape[axis + 1:], dtype=np.int64))
    firsts = (np.arange(rows, dtype=np.uint64) * shape[axis] + start) * inner
    runs = jnp.reshape(jnp.asarray(slab), (rows, slab.shape[axis] * inner))
    return np.asarray(_runs_digest(runs, jnp.asarray(firsts % 2**32, jnp.uint32),
                                   np.uint32(salt), _shape_tag(shape)), np.uint64)
