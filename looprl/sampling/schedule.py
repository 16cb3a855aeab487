"""The recorded rollout: tokens, masks, behaviour log-probs and the dynamic **schedule**.

Layout (docs/DESIGN.md §3): rows are left-padded to a common prompt length P; row b's prompt
occupies layout indices [pad_b, P) and its completion [P, P + n_b). Position i emits token i + 1,
so per-position arrays are aligned to the *emitting* position: `exit_loop_BxS[:, i]` is the loop
whose logits emitted `tokens_BxS[:, i + 1]`, `logprob_BxS[:, i]` its log-prob; 0 where nothing is
emitted (earlier prompt positions, padding, after EOS).

The schedule is everything dynamic that determined the numbers: exit loops, the KV policy and
its deferred flushes, how work was grouped (chunk size, batch shape, padding, the compaction's
`row_menu` and `window_widths`, and the rows each pass ran, `RolloutBatch.loop_rows`
`[1, S, T, W]`), the devices, mesh and shardings, the compute dtype, the sampler's kernels
(`invariant`, reproduced by the learner's dense pass; `stock`, only by a forced re-run) and a
fingerprint of the sampler's parameters. The learner never re-decides any of it. With the
row-invariant kernels the compaction's sizes change no bit; a forced re-run on the recorded
rows per device reuses them.

On disk (`save`/`load`): one `.npz` file of the arrays and a JSON `meta` string with
`format_version` (`FORMAT_VERSION`; the older `READABLE_VERSIONS` still load) and the schedule.
"""
from __future__ import annotations

import dataclasses
import json
import weakref
import zipfile
import zlib
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from looprl import legacy
from looprl.errors import ScheduleError

FORMAT_VERSION = 4  # written for a rollout with a thinking budget; others are written as 3
READABLE_VERSIONS = (*legacy.OLD_SCHEDULE_VERSIONS, FORMAT_VERSION)  # older ones: looprl.legacy

_ARRAYS = ("tokens_BxS", "pad_B", "exit_loop_BxS", "logprob_BxS", "logprob_processed_BxS",
           "flush_BxS", "prompt_index_B", "sample_index_B", "completion_len_B")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The non-array part of a rollout's schedule (see module docstring)."""
    kv_policy: str
    exit_threshold: float | None  # q of the Q-exit rule (None with fixed depth)
    fixed_depth: int | None
    deferred_max_pending: int
    chunk_size: int  # positions per decode chunk (the KV policy's `chunk_size`)
    prompt_len: int  # P
    seq_len: int  # S = P + max_new_tokens
    batch_size: int  # B rows
    total_ut_steps: int
    compute_dtype: str
    temperature: float
    top_k: int
    top_p: float
    seed: int
    step: int
    params_fingerprint: str
    devices: int = 1
    backend: str = ""
    row_tile: int = 64
    stop_ids: tuple[int, ...] = (2,)
    kernels: str = "invariant"  # the sampler's kernels: "invariant" or "stock" (replay = forced)
    # where it ran (`looprl.distributed.mesh.mesh_record`): axis sizes, devices, processes, the
    # row split and parameter shardings; None in files written before meshes (one device)
    mesh: dict[str, Any] | None = None
    # what keyed the sampling noise (`looprl.sampling.processing.noise_position`); older files
    # lack it and were keyed by layout position
    noise_keying: str = "layout"
    # the invariant kernels' version (`looprl.kernels.kernel_version()`: the CPU's, with
    # the sgemm ISA when it is not AVX-512, or the accelerator form) the rollout was sampled
    # with; "" in older files (the scanned-rule kernels)
    kernel_version: str = ""
    # the sub-batch sizes of row compaction (`looprl.sampling.compaction.row_menu`); () when
    # every loop ran the whole batch (compaction off, or files of format version 1)
    row_menu: tuple[int, ...] = ()
    # the width of each column of `RolloutBatch.loop_rows`: the positions a decode loop's pass
    # ran per row (the KV policy's `window_widths`); () without compaction
    window_widths: tuple[int, ...] = ()
    # the thinking budget (`looprl.sampling.thinking`): this step's drawn budget (None: off),
    # the answer budget, the forced answer's and the thinking close's token ids
    thinking_budget: int | None = None
    answer_budget: int = 0
    forced_answer_ids: tuple[int, ...] = ()
    think_close_ids: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """The JSON form; without a thinking budget its keys are left out (format 3's form)."""
        d = {k: list(v) if k in _TUPLES else v for k, v in dataclasses.asdict(self).items()}
        off = legacy.THINKING_KEYS if self.thinking_budget is None else ()
        return {k: v for k, v in d.items() if k not in off}

    @classmethod
    def from_dict(cls, d: dict[str, Any], version: int = FORMAT_VERSION) -> "Schedule":
        """The schedule of a file of format `version` (older ones read by `looprl.legacy`).
        Raises ScheduleError naming the keys it lacks."""
        d = legacy.schedule_dict(d, version)
        known = {f.name for f in dataclasses.fields(cls)}
        missing = sorted(known - set(d))
        if missing:
            raise ScheduleError(f"schedule meta is missing keys {missing}")
        d = {k: v for k, v in d.items() if k in known}
        for key in _TUPLES:
            if key in d:
                d[key] = tuple(d[key])
        return cls(**d)


_ALL = (*_ARRAYS, "loop_rows", "forced_BxS")
_TUPLES = ("stop_ids", "row_menu", "window_widths", "forced_answer_ids", "think_close_ids")


