"""The XLA CPU form (`LOOPRL_KERNELS=cpu-xla`): the matmul as XLA dots of one shape.

Rows are zero-padded to a row tile R (`tiling.row_tile_for(M)`, a multiple of the machine's
ROW_QUANTUM), output columns to a multiple of N_MIN, and the contraction cut into K_BLOCK-long
blocks whose fp32 partials are summed in block order: every dot XLA sees is
`[R, 128] x [128, O16]`, whatever M (docs/NUMERICS.md, "The XLA CPU form"). Its attention is
`cpu.attention` with XLA's batched dots.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from looprl.kernels import tiling
from looprl.kernels.cpu.attention import attention_cpu
from looprl.kernels.tiling import BATCHED_MAX_ROWS, k_blocks, pad_rows, pad_to_multiple


def blocked_weight(w_IxO):
    """`tiling.k_blocks` of a weight: an fp32 weight as it is; a 2-byte float weight (bf16,
    f16) as its uint16 bits (zero bits are +0.0), widened to fp32 one block at a time where
    the block is used (`weight_block`): a loop-invariant whole-weight fp32 copy would be
    hoisted out of the decode loop and held through it. The widening is exact."""
    w = w_IxO
    if w.dtype != jnp.float32 and w.dtype.itemsize == 2:
        w = jax.lax.bitcast_convert_type(w, jnp.uint16)
    elif w.dtype != jnp.float32:
        w = w.astype(jnp.float32)
    return k_blocks(w)


def weight_block(w_ZxIxO, j, dtype):
    """Block j (traced) of a `blocked_weight` of a `dtype` weight, as fp32 `[kb, O16]`."""
    wj = jax.lax.dynamic_index_in_dim(w_ZxIxO, j, 0, keepdims=False)
    if wj.dtype == jnp.uint16:
        wj = jax.lax.bitcast_convert_type(wj, dtype).astype(jnp.float32)
    return wj


def kblocked_dot(x_RxI, w_ZxIxO, dtype):
    """`x @ w` for one small fp32 row tile (R <= BATCHED_MAX_ROWS, or a single block): every dot
    `[R, kb] x [kb, O16]`, partials summed in block order in fp32 from the first. An fp32
    weight's partials come from one batched dot (nb matmuls of one shape, the weight read in
    place); a 2-byte weight's from a `fori_loop` of the same nb dots, each block widened where
    it is used: the same dots and adds."""
    nb, kb, o = w_ZxIxO.shape
    t = x_RxI.shape[0]
    x_RxI, _ = pad_rows(x_RxI, 1, kb)
    if w_ZxIxO.dtype == jnp.uint16:
        def part(j):
            xb = jax.lax.dynamic_slice_in_dim(x_RxI, j * kb, kb, 1)
            return jnp.dot(xb, weight_block(w_ZxIxO, j, dtype),
                           preferred_element_type=jnp.float32)
        return jax.lax.fori_loop(1, nb, lambda j, acc: acc + part(j), part(0))
    if nb == 1:
        return jnp.dot(x_RxI, w_ZxIxO[0], preferred_element_type=jnp.float32)
    x_ZxRxI = jnp.swapaxes(x_RxI.reshape(t, nb, kb), 0, 1)
    parts = jnp.einsum("zri,zio->zro", x_ZxRxI, w_ZxIxO, preferred_element_type=jnp.float32)
    acc = parts[0]
    for j in range(1, nb):
        acc = acc + parts[j]
    return acc


def looped_matmul(rows_MxI, w_ZxIxO, out_dtype, t, dtype):
    """Large tiles (R > BATCHED_MAX_ROWS, more than one K block): one `fori_loop` step per
    (row tile, K block), tile-major, K blocks in order; each step adds one `[R, kb] x [kb, O16]`
    dot into the tile's fp32 accumulator, which starts at -0.0 (so the sum has the bits of
    `p0 + p1 + ...`, the small-tile sum). fp32 output: the accumulator is the output itself,
    updated in place through the loop carry. Other output dtypes: an inner loop on a
    `[R, O16]` fp32 accumulator, cast into the output per tile.

    Rows are not padded when M >= R: the last tile starts at M - R and overlaps the one before
    it, recomputing the overlapped rows from a fresh accumulator. They get the bits they had,
    since a row's bits do not depend on its place in a tile; padding M instead would copy x
    and the output."""
    nb, kb, o16 = w_ZxIxO.shape
    m = rows_MxI.shape[0]
    x = pad_to_multiple(rows_MxI, 0, t) if m < t else rows_MxI  # one tile of R rows
    x, _ = pad_rows(x, 1, kb)
    mp = x.shape[0]  # max(M, R) rows, computed in tiles starting at 0, R, ..., and mp - R
    nt = -(-mp // t)

    def tile_start(i):
        return jnp.minimum(i * t, mp - t)

    def partial(r, j):
        xb = jax.lax.dynamic_slice(x, (r, j * kb), (t, kb)).astype(jnp.float32)
        return jnp.dot(xb, weight_block(w_ZxIxO, j, dtype), preferred_element_type=jnp.float32)

    if out_dtype == jnp.float32:
        def step(s, out):
            r, j = tile_start(s // nb), s % nb
            acc = jax.lax.dynamic_slice(out, (r, 0), (t, o16))
            acc = jnp.where(j == 0, jnp.float32(-0.0), acc)  # a tile's sum starts afresh
            return jax.lax.dynamic_update_slice(out, acc + partial(r, j), (r, 0))

        out = jnp.full((mp, o16), -0.0, jnp.float32)
        return jax.lax.fori_loop(0, nt * nb, step, out)[:m]  # [:M] of M rows: no op (jnp)

    def tile(i, out):
        r = tile_start(i)
        acc = jax.lax.fori_loop(0, nb, lambda j, acc: acc + partial(r, j),
                                jnp.full((t, o16), -0.0, jnp.float32))
        return jax.lax.dynamic_update_slice(out, acc.astype(out_dtype), (r, 0))

    return jax.lax.fori_loop(0, nt, tile, jnp.zeros((mp, o16), out_dtype))[:m]


def matmul(rows_MxI, w_IxO, out_dtype, precision=None):
    """`rows @ w` `[M, O]` in `out_dtype` (module doc): small tiles batched, large ones in one
    `fori_loop` (`looped_matmul`); the same dots and adds either way."""
    o = w_IxO.shape[1]
    wb = blocked_weight(w_IxO)
    t = tiling.row_tile_for(rows_MxI.shape[0])
    if wb.shape[0] > 1 and t > BATCHED_MAX_ROWS:
        return looped_matmul(rows_MxI, wb, out_dtype, t, w_IxO.dtype)[:, :o]

    def tile(x_RxI):
        return kblocked_dot(x_RxI.astype(jnp.float32), wb, w_IxO.dtype).astype(out_dtype)

    return tiling.tiles_map(tile, rows_MxI, 0)[:, :o]


def attention(q_BxHxCxK, k_BxSxHxK, v_BxSxHxK, mask_BxCxS, scale, softmax, precision=None):
    """`cpu.attention.attention_cpu` with XLA's batched dots per (b, h) and key block."""
    return attention_cpu(q_BxHxCxK, k_BxSxHxK, v_BxSxHxK, mask_BxCxS, scale, softmax,
                         ordered=False)
