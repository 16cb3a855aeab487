"""Flash-style attention as one Pallas kernel: the attention of the `pallas-gpu` / `pallas-tpu`
forms, for every caller (prefill, chunked and deferred windows, decode, the learner's pass).

Program (b, h, t) owns query tile t (ROW_TILE = 64 query rows, zero-padded) of row b, head h;
kv head h // (H / J) is read by index (GQA without a repeated copy). Row b's key axis is cut into
K_BLOCK = 128-key blocks that start at the row's first live key `o_b` (the first key any of its
queries sees: the sampler's and the learner's rows cut the same blocks whatever their padding,
as the CPU form's rotation does). Blocks z = 0 .. n_t - 1 (n_t: up to the tile's last live key)
run in order, an online softmax in fp32 per query row:

    s = (q @ k_z^T) * scale, masked keys MASK_VALUE      (fp32; fp32 operands at HIGHEST)
    m' = max(m, max(s));  p = exp(s - m');  a = exp(m - m')
    l' = a * l + sum(p);  acc' = a * acc + p.astype(v) @ v_z    (fp32 accumulation)
    (m, l, acc) = (m', l', acc') on rows with a live key in block z, unchanged on the others

and out = acc / l (0 for a row that sees no key). No split over keys; every dot, reduction and
elementwise step has one shape whatever B, C, S or the tile's other queries, and a block with
no live key for a query leaves its state bit for bit, so a query's bits do not depend on how
many queries, rows or key slots share the call. K/V and the mask are padded by one block past
the key axis (no block read passes the end). On the GPU (and interpreted `pallas-gpu`) the
kernel reads block z at `o_b + z * K_BLOCK`, the row where it lies; on a TPU each row is first
rotated so that `o_b` is slot 0 (one more copy), since Mosaic TPU needs block loads at a
multiple of K_BLOCK (error E2003 otherwise). Both read the same keys per block in one order.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from looprl.kernels.pallas_matmul import pad_to_multiple
from looprl.kernels.pallas_target import compiler_params, fence, lowered
from looprl.kernels.tiling import K_BLOCK, MASK_VALUE, ROW_TILE


def _kernel(meta_ref, q_ref, k_ref, v_ref, mask_ref, o_ref, *, scale, precision, smem,
            rotated, interpret):
    R = q_ref.shape[0]
    if smem:  # Mosaic TPU: the whole [B, T, 2] table in scalar memory
        b, t = pl.program_id(0), pl.program_id(2)
        offset, n = (None if rotated else meta_ref[b, t, 0]), meta_ref[b, t, 1]
    else:
        offset, n = meta_ref[0], meta_ref[1]
    q = fence(interpret, q_ref[...])

    def step(z, carry):
        m, l, acc = carry
        if rotated:  # aligned: the caller rotated the row so that its first live key is 0
            start = pl.multiple_of(z * K_BLOCK, K_BLOCK)
        else:  # the row where it lies: blocks start at its first live key
            start = offset + z * K_BLOCK
        k = k_ref[pl.ds(start, K_BLOCK), :]
        v = v_ref[pl.ds(start, K_BLOCK), :]
        k, v, live = fence(interpret, k, v, mask_ref[:, pl.ds(start, K_BLOCK)] != 0)
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32, precision=precision)
        s = jnp.where(live, s * jnp.float32(scale), jnp.float32(MASK_VALUE))
        row_live = jnp.max(live.astype(jnp.int32), axis=1, keepdims=True) > 0
        m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
        p = jnp.exp(s - m_new)
        a = jnp.exp(m - m_new)
        l_new = a * l + jnp.sum(p, axis=1, keepdims=True)
        acc_new = a * acc + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32,
                                    precision=precision)
        return (jnp.where(row_live, m_new, m), jnp.where(row_live, l_new, l),
                jnp.where(row_live, acc_new, acc))

    init = (jnp.full((R, 1), MASK_VALUE, jnp.float32), jnp.zeros((R, 1), jnp.float32),
            jnp.zeros(o_ref.shape, jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, n, step, init)
    seen = l > 0
    o_ref[...] = fence(interpret, jnp.where(seen, acc / jnp.where(seen, l, 1.0),
                                            0.0).astype(o_ref.dtype))


def _call(meta, q, k, v, mask, *, H, J, scale, precision, rotated, interpret, backend):
    B, Cp, _ = q.shape
    Sp = k.shape[1]
    K = q.shape[2] // H
    rep = H // J
    smem = backend == "tpu" and not interpret
    meta_spec = (pl.BlockSpec(memory_space=pltpu.SMEM) if smem
                 else pl.BlockSpec((None, None, 2), lambda b, h, t: (b, t, 0)))
    kv_spec = pl.BlockSpec((None, Sp, K), lambda b, h, t: (b, 0, jax.lax.div(h, rep)))
    tile_spec = pl.BlockSpec((None, ROW_TILE, K), lambda b, h, t: (b, t, h))
    return pl.pallas_call(
        functools.partial(_kernel, scale=scale, precision=precision, smem=smem,
                          rotated=rotated, interpret=interpret),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(B, H, Cp // ROW_TILE),
        in_specs=[meta_spec, tile_spec, kv_spec, kv_spec,
                  pl.BlockSpec((None, ROW_TILE, Sp), lambda b, h, t: (b, t, 0))],
        out_specs=tile_spec,
        interpret=interpret,
        # one pipeline stage: fp32 blocks of three stages overflow an H100's shared memory
        compiler_params=compiler_params(backend, interpret, gpu=dict(num_stages=1),
                                        dimension_semantics=(
            "parallel", "parallel", "parallel")),
        name="looprl_flash_attention",
    )(meta, q, k, v, mask)


def block_table(mask_BxCpxS):
    """int32 `[B, T, 2]`: per row b and query tile t, the row's first live key and the number of
    K_BLOCK blocks from it up to the tile's last live key (0 for a tile that sees none)."""
    B, Cp, S = mask_BxCpxS.shape
    slots = jnp.arange(1, S + 1, dtype=jnp.int32)
    row_any = jnp.any(mask_BxCpxS, axis=1)
    offset_B = jnp.argmax(row_any, axis=-1).astype(jnp.int32)
    tiles = mask_BxCpxS.reshape(B, Cp // ROW_TILE, ROW_TILE, S)
    end_BxT = jnp.max(jnp.where(jnp.any(tiles, axis=2), slots, 0), axis=-1)
    n = jnp.maximum(end_BxT - offset_B[:, None] + K_BLOCK - 1, 0) // K_BLOCK
    return jnp.stack([jnp.broadcast_to(offset_B[:, None], n.shape), n], axis=-1)


def flash_attention(q_BxHxCxK, k_BxSxJxK, v_BxSxJxK, mask_BxCxS, scale: float, backend: str,
                    precision=None):
    """Attention of C queries over S keys (module doc), compiled for `backend` (`gpu`, `tpu`)
    where the program is lowered for it and interpreted on the CPU (`pallas_target`).

    Args: q `[B, H, C, K]`; k, v `[B, S, J, K]` with J kv heads, H % J == 0, one dtype;
      mask bool `[B, C, S]`, True where query c may see key s; scale: the score factor;
      precision: the dots' (`Precision.HIGHEST` for fp32 on an accelerator).
    Returns `[B, H, C, K]` in q's dtype.
    Raises ValueError when H is not a multiple of J."""
    B, H, C, K = q_BxHxCxK.shape
    J = k_BxSxJxK.shape[2]
    if H % J:
        raise ValueError(f"flash_attention: {H} query heads are not a multiple of {J} kv heads")
    q = pad_to_multiple(jnp.swapaxes(q_BxHxCxK, 1, 2), 1, ROW_TILE)
    Cp = q.shape[1]
    mask = pad_to_multiple(pad_to_multiple(mask_BxCxS, 1, ROW_TILE), 2, K_BLOCK)
    meta = block_table(mask)
    mask = jnp.pad(mask, [(0, 0), (0, 0), (0, K_BLOCK)]).astype(jnp.int32)
    Sp = mask.shape[2]

    # on a TPU each row is rotated so that its first live key is slot 0: every block load is
    # aligned (Mosaic TPU proves it, E2003 otherwise); the keys moved to the end are dead for
    # the row. Elsewhere the kernel reads each block at the row's offset, no rotation.
    rotated = backend == "tpu"
    if rotated:
        slot_BxSp = (jnp.arange(Sp, dtype=jnp.int32)[None, :] + meta[:, :1, 0]) % Sp
        mask = jnp.take_along_axis(mask, slot_BxSp[:, None, :], axis=2)

    def kv(x):
        x = jnp.pad(x, [(0, 0), (0, Sp - x.shape[1]), (0, 0), (0, 0)])
        if rotated:
            x = jnp.take_along_axis(x, slot_BxSp[:, :, None, None], axis=1)
        return x.reshape(B, Sp, J * K)

    out = lowered(lambda interpret: functools.partial(
        _call, H=H, J=J, scale=float(scale), precision=precision, rotated=rotated,
        interpret=interpret, backend=backend), backend, meta, q.reshape(B, Cp, H * K),
        kv(k_BxSxJxK), kv(v_BxSxJxK), mask)
    return jnp.swapaxes(out.reshape(B, Cp, H, K)[:, :C], 1, 2)