@dataclasses.dataclass
class RolloutBatch:
    """A batch of rollouts with its schedule. Arrays are numpy or jax arrays:

    tokens_BxS int32, pad_B int32 (left padding; prompt length = P - pad_b),
    exit_loop_BxS int32 (1..T at emitting positions, else 0), logprob_BxS fp32 (full-vocabulary,
    temperature-scaled, at the exit loop), logprob_processed_BxS fp32 (after top-k/top-p; equal to
    logprob_BxS when truncation is off), flush_BxS bool (deferred: positions whose step was forced
    to run every loop), prompt_index_B / sample_index_B int32, completion_len_B int32 (tokens
    emitted, stop token included), forced_BxS bool or None (emitting positions whose token was
    teacher-forced by the thinking budget, `looprl.sampling.thinking`; None: none was).
    """
    tokens_BxS: Any
    pad_B: Any
    exit_loop_BxS: Any
    logprob_BxS: Any
    logprob_processed_BxS: Any
    flush_BxS: Any
    prompt_index_B: Any
    sample_index_B: Any
    completion_len_B: Any
    schedule: Schedule
    loop_rows: Any = None
    forced_BxS: Any = None

    @property
    def emit_mask_BxS(self):
        """True at positions that emitted a completion token (exit_loop > 0)."""
        return self.exit_loop_BxS > 0

    @property
    def sampled_mask_BxS(self):
        """numpy bool [B, S]: emitting positions whose token was sampled, not forced: what the
        loss and every log-prob claim count."""
        emit = np.asarray(self.exit_loop_BxS) > 0
        return emit if self.forced_BxS is None else emit & ~np.asarray(self.forced_BxS, bool)

    @property
    def completion_mask_BxS(self):
        """True at layout indices holding completion tokens (stop token included)."""
        S, P = self.schedule.seq_len, self.schedule.prompt_len
        idx = np.arange(S)[None, :]
        n = np.asarray(self.completion_len_B)[:, None]
        return (idx >= P) & (idx < P + n)

    def kv_depth_BxS(self):
        """Loops whose KV each position computed itself: T for prompt positions, the exit loop for
        completion positions (used by the `copy` policy's learner)."""
        T, P = self.schedule.total_ut_steps, self.schedule.prompt_len
        idx = np.arange(self.schedule.seq_len)[None, :]
        return np.where(idx < P, T, np.maximum(np.asarray(self.exit_loop_BxS), 1)).astype(np.int32)

    def select(self, rows) -> "RolloutBatch":
        """The rows `rows` (indices, any order) as a new batch with the same layout."""
        rows = np.asarray(rows)
        arrays = {k: np.asarray(getattr(self, k))[rows] for k in _ARRAYS}
        sched = dataclasses.replace(self.schedule, batch_size=int(len(rows)))
        forced = None if self.forced_BxS is None else np.asarray(self.forced_BxS)[rows]
        return RolloutBatch(**arrays, schedule=sched, forced_BxS=forced)

    def without_logprobs(self) -> "RolloutBatch":
        """A copy whose recorded log-probs are NaN (so a replay cannot return stored numbers)."""
        nan = np.full(np.shape(self.logprob_BxS), np.nan, np.float32)
        return dataclasses.replace(self, logprob_BxS=nan, logprob_processed_BxS=nan.copy())

    def to_numpy(self) -> "RolloutBatch":
        return dataclasses.replace(self, **{k: None if getattr(self, k) is None else
                                            np.asarray(getattr(self, k)) for k in _ALL})

    def save(self, path: str | Path) -> None:
        """Write one `.npz` (arrays + JSON meta with `format_version`); atomic via rename."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp.npz")
        arrays = {k: np.asarray(getattr(self, k)) for k in _ARRAYS}
        if self.loop_rows is not None:
            arrays["loop_rows"] = np.asarray(self.loop_rows)
        if self.forced_BxS is not None:
            arrays["forced_BxS"] = np.asarray(self.forced_BxS, bool)
        version = FORMAT_VERSION if self.schedule.thinking_budget is not None else 3  # as before
        meta = {"format_version": version, "schedule": self.schedule.to_dict()}
        np.savez(tmp, meta=np.asarray(json.dumps(meta)), **arrays)
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> "RolloutBatch":
        """Read a file written by `save`. Raises ScheduleError naming the file and problem
        (missing, truncated or corrupt file, not a rollout file, other format version)."""
        path = Path(path)
        try:
            with np.load(path, allow_pickle=False) as z:
                data = {k: z[k] for k in z.files}
            meta = json.loads(str(data.pop("meta"))) if "meta" in data else None
        except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as e:
            raise ScheduleError(f"{path}: cannot read rollout file (truncated or corrupt?): "
                                f"{type(e).__name__}: {e}") from e
        if not isinstance(meta, dict):
            raise ScheduleError(f"{path}: not a looprl rollout file (no 'meta' object)")
        if meta.get("format_version") not in READABLE_VERSIONS:
            raise ScheduleError(f"{path}: format_version {meta.get('format_version')!r}, "
                                f"this looprl reads {list(READABLE_VERSIONS)}")
        missing = [k for k in _ARRAYS if k not in data]
        if missing:
            raise ScheduleError(f"{path}: missing arrays {missing}")
        sched = Schedule.from_dict(meta["schedule"], meta["format_version"])
        return cls(**{k: data[k] for k in _ARRAYS}, schedule=sched,
                   loop_rows=data.get("loop_rows"), forced_BxS=data.get("forced_BxS"))


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
