"""The fixed-order row sum of the Pallas forms (`kernels.rowsum`: RMSNorm's mean of squares,
the softmaxes' denominators, the log-prob's normaliser over the vocabulary).

x `[M, N]` fp32, rows zero-padded to ROW_TILE = 64, columns to a multiple of 128. Program i owns
64 rows: a `[64, 128]` fp32 accumulator adds the 128-column blocks z = 0 .. Np / 128 - 1 in
order (lane l of row r sums columns l, 128 + l, ... in that order), then each row's 128 lanes
are reduced by the compiler's fixed reduction of a `[64, 128]` block. Every row sees the same
operations at every M. Backward: the cotangent broadcast along the row (exact).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from looprl.kernels.pallas.matmul import pad_to_multiple
from looprl.kernels.pallas.target import compiler_params, fence, lowered
from looprl.kernels.tiling import ROW_TILE

LANES = 128
DEFAULT_VMEM = 16 << 20  # Mosaic TPU's default scoped VMEM limit


def _kernel(x_ref, o_ref, *, interpret):
    R, N = x_ref.shape

    def step(z, acc):
        return acc + fence(interpret, x_ref[:, pl.ds(z * LANES, LANES)])

    acc = jax.lax.fori_loop(0, N // LANES, step, jnp.zeros((R, LANES), jnp.float32))
    o_ref[...] = fence(interpret, jnp.broadcast_to(jnp.sum(acc, axis=1, keepdims=True),
                                                   o_ref.shape))


def _call(x, *, interpret, backend):
    mp, n = x.shape
    # Mosaic TPU: the whole-row block, double-buffered, outgrows the default scoped VMEM
    # (16 MiB) at V = 49,152 in fp32 (24 MiB): ask for what the blocks take
    vmem = 2 * 4 * ROW_TILE * (n + LANES) + (1 << 20)
    return pl.pallas_call(
        functools.partial(_kernel, interpret=interpret), out_shape=jax.ShapeDtypeStruct((mp, LANES), jnp.float32), grid=(mp // ROW_TILE,),
        in_specs=[pl.BlockSpec((ROW_TILE, n), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((ROW_TILE, LANES), lambda i: (i, 0)),
        interpret=interpret, name="looprl_fixed_order_rowsum",
        compiler_params=compiler_params(backend, interpret,
                                        vmem_limit_bytes=max(vmem, DEFAULT_VMEM)))(x)


def row_sum(x_MxN, backend: str):
    """Each row's sum, fp32 `[M, 1]` (module doc), compiled for `backend` or interpreted
    (`target.lowered`). x: `[M, N]`, widened to fp32."""
    m = x_MxN.shape[0]
    x = pad_to_multiple(pad_to_multiple(x_MxN.astype(jnp.float32), 0, ROW_TILE), 1, LANES)
    out = lowered(lambda interpret: functools.partial(_call, interpret=interpret,
                                                      backend=backend), backend, x)
    return out[:m, :1]


def rowsum_form(backend: str):
    """The form's `rowsum(rows_MxN, keep) -> [M, 1]` for `backend`, differentiable (the
    cotangent broadcast along the row); `keep` is accepted and not needed."""
    @jax.custom_vjp
    def rowsum(rows_MxN, keep):
        return row_sum(rows_MxN, backend)

    def fwd(rows_MxN, keep):
        return row_sum(rows_MxN, backend), (rows_MxN.shape, keep)

    def bwd(res, g_Mx1):
        shape, keep = res
        return jnp.broadcast_to(g_Mx1, shape), tuple(None for _ in keep)

    rowsum.defvjp(fwd, bwd)
    return rowsum
