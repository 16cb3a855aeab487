"""The decode step's attention on a TPU (`pallas-tpu`), reading the sampler's KV cache where it
lies: the same keys per block, in the same order and with the same arithmetic as
`attention.flash_attention` over the rows' slot (`CachedKV.slots()`), so the bits are
that kernel's, without copying, padding and rotating each row's slot every layer pass.

Program (m, h, t) DMAs row m's whole cache row `[S, K]` of kv head h // (H / J) into VMEM
(the row picked by a scalar-prefetched index, `slot * B' + rows_M[m]`). Key block z starts at
the row's first live key o_m, which is not a multiple of K_BLOCK, and Mosaic loads only at
aligned sublane offsets; so it loads the two aligned blocks around it and rotates them by
o_m mod K_BLOCK (`pltpu.roll` in fp32: exact data movement). The chunk's one new key (decode:
C = 1, written at slot w0) is selected over the cache's; keys past S read as zero, as the
slot path's padding does. Liveness comes from the mask's index vectors (`KeyRange`: query c
sees key s iff pad_m <= s <= min(layout_c, S - 1)), so no `[M, C, S]` mask is read.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from looprl.kernels.operands import CachedKV, KeyRange
from looprl.kernels.pallas.attention import (check_heads, key_range_table, online_init,
                                             online_out, online_step)
from looprl.kernels.pallas.matmul import pad_to_multiple
from looprl.kernels.pallas.target import compiler_params, fence, lowered
from looprl.kernels.tiling import K_BLOCK, ROW_TILE

KV_GROUP = 8  # kv heads per program where J allows: a TPU tile's rows of the cache's (J, K)


def _kernel(rows_ref, n_ref, q_ref, last_ref, k_hbm, v_hbm, kw_ref, vw_ref, o_ref, kbuf, vbuf,
            *, scale, precision, S, T, G, rep, interpret):
    m, g, t = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    slot, row = rows_ref[5 * m], rows_ref[5 * m + 1]
    offset, pad, w0 = rows_ref[5 * m + 2], rows_ref[5 * m + 3], rows_ref[5 * m + 4]
    n = n_ref[m * T + t]
    K = kbuf.shape[2]
    last = last_ref[...]  # [ROW_TILE, 1]: each query's last visible key (-1: none)
    R = last.shape[0]
    heads = [(j, r) for j in range(G) for r in range(rep)]  # kv head j of the group, query r
    qs = [fence(interpret, q_ref[:, pl.ds((j * rep + r) * K, K)]) for j, r in heads]

    def blocks(hbm, buf, win_ref, start):
        """The group's G kv heads at keys [start, start + K_BLOCK), each `[K_BLOCK, K]`."""
        L = buf.shape[0]  # min(S, K_BLOCK): the copy stays inside the slot
        c = jnp.minimum(start, S - L)
        pltpu.sync_copy(hbm.at[slot, row, pl.ds(c, L), pl.ds(g * G, G), :], buf)
        x = buf[...].astype(jnp.float32)
        if L < K_BLOCK:  # a slot shorter than a block: the rest reads as past S
            x = jnp.concatenate([x, jnp.zeros((K_BLOCK - L, G, K), jnp.float32)], axis=0)
        x = pltpu.roll(x, jax.lax.rem(K_BLOCK - (start - c), K_BLOCK), 0)
        pos = start + jax.lax.broadcasted_iota(jnp.int32, (K_BLOCK, 1), 0)
        win = win_ref[...].astype(jnp.float32)  # [1, G * K]
        return [jnp.where(pos < S, jnp.where(pos == w0, win[:, j * K:(j + 1) * K], x[:, j, :]),
                          0.0).astype(q_ref.dtype) for j in range(G)]

    def step(z, carry):
        start = offset + z * K_BLOCK
        ks, vs = blocks(k_hbm, kbuf, kw_ref, start), blocks(v_hbm, vbuf, vw_ref, start)
        pos = start + jax.lax.broadcasted_iota(jnp.int32, (R, K_BLOCK), 1)
        out = []
        for (j, r), q, state in zip(heads, qs, carry):
            k, v, live = fence(interpret, ks[j], vs[j], (pos >= pad) & (pos <= last))
            out.append(online_step(q, k, v, live, state, scale, precision))
        return tuple(out)

    final = jax.lax.fori_loop(0, n, step, tuple(online_init(R, K) for _ in heads))
    for (j, r), state in zip(heads, final):
        o_ref[:, pl.ds((j * rep + r) * K, K)] = fence(interpret, online_out(state, o_ref.dtype))


