"""The backward of the Pallas forms' attention as two Pallas kernels: no score matrix in HBM, no
atomics, every sum in a fixed order (the backward needs run-to-run determinism, not row
invariance: docs/DESIGN.md section 4).

The operands are laid out as the forward's: queries in ROW_TILE = 64-row tiles, each row's keys
rotated so that its first live key is slot 0 (on every platform here: the loads are aligned)
and cut into K_BLOCK = 128-key blocks, the int32 mask and the block table (`n_t`, the live
blocks of tile t). A `KeyRange` mask is no array: each query's last live rotated slot
`lim = min(layout_c, S - 1) - pad_b` (`[B, Cp, 1]`), slot j live iff j <= lim, built per
block. With lse the log of the softmax's normaliser and di = rowsum(do * o):

    p = exp(s * scale - lse) where live, 0 elsewhere;  dp = do @ v_z^T;  ds = p * (dp - di)
    dq = scale * sum_z ds @ k_z             (kernel `dq`: program (b, h, t), z = 0 .. n_t - 1)
    dk_z = scale * sum_t ds^T @ q_t;  dv_z = sum_t p^T @ do_t   (kernel `dkv`: program (b, h, z),
                                                                 t = 0 .. T - 1 with z < n_t)

The `dq` kernel first runs the forward's online max and sum over the tile's blocks for lse
(and writes it for `dkv`). dk and dv come per query head; a kv head's are the sum over its
H / J query heads, in head order (XLA). fp32 operands take `precision` (HIGHEST).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from looprl.kernels.operands import KeyRange
from looprl.kernels.pallas.attention import key_range_operands, mask_operands, padded_keys
from looprl.kernels.tiling import pad_to_multiple
from looprl.kernels.pallas.target import compiler_params, fence, lowered
from looprl.kernels.tiling import K_BLOCK, MASK_VALUE, ROW_TILE


def _dot_t(a, b, precision):
    """a @ b^T, fp32."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32, precision=precision)


def _dot(a, b, precision):
    return jnp.dot(a, b, preferred_element_type=jnp.float32, precision=precision)


def _probs(q, k, live, lse, scale, precision):
    s = _dot_t(q, k, precision) * jnp.float32(scale)
    return jnp.where(live, jnp.exp(s - lse), 0.0)


def _live(mask_ref, rows, start, key_range):
    """Liveness `[R, K_BLOCK]` of rotated slots [start, start + K_BLOCK) for the query rows
    `rows` of mask_ref: the int32 mask's block, or (`key_range`) slot <= the rows' lim."""
    if not key_range:
        return mask_ref[rows, pl.ds(start, K_BLOCK)] != 0
    lim = mask_ref[rows, :]
    return start + jax.lax.broadcasted_iota(jnp.int32, (lim.shape[0], K_BLOCK), 1) <= lim


