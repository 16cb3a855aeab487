"""The accelerator forms (GPU, TPU): `accel-xla` (the default off the CPU) and the Pallas matmul
(`pallas-gpu`, `pallas-tpu`).

The matmul of `accel-xla` pads rows to ROW_TILE-row tiles run in one `lax.map`; per tile a
`fori_loop` over the 128-long K blocks adds each `[ROW_TILE, 128] x [128, O16]` dot into an fp32
accumulator that starts at -0.0, so every dot has one shape whatever M. The Pallas forms state
that order inside one kernel (`pallas_matmul`). Attention is the CPU's rotated 128-key blocks
with the scores in key blocks too, query tiles of ROW_TILE rows, K/V in the compute dtype
(docs/NUMERICS.md, "Accelerator forms").
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from looprl.kernels.pallas_matmul import pallas_matmul
from looprl.kernels.plain import attention_probs_values
from looprl.kernels.tiling import (K_BLOCK, ROW_TILE, k_blocks, keys_in_blocks_from_first_live,
                                   map_query_tiles, pad_rows)


def matmul(rows_MxI, w_IxO, out_dtype, precision):
    """`rows @ w` `[M, O]` in `out_dtype` (module doc); operands stay in their dtype (bf16 on
    the tensor cores), fp32 dots at `precision`."""
    o = w_IxO.shape[1]
    w_ZxIxO = k_blocks(w_IxO)
    nb, kb, o16 = w_ZxIxO.shape
    x, m = pad_rows(rows_MxI, 0, ROW_TILE)
    x, _ = pad_rows(x, 1, kb)
    x_NxZxRxI = jnp.swapaxes(x.reshape(-1, ROW_TILE, nb, kb), 1, 2)

    def tile(x_ZxRxI):
        def step(z, acc):
            return acc + jnp.dot(x_ZxRxI[z], w_ZxIxO[z], preferred_element_type=jnp.float32,
                                 precision=precision)
        return jax.lax.fori_loop(0, nb, step, jnp.full((ROW_TILE, o16), -0.0, jnp.float32))

    y = jax.lax.map(tile, x_NxZxRxI)
    return y.reshape(-1, o16)[:m, :o].astype(out_dtype)


def pallas_form(backend: str):
    """The Pallas matmul lowered for `backend` (`gpu`: Triton, `tpu`: Mosaic), interpreted
    when this process runs on XLA CPU (a CPU process tracing the accelerator form)."""
    def matmul_pallas(rows_MxI, w_IxO, out_dtype, precision):
        interpret = jax.default_backend() == "cpu"
        return pallas_matmul(rows_MxI, w_IxO.astype(rows_MxI.dtype), out_dtype,
                             block_rows=ROW_TILE, interpret=interpret,
                             backend="cpu" if interpret else backend)
    return matmul_pallas


def attention(q_BxHxCxK, k_BxSxHxK, v_BxSxHxK, mask_BxCxS, scale, softmax, precision):
    """The accelerator attention (module doc), `[B, H, C, K]` in q's dtype; a decode step's one
    query is a ROW_TILE-row tile."""
    B, H, C, K = q_BxHxCxK.shape
    dtype = q_BxHxCxK.dtype
    k, v, mask = keys_in_blocks_from_first_live(jnp.swapaxes(k_BxSxHxK, 1, 2),
                                                jnp.swapaxes(v_BxSxHxK, 1, 2), mask_BxCxS)

    def tile(qm):
        q_BxHxRxK, mask_BxRxS = qm
        return attention_probs_values(q_BxHxRxK, k, v, mask_BxRxS, scale, dtype, precision,
                                      softmax, K_BLOCK, score_blocks=True)

    q_pad, _ = pad_rows(q_BxHxCxK, 2, ROW_TILE)
    m_pad, _ = pad_rows(mask, 1, ROW_TILE)
    return map_query_tiles(tile, q_pad, m_pad, ROW_TILE)[:, :, :C]