def _call(rows, n, q, last, k, v, kw, vw, *, H, J, S, scale, precision, interpret, backend):
    M, Cp, _ = q.shape
    K = q.shape[2] // H
    rep, T = H // J, Cp // ROW_TILE
    G = KV_GROUP if J % KV_GROUP == 0 else J  # kv heads per program: whole (8,128) tiles
    win_spec = pl.BlockSpec((None, 1, G * K), lambda m, g, t, rows, n: (m, 0, g))
    tile_spec = pl.BlockSpec((None, ROW_TILE, G * rep * K), lambda m, g, t, rows, n: (m, t, g))
    hbm = pl.BlockSpec(memory_space=pl.ANY)  # the cache stays where it is; blocks copied in
    return pl.pallas_call(
        functools.partial(_kernel, scale=scale, precision=precision, S=S, T=T, G=G, rep=rep,
                          interpret=interpret),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(M, J // G, T),
            in_specs=[tile_spec, pl.BlockSpec((ROW_TILE, 1), lambda m, g, t, rows, n: (t, 0)),
                      hbm, hbm, win_spec, win_spec],
            out_specs=tile_spec,
            scratch_shapes=[pltpu.VMEM((min(S, K_BLOCK), G, K), k.dtype)] * 2),
        interpret=interpret,
        compiler_params=compiler_params(backend, interpret, dimension_semantics=(
            "parallel", "parallel", "parallel")),
        name="looprl_flash_attention_cached",
    )(rows, n, q, last, k, v, kw, vw)


def supports(kv: CachedKV, mask) -> bool:
    """True where this kernel applies: one new key per row (C = 1) and the mask as `KeyRange`."""
    return isinstance(mask, KeyRange) and kv.k_win_MxCxJxK.shape[1] == 1


def flash_attention_cached(q_MxHxCxK, kv: CachedKV, mask: KeyRange, scale: float,
                           backend: str, precision=None):
    """Attention of row m's C = 1 query over its cache slot with the window written, read in
    place (module doc): the bits of `flash_attention(q, *kv.slots(), mask.mask(), ...)`.

    Args: q `[M, H, 1, K]`; kv: `CachedKV` with a one-position window; mask: its `KeyRange`;
      scale: the score factor; precision: the dots' (`Precision.HIGHEST` for fp32).
    Returns `[M, H, 1, K]` in q's dtype.
    Raises ValueError where `supports` is False or H is not a multiple of J."""
    if not supports(kv, mask):
        raise ValueError("flash_attention_cached: needs a KeyRange mask and a one-position "
                         f"window (got {type(mask).__name__}, window "
                         f"{tuple(kv.k_win_MxCxJxK.shape)})")
    M, H, C, K = q_MxHxCxK.shape
    N, B, S, J, _ = kv.k_NxBxSxJxK.shape
    check_heads(H, J, "flash_attention_cached")
    q = pad_to_multiple(jnp.swapaxes(q_MxHxCxK, 1, 2), 1, ROW_TILE).reshape(M, -1, H * K)
    meta, layout = key_range_table(mask, q.shape[1])  # the slot path's block table
    last = jnp.minimum(layout, S - 1)  # each query's last visible key (-1: a padded query)
    offset, n = meta[:, 0, 0], meta[..., 1]
    pad = mask.pad_B.astype(jnp.int32)
    w0 = jnp.clip(kv.w0, 0, S - C).astype(jnp.int32)
    rows = jnp.stack([jnp.broadcast_to(kv.slot, (M,)), kv.rows_M.astype(jnp.int32), offset,
                      pad, jnp.broadcast_to(w0, (M,))], axis=1).astype(jnp.int32).reshape(-1)
    cache = [kv.k_NxBxSxJxK, kv.v_NxBxSxJxK]  # in place: even a reshape copies on a TPU
    win = [w.astype(cache[0].dtype).reshape(M, 1, J * K)
           for w in (kv.k_win_MxCxJxK, kv.v_win_MxCxJxK)]
    out = lowered(lambda interpret: functools.partial(
        _call, H=H, J=J, S=S, scale=float(scale), precision=precision, interpret=interpret,
        backend=backend), backend, rows, n.reshape(-1), q, last, *cache, *win)
    return jnp.swapaxes(out.reshape(M, -1, H, K)[:, :C], 1, 2)
