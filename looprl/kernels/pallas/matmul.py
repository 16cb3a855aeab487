"""A Pallas matmul with fixed blocks: the matmul of the `pallas-gpu` / `pallas-tpu` kernel forms.

`x [M, I] @ w [I, O]` with rows zero-padded to a multiple of `block_rows` (bm = 64: a decode
step's row costs a `[64, I]` tile), output columns to `block_cols` (bn = 128) and the
contraction to `block_k` (bk = 128). The tile depends on nothing but these constants, never on
M. The grid is `(Mp / bm, Op / bn)`; program (i, j) owns the `[bm, bn]` output block of row block
i and column block j and runs the K blocks z = 0 .. Ip / bk - 1 in order, `acc = acc + dot(x_z,
w_z)` from acc = -0.0 in fp32 (no split-K; programs are independent). On a TPU the grid is
`(Op / bn, Mp / bm)`: column blocks outer, so each weight block is copied into VMEM once and
the rows again per column block (bn > bm: fewer bytes at any shape); the programs are
independent, so the order moves no bit.

What the compilers emit from that loop: Triton folds `acc + dot` into `dot(x_z, w_z, acc)`, so
on a GPU each fp32 output is ONE fma chain over the whole contraction, k = 0 .. Ip - 1 in order
(fp32 operands: `fma.rn.f32` only, no TF32, as `Precision.HIGHEST` asks), not block partials
added afterwards; bf16 operands run Hopper `wgmma` with the fp32 accumulator carried through
every instruction, and the order inside one instruction's k-group is the hardware's. On a TPU,
Mosaic runs each `[bm, bk] x [bk, bn]` block on the MXU (fp32 in its multi-pass form at
HIGHEST) and adds it to the fp32 accumulator in z order. Either way every row sees the same
instruction sequence at every M. Interpret mode runs the same body as XLA ops (the CPU tests).
Where it is compiled is `pallas.target` (the platform lowered for). Forward only:
`kernels.matmul`'s `jax.custom_vjp` gives the plain-dot backward.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from looprl.kernels.pallas.target import compiler_params, fence, lowered
from looprl.kernels.tiling import pad_to_multiple

BLOCK_ROWS = 64
BLOCK_COLS = 128
BLOCK_K = 128


def _kernel(x_ref, w_ref, o_ref, *, block_k: int, precision, interpret: bool):
    """One `[bm, bn]` output block: the K blocks of its rows and columns, summed in order."""
    bm, bn = o_ref.shape
    nk = x_ref.shape[1] // block_k

    def step(z, acc):
        x_RxZ, w_ZxC = fence(interpret, x_ref[:, pl.ds(z * block_k, block_k)],
                             w_ref[pl.ds(z * block_k, block_k), :])
        return acc + jnp.dot(x_RxZ, w_ZxC, preferred_element_type=jnp.float32,
                             precision=precision)

    acc = jax.lax.fori_loop(0, nk, step, jnp.full((bm, bn), -0.0, jnp.float32))
    o_ref[...] = fence(interpret, acc.astype(o_ref.dtype))


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
    grid, at = (mp // block_rows, op // block_cols), lambda r, c: (r, c)
    if backend == "tpu":  # column blocks outer: each weight block is copied in once
        grid, at = grid[::-1], lambda c, r: (r, c)
    out = pl.pallas_call(
        functools.partial(_kernel, block_k=block_k, precision=precision, interpret=interpret),
        out_shape=jax.ShapeDtypeStruct((mp, op), out_dtype),
        grid=grid,
        in_specs=[pl.BlockSpec((block_rows, ip), lambda *g: (at(*g)[0], 0)),
                  pl.BlockSpec((ip, block_cols), lambda *g: (0, at(*g)[1]))],
        out_specs=pl.BlockSpec((block_rows, block_cols), lambda *g: at(*g)),
        interpret=interpret,
        compiler_params=compiler_params(backend, interpret),
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


def pallas_matmul_for(x_MxI: jax.Array, w_IxO: jax.Array, out_dtype, backend: str) -> jax.Array:
    """`pallas_matmul` with the default blocks, compiled for `backend` (`gpu`, `tpu`) where the
    program is lowered for it and interpreted where it is lowered for the CPU
    (`pallas.target.lowered`). `[M, O]` in `out_dtype`."""
    out_dtype = jnp.dtype(out_dtype)
    return lowered(lambda interpret: functools.partial(
        _forward, out_dtype=out_dtype, block_rows=BLOCK_ROWS, block_cols=BLOCK_COLS,
        block_k=BLOCK_K, interpret=interpret, backend=backend), backend, x_MxI, w_IxO)
