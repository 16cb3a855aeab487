"""Attention on XLA CPU, both CPU forms: the key axis in 128-key blocks rotated per row to start
at its first live key, queries in row tiles, both products per key block over the live blocks
only (docs/NUMERICS.md, "Attention"). The ordered form takes its two products from the FFI
kernels, reading K/V from the cache in place; the XLA form from XLA's batched dots on gathered
blocks. The two differ in no other operation.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from looprl.kernels import tiling
from looprl.kernels.operands import CachedKV, KeyRange
from looprl.kernels.cpu.ffi import ordered_attention_scores, ordered_attention_values
from looprl.kernels.tiling import (K_BLOCK, keys_from_first_live, live_key_blocks,
                                   map_query_tiles, mask_in_blocks, masked_probs, pad_rows)


def attention_cpu(q_BxHxCxK, k_BxSxHxK, v_BxSxHxK, mask_BxCxS, scale, softmax, ordered: bool,
                  cached: CachedKV | None = None):
    """Attention of C queries `[B, H, C, K]` over K/V `[B, S, H, K]` (or `cached`, the ordered
    form only), `[B, H, C, K]` in q's dtype. Per query tile, block j's scores are one
    `[R, K] x [K, 128]` product per (b, h), written into an fp32 `[B, H, R, Sp]` buffer; the
    masked fp32 `softmax` runs over the whole key axis (the real query rows only when there is
    one padded tile); block j's value partial, one `[R, 128] x [128, K]` product per (b, h), is
    added in block order to an accumulator that starts at -0.0. Each block of K/V is gathered
    (rotated) from the cache's `[B, S, H, K]` layout and widened to fp32 where it is used.
    mask: bool `[B, C, S]`, or the `KeyRange` it comes from. Raises ValueError for `cached`
    without `ordered`."""
    B, H, C, K = q_BxHxCxK.shape
    dtype = q_BxHxCxK.dtype
    if isinstance(mask_BxCxS, KeyRange):  # the same rotated mask from its indices
        mask, offset_B = mask_BxCxS.rotated_blocks()
    else:
        mask, offset_B = mask_in_blocks(mask_BxCxS)
        mask = keys_from_first_live(mask, offset_B, 2)
    S = mask.shape[2]
    if cached is None and ordered:  # the slot as a one-slot cache (its window: its own slot 0)
        cached = CachedKV(k_BxSxHxK[None], v_BxSxHxK[None], 0, jnp.arange(B, dtype=jnp.int32), 0,
                          k_BxSxHxK[:, :1], v_BxSxHxK[:, :1])
    elif cached is not None and not ordered:
        raise ValueError("the in-place KV cache form needs the ordered CPU kernels")
    # K/V are not padded (a padded copy slows the block loop when S is not a multiple of
    # K_BLOCK); the gather reads the padding slots from the last key (`period`)

    def key_block(x_BxSxHxK, j):
        """Block j of the rotated key axis of x, fp32 `[B, H, K_BLOCK, K]`, gathered from the
        cache's own layout (a head-major copy would cost the cache length)."""
        x_BxZxHxK = keys_from_first_live(x_BxSxHxK, offset_B, 1, j * K_BLOCK, K_BLOCK, period=S)
        return jnp.swapaxes(x_BxZxHxK, 1, 2).astype(jnp.float32)

    def per_head_dot(x_BxHxRxI, w_BxHxIxO, transposed=False):
        """`x @ w` (`x @ w^T` when transposed) per (b, h), fp32, XLA's batched dot."""
        spec = "bhri,bhoi->bhro" if transposed else "bhri,bhio->bhro"
        return jnp.einsum(spec, x_BxHxRxI, w_BxHxIxO, preferred_element_type=jnp.float32)

    def tile(qm, live_rows=None):
        q_BxHxRxK, mask_BxRxS = qm
        q32 = q_BxHxRxK.astype(jnp.float32)
        R = q32.shape[2]
        n = live_key_blocks(mask_BxRxS)

        def over_live_blocks(body, init):
            """`body(j, carry)` for j < n; one block runs without a loop."""
            if S == K_BLOCK:
                return body(0, init)
            return jax.lax.fori_loop(0, n, body, init)

        def scores_block(j, buf_BxHxRxS):
            s = per_head_dot(q32, key_block(k_BxSxHxK, j), transposed=True)
            return jax.lax.dynamic_update_slice_in_dim(buf_BxHxRxS, s, j * K_BLOCK, axis=3)

        if ordered:  # the same products, the cache read in place (no block or slot copies)
            live = jnp.int32(1) if S == K_BLOCK else n  # over_live_blocks runs block 0 anyway
            place = (cached.rows_M, offset_B, cached.slot, cached.w0, live)
            seen_BxS = jnp.any(mask_BxRxS, axis=1)  # rotated slots a query of the row sees
            span_B = jnp.max(jnp.where(seen_BxS, jnp.arange(1, S + 1, dtype=jnp.int32), 0), 1)
            scores = ordered_attention_scores(q32, cached.k_NxBxSxJxK, cached.k_win_MxCxJxK,
                                              *place[:2], span_B, *place[2:], S)
        else:
            scores = over_live_blocks(scores_block, jnp.zeros((B, H, R, S), jnp.float32))
        if live_rows is not None and live_rows < R:  # the softmax on the real query rows only
            scores, mask_BxRxS = scores[:, :, :live_rows], mask_BxRxS[:, :live_rows]
        probs = masked_probs(scores, mask_BxRxS, scale, dtype, softmax).astype(jnp.float32)
        if probs.shape[2] < R:
            probs = jnp.pad(probs, [(0, 0), (0, 0), (0, R - probs.shape[2]), (0, 0)])

        def values_block(j, acc_BxHxRxK):
            p = jax.lax.dynamic_slice_in_dim(probs, j * K_BLOCK, K_BLOCK, axis=3)
            return acc_BxHxRxK + per_head_dot(p, key_block(v_BxSxHxK, j))

        if ordered:
            acc = ordered_attention_values(probs, cached.v_NxBxSxJxK, cached.v_win_MxCxJxK,
                                           *place[:2], span_B, *place[2:])
        else:
            acc = over_live_blocks(values_block, jnp.full((B, H, R, K), -0.0, jnp.float32))
        return acc.astype(dtype)

    t = tiling.row_tile_for(C)
    if ordered and C <= t:  # one query tile, unpadded: the ordered products need no row quantum
        return tile((q_BxHxCxK, mask))
    q_pad, _ = pad_rows(q_BxHxCxK, 2, t)
    m_pad, _ = pad_rows(mask, 1, t)
    if q_pad.shape[2] == t:  # one query tile (a decode step)
        out = tile((q_pad, m_pad), live_rows=C)
    else:
        out = map_query_tiles(tile, q_pad, m_pad, t)
    return out[:, :, :C]
