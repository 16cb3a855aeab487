"""The sampler's attention on a TPU (`pallas-tpu`) with the KV cache read in place: the keys of
each block, their order and the arithmetic of `pallas_attention`'s kernel over the slot copy
(the same bits), without the slot copy, its pad and its per-row rotation.

Mosaic TPU tiles the last two dims of an array (kv heads x head dim for the cache `[N*B', S,
J, K]`): a block may start anywhere along S (untiled) but a kv-head slice must start at a
multiple of the tile (8). So program (m, g, t) handles the G = min(8, J) kv heads of group g
(and their query heads) for query tile t of row m: it copies the row's slot for those heads
out of the cache in HBM (`pl.ANY`) into VMEM `[S + K_BLOCK, G, K]` by DMA, writes the chunk's
window over [w0, w0 + C) and zeros past S (the slot copy's pad), then per head runs the online
softmax of `pallas_attention` over the blocks at `o + z * K_BLOCK` (an unaligned start along
S is a plain load). The mask is built from the `KeyRange` (pad <= s <= layout index, s < S).
Interpreted on the CPU the same kernel runs (DMAs as copies).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from looprl.kernels.pallas_matmul import pad_to_multiple
from looprl.kernels.pallas_target import compiler_params, fence
from looprl.kernels.tiling import K_BLOCK, MASK_VALUE, ROW_TILE

GROUP = 8  # kv heads per program: the TPU tile's rows


def group(J: int) -> int | None:
    """The kv heads per program for J kv heads: J up to GROUP, GROUP where it divides J, else
    None (no in-place form: the caller reads the slot copy)."""
    if J <= GROUP:
        return J
    return GROUP if J % GROUP == 0 else None


def _kernel(meta_ref, q_ref, kc_hbm, vc_hbm, layout_ref, kw_ref, vw_ref, o_ref, kbuf, vbuf,
            sem, *, scale, precision, rep, S, interpret):
    b, g, t = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    G, K = kbuf.shape[1], kbuf.shape[2]
    at = (lambda i: meta_ref[i]) if interpret else (lambda i: meta_ref[b, t, i])  # SMEM: whole
    offset, n, row, w0, pad = (at(i) for i in range(5))
    j0 = pl.multiple_of(g * G, G)
    copies = [pltpu.make_async_copy(c.at[row, :, pl.ds(j0, G), :], buf.at[pl.ds(0, S)],
                                    sem.at[i]) for i, (c, buf) in enumerate(((kc_hbm, kbuf),
                                                                             (vc_hbm, vbuf)))]
    for cp in copies:
        cp.start()
    for cp in copies:
        cp.wait()
    for w_ref, buf in ((kw_ref, kbuf), (vw_ref, vbuf)):  # as `CachedKV.slots()` writes it
        buf[pl.ds(w0, w_ref.shape[0]), :, :] = w_ref[...]
        buf[S:, :, :] = jnp.zeros((buf.shape[0] - S, G, K), buf.dtype)
    pos0 = jax.lax.broadcasted_iota(jnp.int32, (1, K_BLOCK), 1)
    R = q_ref.shape[0]
    for i in range(G * rep):  # query head i of the group reads kv head i // rep
        q = fence(interpret, q_ref[:, i * K:(i + 1) * K])

        def step(z, carry, j=i // rep, q=q):
            m, l, acc = carry
            start = offset + z * K_BLOCK
            k = kbuf[pl.ds(start, K_BLOCK), j, :].astype(q.dtype)
            v = vbuf[pl.ds(start, K_BLOCK), j, :].astype(q.dtype)
            pos = start + pos0
            live = (pos >= pad) & (pos <= layout_ref[...]) & (pos < S)
            k, v, live = fence(interpret, k, v, live)
            s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                    preferred_element_type=jnp.float32, precision=precision)
            s = jnp.where(live, s * jnp.float32(scale), jnp.float32(MASK_VALUE))
            row_live = jnp.max(live.astype(jnp.int32), axis=1, keepdims=True) > 0
            m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
            p = jnp.exp(s - m_new)
            a = jnp.exp(m - m_new)
            l_new = a * l + jnp.sum(p, axis=1, keepdims=True)
            acc_new = a * acc + jnp.dot(p.astype(v.dtype), v,
                                        preferred_element_type=jnp.float32,
                                        precision=precision)
            return (jnp.where(row_live, m_new, m), jnp.where(row_live, l_new, l),
                    jnp.where(row_live, acc_new, acc))

        init = (jnp.full((R, 1), MASK_VALUE, jnp.float32), jnp.zeros((R, 1), jnp.float32),
                jnp.zeros((R, K), jnp.float32))
        _, l, acc = jax.lax.fori_loop(0, n, step, init)
        seen = l > 0
        o_ref[:, i * K:(i + 1) * K] = fence(interpret, jnp.where(
            seen, acc / jnp.where(seen, l, 1.0), 0.0).astype(o_ref.dtype))


def cached_call(q_MxHxCxK, k_cache, v_cache, k_win, v_win, meta, layout, *, scale: float,
                precision, interpret: bool):
    """The kernel (module doc): q `[M, H, C, K]`; the caches `[N, B', S, J, K]`; the windows
    `[M, C, J, K]` (the chunk's keys and values over [w0, w0 + C)); meta int32 `[M, T, 5]`
    (first live key, blocks, cache row, w0 clamped to [0, S - C], pad) and layout int32
    `[Cp, 1]` as `pallas_attention.flash_attention_cached` builds them. Returns `[M, H, C, K]`
    in q's dtype; needs `group(J)`."""
    N, Bc, S, J, K = k_cache.shape
    M, H, C, _ = q_MxHxCxK.shape
    G, rep = group(J), H // J
    dtype = k_cache.dtype
    q = pad_to_multiple(jnp.swapaxes(q_MxHxCxK, 1, 2), 1, ROW_TILE)
    Cp = q.shape[1]
    tile = pl.BlockSpec((None, ROW_TILE, G * rep * K), lambda b, g, t: (b, t, g))
    win = pl.BlockSpec((None, C, G, K), lambda b, g, t: (b, 0, g, 0))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    meta_spec = (pl.BlockSpec((None, None, 5), lambda b, g, t: (b, t, 0)) if interpret
                 else pl.BlockSpec(memory_space=pltpu.SMEM))
    buf = pltpu.VMEM((S + K_BLOCK, G, K), dtype)
    vmem = 2 * (S + K_BLOCK) * G * K * dtype.itemsize + (16 << 20)
    out = pl.pallas_call(
        functools.partial(_kernel, scale=float(scale), precision=precision, rep=rep, S=S,
                          interpret=interpret),
        out_shape=jax.ShapeDtypeStruct((M, Cp, H * K), q.dtype),
        grid=(M, J // G, Cp // ROW_TILE),
        in_specs=[meta_spec, tile, hbm, hbm,
                  pl.BlockSpec((ROW_TILE, 1), lambda b, g, t: (t, 0)), win, win],
        out_specs=tile,
        scratch_shapes=[buf, buf, pltpu.SemaphoreType.DMA((2,))],
        interpret=interpret,
        compiler_params=compiler_params("tpu", interpret, dimension_semantics=(
            "parallel", "parallel", "parallel"), vmem_limit_bytes=vmem),
        name="looprl_flash_attention",
    )(meta, q.reshape(M, Cp, H * K), *(c.reshape(N * Bc, S, J, K) for c in (k_cache, v_cache)),
      layout, *(w.astype(dtype) for w in (k_win, v_win)))
    return jnp.swapaxes(out.reshape(M, Cp, H, K)[:, :C], 1, 2)