def _dq_kernel(n_ref, q_ref, k_ref, v_ref, mask_ref, do_ref, di_ref, dq_ref, lse_ref, *, scale,
               precision, interpret, smem, key_range):
    q, do, di = fence(interpret, q_ref[...], do_ref[...], di_ref[...])
    n = n_ref[pl.program_id(0), pl.program_id(2)] if smem else n_ref[0]
    R = q.shape[0]

    def block(z):
        start = pl.multiple_of(z * K_BLOCK, K_BLOCK)
        return fence(interpret, k_ref[pl.ds(start, K_BLOCK), :], v_ref[pl.ds(start, K_BLOCK), :],
                     _live(mask_ref, slice(None), start, key_range))

    def stats(z, carry):
        m, l = carry
        k, _, live = block(z)
        s = jnp.where(live, _dot_t(q, k, precision) * jnp.float32(scale), MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
        p = jnp.where(live, jnp.exp(s - m_new), 0.0)
        return m_new, jnp.exp(m - m_new) * l + jnp.sum(p, axis=1, keepdims=True)

    m, l = jax.lax.fori_loop(0, n, stats, (jnp.full((R, 1), MASK_VALUE, jnp.float32),
                                           jnp.zeros((R, 1), jnp.float32)))
    lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), jnp.inf)

    def grad(z, dq):
        k, v, live = block(z)
        p = _probs(q, k, live, lse, scale, precision)
        ds = p * (_dot_t(do, v, precision) - di)
        return dq + _dot(ds.astype(k.dtype), k, precision)

    dq = jax.lax.fori_loop(0, n, grad, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = fence(interpret, (dq * jnp.float32(scale)).astype(dq_ref.dtype))
    lse_ref[...] = fence(interpret, lse)


def _dkv_kernel(n_ref, q_ref, k_ref, v_ref, mask_ref, do_ref, di_ref, lse_ref, dk_ref, dv_ref,
                *, scale, precision, interpret, smem, tiles, key_range):
    b, z = pl.program_id(0), pl.program_id(2)
    k, v = fence(interpret, k_ref[...], v_ref[...])

    def tile(t, carry):  # a tile whose live blocks end before block z adds nothing: skipped
        def add(carry):
            dk, dv = carry
            rows = pl.ds(pl.multiple_of(t * ROW_TILE, ROW_TILE), ROW_TILE)
            start = pl.multiple_of(z * K_BLOCK, K_BLOCK) if key_range else 0
            q, do, di, lse, live = fence(interpret, q_ref[rows, :], do_ref[rows, :],
                                         di_ref[rows, :], lse_ref[rows, :],
                                         _live(mask_ref, rows, start, key_range))
            p = _probs(q, k, live, lse, scale, precision)
            ds = p * (_dot_t(do, v, precision) - di)
            dv = dv + _dot(p.T.astype(do.dtype), do, precision)
            dk = dk + _dot(ds.T.astype(q.dtype), q, precision)
            return dk, dv
        n = n_ref[b, t] if smem else n_ref[t]
        return jax.lax.cond(z < n, add, lambda c: c, carry)

    zero = jnp.zeros(k.shape, jnp.float32)
    dk, dv = jax.lax.fori_loop(0, tiles, tile, (zero, zero))
    dk_ref[...] = fence(interpret, (dk * jnp.float32(scale)).astype(dk_ref.dtype))
    dv_ref[...] = fence(interpret, dv.astype(dv_ref.dtype))


def _call(n_BxT, q, k, v, mask, do, di, *, H, J, scale, precision, interpret, backend,
          key_range):
    """The two kernels over the laid-out operands: q, do `[B, Cp, H*K]`, k, v `[B, Sp, J*K]`
    (rotated), mask int32 `[B, Cp, Sp]` (`key_range`: lim `[B, Cp, 1]`), di `[B, H, Cp, 1]`.
    Returns dq `[B, Cp, H*K]`, dk and dv per query head `[B, Sp, H*K]` (fp32 where a kv head
    has several)."""
    B, Cp, HK = q.shape
    Sp = k.shape[1]
    K, rep, T = HK // H, H // J, Cp // ROW_TILE
    smem = backend == "tpu" and not interpret
    params = compiler_params(backend, interpret, gpu=dict(num_stages=1),
                             dimension_semantics=("parallel", "parallel", "arbitrary"))
    n_spec = pl.BlockSpec(memory_space=pltpu.SMEM) if smem else None
    kv_head = lambda h: jax.lax.div(h, rep)  # noqa: E731
    q_tile = pl.BlockSpec((None, ROW_TILE, K), lambda b, h, t: (b, t, h))
    vec_tile = pl.BlockSpec((None, None, ROW_TILE, 1), lambda b, h, t: (b, h, t, 0))
    dq, lse = pl.pallas_call(
        functools.partial(_dq_kernel, scale=scale, precision=precision, interpret=interpret,
                          smem=smem, key_range=key_range),
        out_shape=(jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((B, H, Cp, 1), jnp.float32)),
        grid=(B, H, T),
        in_specs=[n_spec or pl.BlockSpec((None, None, 1), lambda b, h, t: (b, t, 0)), q_tile,
                  pl.BlockSpec((None, Sp, K), lambda b, h, t: (b, 0, kv_head(h))),
                  pl.BlockSpec((None, Sp, K), lambda b, h, t: (b, 0, kv_head(h))),
                  pl.BlockSpec((None, ROW_TILE, mask.shape[2]), lambda b, h, t: (b, t, 0)),
                  q_tile, vec_tile],
        out_specs=(q_tile, vec_tile),
        interpret=interpret, compiler_params=params, name="looprl_flash_attention_dq",
    )(n_BxT if smem else n_BxT[..., None], q, k, v, mask, do, di)
    whole = pl.BlockSpec((None, Cp, K), lambda b, h, z: (b, 0, h))
    block = pl.BlockSpec((None, K_BLOCK, K), lambda b, h, z: (b, z, kv_head(h)))
    vec = pl.BlockSpec((None, None, Cp, 1), lambda b, h, z: (b, h, 0, 0))
    out = pl.BlockSpec((None, K_BLOCK, K), lambda b, h, z: (b, z, h))
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, scale=scale, precision=precision, interpret=interpret,
                          smem=smem, tiles=T, key_range=key_range),
        out_shape=(jax.ShapeDtypeStruct((B, Sp, HK), k.dtype if rep == 1 else jnp.float32),) * 2,
        grid=(B, H, Sp // K_BLOCK),
        in_specs=[n_spec or pl.BlockSpec((None, T), lambda b, h, z: (b, 0)), whole, block, block,
                  pl.BlockSpec((None, Cp, 1), lambda b, h, z: (b, 0, 0)) if key_range else
                  pl.BlockSpec((None, Cp, K_BLOCK), lambda b, h, z: (b, 0, z)), whole, vec, vec],
        out_specs=(out, out),
        interpret=interpret, compiler_params=params, name="looprl_flash_attention_dkv",
    )(n_BxT, q, k, v, mask, do, di, lse)
    return dq, dk, dv


