"""A Pallas matmul with fixed blocks: the matmul of the `pallas-gpu` / `pallas-tpu` kernel forms.

`x [M, I] @ w [I, O]` with rows zero-padded to a multiple of `block_rows` (bm), output columns
to `block_cols` (bn) and the contraction to `block_k` (bk). The grid is `(Mp / bm, Op / bn)`;
program (i, j) owns the `[bm, bn]` output block of row block i and column block j:

    acc = -0.0                               (fp32, [bm, bn])
    for z in 0 .. Ip / bk - 1:               (in order; one program, no split-K)
        acc = acc + dot(x[i-th bm rows, z-th bk cols], w[z-th bk rows, j-th bn cols])  (fp32)
    out[i, j] = acc

Every dot has one shape whatever M, programs are independent, and the K order is the loop, so
no compiler choice can change a row's bits (docs/NUMERICS.md, "The accelerator forms"). fp32
dots ask for `Precision.HIGHEST` (no TF32); bf16 dots accumulate in fp32. bm = 64 (a decode
step's row costs a `[64, I]` tile), bn = bk = 128 (powers of two, as Triton loads require). On
a GPU the kernel is lowered through Triton: Mosaic GPU stages whole blocks, here the whole
contraction, in shared memory. Interpret mode runs the same kernel body as XLA ops (the CPU
tests). Forward only: `kernels.matmul`'s `jax.custom_vjp` gives the plain-dot backward.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

BLOCK_ROWS = 64
BLOCK_COLS = 128
BLOCK_K = 128


def pad_to_multiple(x, axis: int, multiple: int):
    """`x` zero-padded at the end of `axis` to a multiple of `multiple` (unchanged if it is one);
    also `kernels`' padding."""
    n = x.shape[axis]
    n_pad = -(-n // multiple) * multiple
    if n_pad == n:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, n_pad - n)
    return jnp.pad(x, widths)


def _kernel(x_ref, w_ref, o_ref, *, block_k: int, precision):
    """One `[bm, bn]` output block: the K blocks of its rows and columns, summed in order."""
    bm, bn = o_ref.shape
    nk = x_ref.shape[1] // block_k

    def step(z, acc):
        x_RxZ = x_ref[:, pl.ds(z * block_k, block_k)]
        w_ZxC = w_ref[pl.ds(z * block_k, block_k), :]
        return acc + jnp.dot(x_RxZ, w_ZxC, preferred_element_type=jnp.float32,
                             precision=precision)

    acc = jax.lax.fori_loop(0, nk, step, jnp.full((bm, bn), -0.0, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def _forward(x_MxI, w_IxO, out_dtype, block_rows, block_cols, block_k, interpret, backend):
    m, i = x_MxI.shape
    o = w_IxO.shape[1]
    if x_MxI.dtype != w_IxO.dtype:
        raise ValueError(f"pallas_matmul: x is {x_MxI.dtype} and w is {w_IxO.dtype}; "
                         "they must have one dtype")
    if m == 0:
        return jnp.zeros((0, o), out_dtype)
    precision = jax.lax.Precision.HIGHEST if x_MxI.dtype == jnp.float32 else None
    x = pad_to_multiple(pad_to_multiple(x_MxI, 0, block_rows), 1, block_k)
    w = pad_to_multiple(pad_to_multiple(w_IxO, 0, block_k), 1, block_cols)
    mp, ip = x.shape
    op = w.shape[1]
    out = pl.pallas_call(
        functools.partial(_kernel, block_k=block_k, precision=precision),
        out_shape=jax.ShapeDtypeStruct((mp, op), out_dtype),
        grid=(mp // block_rows, op // block_cols),
        in_specs=[pl.BlockSpec((block_rows, ip), lambda r, c: (r, 0)),
                  pl.BlockSpec((ip, block_cols), lambda r, c: (0, c))],
        out_specs=pl.BlockSpec((block_rows, block_cols), lambda r, c: (r, c)),
        interpret=interpret,
        # GPU: the Triton lowering (jax 0.10's default GPU lowering is Mosaic GPU, which copies
        # each whole block, here the whole contraction, into shared memory and fails at the
        # Ouro widths); TPU: Mosaic TPU, the only one
        compiler_params=pltriton.CompilerParams() if backend == "gpu" and not interpret
        else None,
        name="looprl_fixed_block_matmul",
    )(x, w)
    return out[:m, :o]


def pallas_matmul(x_MxI: jax.Array, w_IxO: jax.Array, out_dtype=None, *,
                  block_rows: int = BLOCK_ROWS, block_cols: int = BLOCK_COLS,
                  block_k: int = BLOCK_K, interpret: bool | None = None,
                  backend: str | None = None) -> jax.Array:
    """Row-invariant `x @ w` as one Pallas kernel with fixed blocks (module doc); forward only
    (differentiate through `kernels.matmul`).

    Args:
      x_MxI: `[M, I]` fp32 or bf16. w_IxO: `[I, O]`, the same dtype.
      out_dtype: the output dtype (accumulation is always fp32); default x's dtype.
      block_rows, block_cols, block_k: bm, bn, bk (powers of two for the Triton lowering).
      interpret: run the kernel body as XLA ops (Pallas interpret mode); default: on the CPU,
        which has no Pallas compiler.
      backend: the platform the kernel is lowered for (`gpu`: Triton; `tpu`: Mosaic TPU);
        default `jax.default_backend()` (an argument so that a CPU test can export for both).
    Returns: `[M, O]` in `out_dtype`.
    Raises: ValueError if x and w differ in dtype.
    """
    backend = backend or jax.default_backend()
    if interpret is None:
        interpret = backend == "cpu"
    out_dtype = jnp.dtype(out_dtype or x_MxI.dtype)
    return _forward(x_MxI, w_IxO, out_dtype, block_rows, block_cols, block_k, interpret,
                    backend)
