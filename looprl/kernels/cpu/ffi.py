"""The ordered CPU kernels as XLA FFI custom calls: `ordered_matmul(x, w)` and its layer,
batched and attention forms, and the row reductions `row_sum`, `row_max`, `row_argmax`.

`out[m, n]` is built in the order the C++ sources fix (`ordered_common.h`): K_CHUNK-long chunks
from k = 0, each an fma chain over its k in order from -0.0, the chunks added in order.
Nothing depends on anything but row m of x and column n of w, so a row's bits cannot change
with its batch, the thread count or the ISA (docs/NUMERICS.md; `reference_matmul` writes the
same in numpy). Subnormal inputs and results are flushed to zero.

The sources (`ordered_matmul.cc`, `ordered_attention.cc`, `ordered_reductions.cc` and their
headers) are compiled with the machine's C++ compiler the first time a kernel is used, into
`LOOPRL_KERNEL_CACHE` (default `~/.cache/looprl/kernels`), keyed by every source, the
compiler, jax's version, the FFI headers and the flags, and written atomically, so that
concurrent processes (pytest-xdist workers) share one build.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from looprl.errors import ConfigError, create_dir

_HERE = Path(__file__).parent / "csrc"
SOURCES = tuple(_HERE / f"ordered_{name}.cc" for name in ("matmul", "attention", "reductions"))
HEADERS = (_HERE / "ordered_common.h", _HERE / "ordered_chains.h")
TARGET = "looprl_ordered_matmul"
K_CHUNK = 256  # the C++ KC: the contraction's chunk, part of the numerics (kernel version)
KEY_BLOCK = 128  # the C++ KEY_BLOCK: attention's key block (`kernels.K_BLOCK`)


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def compile_flags() -> list[str]:
    """The compiler flags: vector code for AVX2 + FMA where the CPU has both (the bits are the
    same without: IEEE fma and + are correctly rounded)."""
    flags = ["-O3", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off", "-fno-fast-math"]
    if {"avx2", "fma"} <= _cpu_flags():
        flags += ["-mavx2", "-mfma"]
    return flags


# what a failed build's error offers instead of the kernel
_FALLBACK = ("without it, LOOPRL_KERNELS=cpu-xla selects the XLA CPU form (another kernel "
             "version: rollouts of one form do not verify under the other)")


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise ConfigError("looprl's CPU kernels need a C++ compiler to build "
                          f"({', '.join(s.name for s in SOURCES)}): none found (set CXX, or "
                          f"install g++); {_FALLBACK}")
    return cxx


def _cache_dir() -> Path:
    return Path(os.environ.get("LOOPRL_KERNEL_CACHE",
                               Path.home() / ".cache" / "looprl" / "kernels"))


BUILD_S = "10-100"  # the first build's seconds: an idle 2-core host, a loaded one


def build() -> Path:
    """The compiled kernel library, built on first use (module doc), with one line on stderr
    before the compiler starts. Raises ConfigError naming the compiler command and its output
    when the build fails."""
    cxx = _compiler()
    include = jax.ffi.include_dir()
    flags = compile_flags()
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    except OSError as e:  # CXX names no runnable program
        raise ConfigError(f"building looprl's CPU matmul kernel failed: cannot run the "
                          f"compiler {cxx!r} (CXX): {e}; {_FALLBACK}") from e
    texts = [f.read_text() for f in (*SOURCES, *HEADERS)]  # the key covers every source
    key = hashlib.sha256("\0".join([*texts, cxx, version.splitlines()[0]
                                    if version else "", jax.__version__, include, *flags])
                         .encode()).hexdigest()[:16]
    cache = _cache_dir()
    lib = cache / f"ordered_gemm-{key}.so"
    if lib.exists():
        return lib
    create_dir(cache, "LOOPRL_KERNEL_CACHE")
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    cmd = [cxx, *flags, f"-I{include}", *map(str, SOURCES), "-o", tmp]
    print(f"looprl: compiling looprl's CPU kernels (first run, about {BUILD_S} s; cached in "
          f"{cache})...", file=sys.stderr, flush=True)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
            raise ConfigError(f"building looprl's CPU matmul kernel failed: {' '.join(cmd)}\n"
                              f"{tail}\n{_FALLBACK}")
        os.chmod(tmp, 0o755)  # mkstemp's 0600 would hide it from other users of a shared cache
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


TARGETS = {TARGET: "LooprlOrderedMatmul",
           "looprl_ordered_matmul_layer": "LooprlOrderedMatmulLayer",
           "looprl_ordered_batched_matmul": "LooprlOrderedBatchedMatmul",
           "looprl_ordered_batched_matmul_t": "LooprlOrderedBatchedMatmulT",
           "looprl_ordered_attention_scores": "LooprlOrderedAttentionScores",
           "looprl_ordered_attention_values": "LooprlOrderedAttentionValues",
           "looprl_row_argmax": "LooprlRowArgmax",
           "looprl_row_sum": "LooprlRowSum",
           "looprl_row_max": "LooprlRowMax"}


@functools.cache
def _registered() -> str:
    """Builds (once per process) and registers every FFI target of the library."""
    library = ctypes.cdll.LoadLibrary(str(build()))
    for name, symbol in TARGETS.items():
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(library, symbol)),
                                    platform="cpu")
    return TARGET


def _check_product(name: str, x_MxK, w, w_dims: str) -> None:
    """Raises ValueError naming `name` unless x is a float32 `[M, K]` and w a float32 or
    bfloat16 weight of dims `w_dims` (`[K, N]`, or a stack `[L, K, N]`) contracting over K."""
    rank = w_dims.count(",") + 1
    if x_MxK.ndim != 2 or w.ndim != rank or x_MxK.shape[1] != w.shape[-2]:
        raise ValueError(f"{name}: x {x_MxK.shape} and w {w.shape} are not [M, K] and {w_dims}")
    if x_MxK.dtype != jnp.float32 or w.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"{name}: x must be float32 (got {x_MxK.dtype}) and w float32 or "
                         f"bfloat16 (got {w.dtype})")


def ordered_matmul(x_MxK: jax.Array, w_KxN: jax.Array) -> jax.Array:
    """`x @ w` in fp32 in the fixed order of the module doc. x: `[M, K]` float32; w: `[K, N]`
    float32 or bfloat16 (widened exactly). Returns `[M, N]` float32. XLA CPU only (an FFI
    target registered for the CPU platform). Raises ValueError for other ranks, dtypes or a
    contraction mismatch (at trace time), ConfigError if the kernel cannot be built."""
    _check_product("ordered_matmul", x_MxK, w_KxN, "[K, N]")
    out = jax.ShapeDtypeStruct((x_MxK.shape[0], w_KxN.shape[1]), jnp.float32)
    return jax.ffi.ffi_call(_registered(), out, vmap_method="sequential")(x_MxK, w_KxN)


def ordered_matmul_layer(x_MxK: jax.Array, w_LxKxN: jax.Array, layer) -> jax.Array:
    """`ordered_matmul(x, w[layer])` with layer `layer` of the stack read in place: no copy of
    the layer's weight is made for the call (a `lax.scan` or dynamic slice over the stack makes
    one on XLA CPU: 46 MB a call at Ouro-1.4B's MLP widths in fp32). The same values, so the
    same bits. x: `[M, K]` float32; w: `[L, K, N]` float32 or bfloat16; layer: an int scalar
    (may be traced; one outside [0, L) fails the call). Returns `[M, N]` float32. Raises
    ValueError for other ranks, dtypes or a contraction mismatch (at trace time)."""
    _check_product("ordered_matmul_layer", x_MxK, w_LxKxN, "[L, K, N]")
    _registered()
    out = jax.ShapeDtypeStruct((x_MxK.shape[0], w_LxKxN.shape[2]), jnp.float32)
    return jax.ffi.ffi_call("looprl_ordered_matmul_layer", out, vmap_method="sequential")(
        x_MxK, w_LxKxN, jnp.asarray(layer, jnp.int32).reshape(1))


def row_argmax(x_RxN: jax.Array) -> jax.Array:
    """`jnp.argmax(x, axis=-1)` of a materialised `[R, N]` float32 array (N >= 1), int32 `[R]`:
    each row's first maximum, or its first NaN. An FFI call, so XLA cannot fuse x's producer
    into it (`looprl.sampling.processing.sample_tokens`). XLA CPU only. Raises ValueError for
    another rank, dtype or N = 0 (at trace time)."""
    if x_RxN.ndim != 2 or x_RxN.shape[1] == 0 or x_RxN.dtype != jnp.float32:
        raise ValueError(f"row_argmax: x {x_RxN.shape} {x_RxN.dtype} is not a float32 [R, N] "
                         "with N >= 1")
    _registered()
    out = jax.ShapeDtypeStruct((x_RxN.shape[0],), jnp.int32)
    return jax.ffi.ffi_call("looprl_row_argmax", out, vmap_method="sequential")(x_RxN)


def _row_call(name: str, x_xN: jax.Array, *keep: jax.Array) -> jax.Array:
    """The FFI reduction `name` of x's last axis: float32 `[...]` from a float32 `[..., N]`;
    `keep` are operands the kernel does not read (`row_sum`)."""
    if x_xN.ndim == 0 or x_xN.dtype != jnp.float32:
        raise ValueError(f"{name}: x {x_xN.shape} {x_xN.dtype} is not a float32 [..., N]")
    _registered()
    out = jax.ShapeDtypeStruct(x_xN.shape[:-1], jnp.float32)
    return jax.ffi.ffi_call(f"looprl_{name}", out, vmap_method="broadcast_all")(x_xN, *keep)


def row_sum(x_xN: jax.Array, keep: tuple = ()) -> jax.Array:
    """Each row's sum in `ordered_matmul`'s order, bit for bit `ordered_matmul(x, ones)[..., 0]`
    (the chain with a weight of ones: `fma(x, 1.0, acc)` is `x + acc` rounded once), for a
    sixteenth of that product's work (`kernels.rowsum`). x: float32 `[..., N]` (N may be 0:
    -0.0). `keep`: arrays passed to the call and not read, so that XLA keeps their buffers
    until x is summed (`kernels.softmax`: XLA CPU writing `exp(p - max)` over p in place runs
    its loop scalar, 8x slower). Returns float32 `[...]`. XLA CPU only. Raises ValueError for
    another dtype or a scalar (at trace time)."""
    return _row_call("row_sum", x_xN, *keep)


def row_max(x_xN: jax.Array) -> jax.Array:
    """Each row's largest value, NaN where the row has one (-inf for N = 0), float32 `[...]`
    from float32 `[..., N]` (`kernels.softmax`). Between +0.0, -0.0 and (subnormals read as
    zero) subnormals which one is returned is not specified: `exp(x - max)` is the same for
    each. Not differentiable. XLA CPU only. Raises ValueError as `row_sum`."""
    return _row_call("row_max", x_xN)


def ordered_batched_matmul(x_ZxMxK: jax.Array, w: jax.Array, transposed: bool = False):
    """Z independent products in the numerics of `ordered_matmul`, each output exactly what a
    single `[M, K] x [K, N]` call gives it (so a product's bits do not depend on Z or on its
    place): x `[Z, M, K]` float32; w `[Z, K, N]` float32, or `[Z, N, K]` with `transposed`
    (`x[z] @ w[z].T`, the attention scores' form). Returns `[Z, M, N]` float32. Raises
    ValueError for other ranks, dtypes or mismatched dims (at trace time)."""
    kw = 2 if transposed else 1
    if (x_ZxMxK.ndim != 3 or w.ndim != 3 or x_ZxMxK.shape[0] != w.shape[0]
            or x_ZxMxK.shape[2] != w.shape[kw]):
        raise ValueError(f"ordered_batched_matmul: x {x_ZxMxK.shape} and w {w.shape} are not "
                         f"[Z, M, K] and {'[Z, N, K]' if transposed else '[Z, K, N]'}")
    if x_ZxMxK.dtype != jnp.float32 or w.dtype != jnp.float32:
        raise ValueError(f"ordered_batched_matmul: x and w must be float32 (got {x_ZxMxK.dtype}"
                         f", {w.dtype})")
    _registered()
    target = "looprl_ordered_batched_matmul" + ("_t" if transposed else "")
    out = jax.ShapeDtypeStruct((x_ZxMxK.shape[0], x_ZxMxK.shape[1], w.shape[3 - kw]),
                               jnp.float32)
    return jax.ffi.ffi_call(target, out, vmap_method="sequential")(x_ZxMxK, w)


def _attention_call(target, x, cache, win, rows_M, offset_M, slot, w0, live_blocks, slots,
                    out_last, span_M=None):
    """Checks attention's operands at trace time (ValueError naming the tensor and its shape)
    and calls `target`."""
    name = target.removeprefix("looprl_")
    if x.ndim != 4 or cache.ndim != 5 or win.ndim != 4 or win.shape[0] != x.shape[0]:
        raise ValueError(f"{name}: x {x.shape}, the cache {cache.shape} and the window "
                         f"{win.shape} are not [M, H, R, *], [N, B, S, J, D] and [M, C, J, D]")
    if x.dtype != jnp.float32 or {cache.dtype, win.dtype} - {jnp.dtype(jnp.float32),
                                                             jnp.dtype(jnp.bfloat16)}:
        raise ValueError(f"{name}: x must be float32 (got {x.dtype}), the cache and window "
                         f"float32 or bfloat16 (got {cache.dtype}, {win.dtype})")
    if win.dtype != cache.dtype:
        raise ValueError(f"{name}: the window is {win.dtype} and the cache {cache.dtype} (the "
                         "window is written into the cache: one dtype)")
    if (0 in (x.shape[1], cache.shape[3], cache.shape[4]) or x.shape[1] % cache.shape[3]
            or win.shape[2:] != cache.shape[3:] or not 1 <= win.shape[1] <= cache.shape[2]):
        raise ValueError(f"{name}: {x.shape[1]} heads cannot read the cache {cache.shape} with "
                         f"the window {win.shape} (kv heads must divide the heads, none of "
                         "heads, kv heads and head dim be 0, the window hold 1..S slots of the "
                         "same heads and head dim)")
    if slots % KEY_BLOCK or slots < cache.shape[2]:
        raise ValueError(f"{name}: {slots} key slots is not a multiple of {KEY_BLOCK} covering "
                         f"the cache's {cache.shape[2]}")
    per_row = [rows_M, offset_M] + ([] if span_M is None else [span_M])
    if any(np.shape(a) != (x.shape[0],) for a in per_row):
        raise ValueError(f"{name}: rows, offsets (and spans) {[np.shape(a) for a in per_row]} "
                         f"are not [M] = [{x.shape[0]}]")
    _registered()
    ints = jnp.stack([jnp.asarray(v, jnp.int32) for v in (slot, w0, live_blocks)])
    out = jax.ShapeDtypeStruct((*x.shape[:3], out_last), jnp.float32)
    return jax.ffi.ffi_call(target, out, vmap_method="sequential")(
        x, cache, win, *(jnp.asarray(a, jnp.int32) for a in per_row), ints)


def ordered_attention_scores(q_MxHxRxD, k_NxBxSxJxD, k_win_MxCxJxD, rows_M, offset_M, span_M,
                             slot, w0, live_blocks, slots: int) -> jax.Array:
    """Attention scores `q . k` of one query tile in the numerics of `ordered_matmul`, the keys
    read from the KV cache in place (`ordered_attention.cc`'s header comment).

    Row m's keys are slot `slot` of the cache at batch row `rows_M[m]`, with `k_win[m]`
    written over slots [w0, w0 + C) (w0 clamped to [0, S - C]: what `dynamic_update_slice`
    of the slot holds); head h reads kv head `h // (H // J)` (GQA). The key axis is rotated
    left per row by `offset_M` (rotated slot t holds key `min((t + offset_m) mod slots, S -
    1)`) and taken in KEY_BLOCK-slot blocks, of which the first `live_blocks` are computed:
    each score is what `ordered_matmul` gives `q[m, h] @ keys.T` for the block, the slots of
    later blocks +0.0. Rotated slots at or past `span_M[m]` are ones no query of row m sees
    (the caller masks their scores): they are computed only to the end of the 16-slot panel
    holding slot `span_m - 1`, and are +0.0 after it.

    Args: q `[M, H, R, D]` float32; k `[N, B, S, J, D]` and k_win `[M, C, J, D]` float32 or
      bfloat16 (widened exactly); rows_M, offset_M, span_M int `[M]`; slot, w0, live_blocks int
      scalars (may be traced); slots: Sp, a multiple of KEY_BLOCK >= S (the mask's padded key
      axis).
    Returns `[M, H, R, Sp]` float32. Raises ValueError for other ranks, dtypes or sizes (at
    trace time); a slot or row outside the cache fails the call (XLA's error names it)."""
    if q_MxHxRxD.ndim == 4 and k_NxBxSxJxD.ndim == 5 and q_MxHxRxD.shape[3] != \
            k_NxBxSxJxD.shape[4]:
        raise ValueError(f"ordered_attention_scores: q {q_MxHxRxD.shape} and k "
                         f"{k_NxBxSxJxD.shape} differ in head dim")
    return _attention_call("looprl_ordered_attention_scores", q_MxHxRxD, k_NxBxSxJxD,
                           k_win_MxCxJxD, rows_M, offset_M, slot, w0, live_blocks, slots, slots,
                           span_M)


def ordered_attention_values(p_MxHxRxS, v_NxBxSxJxD, v_win_MxCxJxD, rows_M, offset_M, span_M,
                             slot, w0, live_blocks) -> jax.Array:
    """Attention's value product of one query tile over the same rotated KEY_BLOCK-slot blocks
    and in-place values as `ordered_attention_scores`: `out = ((-0.0 + c_0) + c_1) + ...` over
    the first `live_blocks` blocks, `c_j` what `ordered_matmul` gives `p[m, h, :, block j] @
    values(block j)` (one 128-long fma chain per output); -0.0 when `live_blocks` is 0.

    `span_M[m]`: as in `ordered_attention_scores`, the rotated slots a query of row m sees.
    The values at or past it are not read where that cannot change a bit: a block's chain
    stops after the span when every probability past it is a zero and no output of the block
    is -0.0 there (adding `0 * v` changes only -0.0, for a finite `v`; the caller keeps the
    masked slots' values finite: docs/NUMERICS.md). Every output is the full chain's.

    Args: p (probabilities) `[M, H, R, Sp]` float32, Sp a multiple of KEY_BLOCK >= S; v
      `[N, B, S, J, D]` and v_win `[M, C, J, D]` float32 or bfloat16; the rest as
      `ordered_attention_scores`.
    Returns `[M, H, R, D]` float32. Raises ValueError as `ordered_attention_scores`."""
    slots = p_MxHxRxS.shape[-1] if p_MxHxRxS.ndim else 0
    return _attention_call("looprl_ordered_attention_values", p_MxHxRxS, v_NxBxSxJxD,
                           v_win_MxCxJxD, rows_M, offset_M, slot, w0, live_blocks, slots,
                           v_NxBxSxJxD.shape[-1], span_M)


def _flush(a):
    """float32 subnormals -> zero of the same sign (the kernel's FTZ/DAZ, module doc)."""
    a = np.asarray(a, np.float32)
    return np.where(np.abs(a) < np.finfo(np.float32).tiny, np.copysign(np.float32(0), a), a)


def _fma32(a, b, c):
    """Correctly rounded float32 fma(a, b, c), elementwise in numpy: a * b is exact in float64,
    TwoSum gives the float64 sum's exact error, and rounding that sum to odd before the float32
    rounding makes the double rounding exact (53 >= 24 + 2 bits); an infinite sum is left as it
    is (its TwoSum error is NaN)."""
    p = a.astype(np.float64) * b.astype(np.float64)
    c = np.broadcast_to(c, p.shape).astype(np.float64)
    with np.errstate(invalid="ignore"):
        s = p + c
        bb = s - p
        e = (p - (s - bb)) + (c - bb)
    odd = (s.view(np.uint64) & 1).astype(bool)
    s = np.where(np.isfinite(s) & (e != 0) & ~odd, np.nextafter(s, s + e), s)
    return s.astype(np.float32)


def reference_matmul(x_MxK: np.ndarray, w_KxN: np.ndarray) -> np.ndarray:
    """The kernel's numerics written out in numpy (module doc): float32 `[M, N]` from float32
    `[M, K]` and float32 `[K, N]` (a bf16 weight: pass it widened to float32), subnormal inputs
    and results flushed to zero as the kernel does. Slow (one numpy step per k); for tests."""
    x = _flush(x_MxK)
    w = _flush(w_KxN)
    out = None
    for s in range(0, x.shape[1], K_CHUNK):
        acc = np.full((x.shape[0], w.shape[1]), -0.0, np.float32)
        for k in range(s, min(s + K_CHUNK, x.shape[1])):
            acc = _flush(_fma32(x[:, k:k + 1], w[k:k + 1, :], acc))
        out = acc if out is None else _flush(out + acc)
    return out if out is not None else np.full((x.shape[0], w.shape[1]), -0.0, np.float32)