def flash_attention_bwd(q_BxHxCxK, k_BxSxJxK, v_BxSxJxK, mask_BxCxS, out_BxHxCxK, g_BxHxCxK,
                        scale: float, backend: str, precision=None):
    """(dq, dk, dv) of `pallas.attention.flash_attention` (module doc), compiled for `backend`
    (`gpu`, `tpu`) where the program is lowered for it and interpreted on the CPU.

    Args: q, out, g (the output's cotangent) `[B, H, C, K]`; k, v `[B, S, J, K]`, H % J == 0;
      mask bool `[B, C, S]` or a `KeyRange` (no mask made); precision: the dots' (HIGHEST
      for fp32).
    Returns dq `[B, H, C, K]` and dk, dv `[B, S, J, K]`, in the operands' dtypes."""
    B, H, C, K = q_BxHxCxK.shape
    S, J = k_BxSxJxK.shape[1], k_BxSxJxK.shape[2]
    Sp = padded_keys(S)
    key_range = isinstance(mask_BxCxS, KeyRange)
    if key_range:
        meta, last = key_range_operands(mask_BxCxS, -(-C // ROW_TILE) * ROW_TILE)
        mask = last[None, :, :] - meta[:, :1, 2:]  # lim [B, Cp, 1]: the last live rotated slot
    else:
        mask, meta = mask_operands(mask_BxCxS)
    slot = (jnp.arange(Sp, dtype=jnp.int32)[None, :] + meta[:, :1, 0]) % Sp
    if not key_range:
        mask = jnp.take_along_axis(mask, slot[:, None, :], axis=2)

    def rows(x):  # [B, H, C, K] -> [B, Cp, H*K]
        x = pad_to_multiple(jnp.swapaxes(x, 1, 2), 1, ROW_TILE)
        return x.reshape(B, x.shape[1], H * K)

    def keys(x):  # [B, S, J, K] -> rotated [B, Sp, J*K]
        x = jnp.pad(x, [(0, 0), (0, Sp - S), (0, 0), (0, 0)])
        return jnp.take_along_axis(x, slot[:, :, None, None], axis=1).reshape(B, Sp, J * K)

    q, do = rows(q_BxHxCxK), rows(g_BxHxCxK.astype(q_BxHxCxK.dtype))
    di = jnp.sum(g_BxHxCxK.astype(jnp.float32) * out_BxHxCxK.astype(jnp.float32), axis=-1)
    di = pad_to_multiple(di, 2, ROW_TILE)[..., None]
    dq, dk, dv = lowered(lambda interpret: functools.partial(
        _call, H=H, J=J, scale=float(scale), precision=precision, interpret=interpret,
        backend=backend, key_range=key_range), backend, meta[..., 1], q, keys(k_BxSxJxK), keys(v_BxSxJxK), mask, do,
        di)
    dq = jnp.swapaxes(dq.reshape(B, -1, H, K)[:, :C], 1, 2)
    back = (jnp.arange(Sp, dtype=jnp.int32)[None, :] - meta[:, :1, 0]) % Sp  # un-rotate

    def unkeys(x):
        x = jnp.take_along_axis(x.reshape(B, Sp, H, K), back[:, :, None, None], axis=1)[:, :S]
        x = x.reshape(B, S, J, H // J, K)
        return (x[:, :, :, 0] if H == J else x.sum(axis=3)).astype(k_BxSxJxK.dtype)

    return dq.astype(q_BxHxCxK.dtype), unkeys(dk), unkeys(dv)
