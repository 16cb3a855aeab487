"""The ordered CPU form (`LOOPRL_KERNELS=cpu-ordered`, the CPU's default): every product and row
reduction is an FFI kernel of `ordered_gemm`, whose order of operations is written in its C++
source, so no row count, row place, thread count or ISA changes a bit (docs/NUMERICS.md, "The
ordered CPU form"). Layers of a stacked weight and the sampler's KV cache are read in place.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from looprl.kernels.cpu_attention import attention_cpu
from looprl.kernels.operands import CachedKV, KeyRange, LayerWeight
from looprl.kernels.ordered_gemm import (ordered_matmul, ordered_matmul_layer, row_max, row_sum,
                                         row_argmax)
from looprl.kernels.plain import matmul_grads
from looprl.kernels.tiling import N_MIN


def ones_column(n: int) -> np.ndarray:
    """The literal `[n, 16]` weight of `kernels.rowsum`'s product: ones in column 0, zeros
    elsewhere."""
    ones = np.zeros((n, N_MIN), np.float32)
    ones[:, 0] = 1.0
    return ones


def matmul(rows_MxI, w_IxO, out_dtype, precision=None):
    """`ordered_matmul` of the rows widened to fp32 (exact) and an fp32 or bf16 weight (any
    other dtype widened), cast to `out_dtype`."""
    w = w_IxO if w_IxO.dtype in (jnp.float32, jnp.bfloat16) else w_IxO.astype(jnp.float32)
    return ordered_matmul(rows_MxI.astype(jnp.float32), w).astype(out_dtype)


def layer_matmul(x_MxI, w: LayerWeight, out_dtype):
    """`matmul(x, w.stack[w.index])` with the layer read in place
    (`ordered_gemm.ordered_matmul_layer`): a `lax.scan` or a dynamic slice over the stack
    would copy each layer's weight first. Not differentiable."""
    lead, i = x_MxI.shape[:-1], x_MxI.shape[-1]
    y = ordered_matmul_layer(x_MxI.reshape(-1, i).astype(jnp.float32), w.stack, w.index)
    return y.astype(out_dtype).reshape(*lead, w.stack.shape[-1])


@jax.custom_vjp
def rowsum(rows_MxN, keep):
    """`ordered_matmul(rows, ones_column)[:, :1]`'s bits from `ordered_gemm.row_sum` (fp32
    `[M, 1]`); `keep`: a tuple of arrays kept alive until the sum, not differentiated."""
    return row_sum(rows_MxN, keep)[:, None]


def _rowsum_fwd(rows_MxN, keep):
    return rowsum(rows_MxN, keep), (rows_MxN, keep)


def _rowsum_bwd(res, g_Mx1):
    """The product form's backward (plain dots of the sliced cotangent)."""
    rows_MxN, keep = res
    g_MxO = jnp.pad(g_Mx1, [(0, 0), (0, N_MIN - 1)])
    ones = jnp.asarray(ones_column(rows_MxN.shape[1]))
    dx = matmul_grads(rows_MxN, ones, g_MxO, None)[0]
    # keep's cotangent a symbolic zero (None): an array of zeros added to x's gradient would
    # turn its -0.0 entries +0.0 outside jit
    return dx, tuple(None for _ in keep)


rowsum.defvjp(_rowsum_fwd, _rowsum_bwd)


def row_max_column(x_MxN):
    """Each row's max as `[M, 1]` (`ordered_gemm.row_max`)."""
    return row_max(x_MxN)[:, None]


def attention(q_BxHxCxK, k_BxSxHxK, v_BxSxHxK, mask_BxCxS, scale, softmax, precision=None):
    """`cpu_attention.attention_cpu` with the ordered products."""
    return attention_cpu(q_BxHxCxK, k_BxSxHxK, v_BxSxHxK, mask_BxCxS, scale, softmax,
                         ordered=True)


def attention_cached(q_BxHxCxK, kv: CachedKV, mask: jax.Array | KeyRange, scale, softmax):
    """`attention` over the K/V `kv` describes, read from the cache in place (no slot,
    sub-batch or block copied; GQA kv heads read without repeating them). Not
    differentiable."""
    return attention_cpu(q_BxHxCxK, None, None, mask, scale, softmax, ordered=True, cached=kv)
