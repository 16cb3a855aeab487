"""The ordered CPU form (`LOOPRL_KERNELS=cpu-ordered`, the CPU's default): every product and row
reduction is an FFI kernel of `cpu.ffi`, whose order of operations is written in its C++
source, so no row count, row place, thread count or ISA changes a bit (docs/NUMERICS.md, "The
ordered CPU form"). Layers of a stacked weight and the sampler's KV cache are read in place.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from looprl.kernels.cpu.attention import attention_cpu
from looprl.kernels.operands import CachedKV, KeyRange, LayerWeight
from looprl.kernels.cpu.ffi import (ordered_batched_matmul, ordered_matmul,
                                         ordered_matmul_layer, row_max, row_sum, row_argmax)
from looprl.kernels.plain import matmul_grads as plain_matmul_grads
from looprl.kernels.tiling import N_MIN, masked_probs, ones_column


def matmul(rows_MxI, w_IxO, out_dtype, precision=None):
    """`ordered_matmul` of the rows widened to fp32 (exact) and an fp32 or bf16 weight (any
    other dtype widened), cast to `out_dtype`."""
    w = w_IxO if w_IxO.dtype in (jnp.float32, jnp.bfloat16) else w_IxO.astype(jnp.float32)
    return ordered_matmul(rows_MxI.astype(jnp.float32), w).astype(out_dtype)


def _fp32_or_bf16(w):
    return w if w.dtype in (jnp.float32, jnp.bfloat16) else w.astype(jnp.float32)


def matmul_grads(rows_MxI, w_IxO, g_MxO, precision=None):
    """`(dx, dw)` of `rows @ w` by `ordered_matmul`: dx = g @ w^T `[M, I]` (a chain over O per
    output), dw = rows^T @ g `[I, O]` (a chain over the M rows, in row order), each in its
    operand's dtype. The transposed operands are explicit transposes (copies: no bit moves),
    so the backward, like the forward, is fixed by the kernel's program and not by the ISA
    (docs/NUMERICS.md, "The whole CPU run"). `precision` is unused: the kernel's is its own."""
    g = g_MxO.astype(jnp.float32)
    dx = ordered_matmul(g, _fp32_or_bf16(w_IxO).T)
    dw = ordered_matmul(rows_MxI.astype(jnp.float32).T, g)
    return dx.astype(rows_MxI.dtype), dw.astype(w_IxO.dtype)


@jax.custom_vjp
def batched_matmul(x_ZxMxK, w_ZxKxN):
    """`ordered_batched_matmul` of fp32 operands (others widened), differentiable: the backward
    is two more ordered batched products on explicit transposes. Returns fp32 `[Z, M, N]`."""
    return ordered_batched_matmul(x_ZxMxK.astype(jnp.float32), w_ZxKxN.astype(jnp.float32))


def _batched_fwd(x, w):
    return batched_matmul(x, w), (x, w)


def _batched_bwd(res, g_ZxMxN):
    x, w = res
    g = g_ZxMxN.astype(jnp.float32)
    dx = ordered_batched_matmul(g, jnp.swapaxes(w, 1, 2).astype(jnp.float32))
    dw = ordered_batched_matmul(jnp.swapaxes(x, 1, 2).astype(jnp.float32), g)
    return dx.astype(x.dtype), dw.astype(w.dtype)


batched_matmul.defvjp(_batched_fwd, _batched_bwd)


def sum_rows(a_xD):
    """fp32 `[D]`: the sum over every leading index of `a` `[..., D]` (row-major order) as one
    ordered chain per column, `ordered_matmul(ones [1, M], a [M, D])`: a broadcast weight's
    gradient whose order the program fixes, not XLA's reduce emitter."""
    rows = a_xD.reshape(-1, a_xD.shape[-1]).astype(jnp.float32)
    return ordered_matmul(jnp.ones((1, rows.shape[0]), jnp.float32), rows)[0]


def sum_all(a):
    """fp32 scalar: the sum of every element of `a` in an order the program fixes, not XLA's
    reduce emitter: `sum_rows` over `a` viewed `[-1, D]` (D its last axis, 1 for a scalar),
    then one ordered chain over the D column sums."""
    rows = a.reshape(-1, a.shape[-1] if a.ndim else 1)
    return sum_rows(sum_rows(rows)[:, None])[0]


@jax.custom_vjp
def scale_last(x_xD, w_D):
    """`x * w` with w `[D]` broadcast over x's last axis (one dtype); w's gradient `sum_rows`."""
    return x_xD * w_D


def _scale_fwd(x, w):
    return x * w, (x, w)


def _scale_bwd(res, g):
    x, w = res
    return g * w, sum_rows(g * x).astype(w.dtype)


scale_last.defvjp(_scale_fwd, _scale_bwd)


@jax.custom_vjp
def add_last(x_xD, b_D):
    """`x + b` with b `[D]` broadcast over x's last axis; b's gradient `sum_rows`."""
    return x_xD + b_D


def _add_fwd(x, b):
    return x + b, b


def _add_bwd(b, g):
    return g, sum_rows(g).astype(b.dtype)


add_last.defvjp(_add_fwd, _add_bwd)


def global_norm(tree):
    """fp32 scalar: the l2 norm of every leaf of `tree` together. Each leaf's sum of squares
    is `sum_all` and the leaves add in tree order, so the bits do not depend on the ISA."""
    total = jnp.float32(0.0)
    for leaf in jax.tree.leaves(tree):
        x = leaf.astype(jnp.float32)
        total = total + sum_all(x * x)
    return jnp.sqrt(total)


def attention_for_grads(q_BxHxCxK, k_BxSxHxK, v_BxSxHxK, mask_BxCxS, scale, softmax,
                        precision=None):
    """The attention math of `plain.attention_plain` with both products `batched_matmul` and
    the row-invariant `softmax` (a `rowsum` of ordered chains): the function whose vjp is the
    ordered form's attention backward. `[B, H, C, K]` in q's dtype; `precision` is unused."""
    B, H, C, K = q_BxHxCxK.shape
    S = k_BxSxHxK.shape[1]
    dtype = q_BxHxCxK.dtype
    q = q_BxHxCxK.reshape(B * H, C, K)
    kt = jnp.transpose(k_BxSxHxK, (0, 2, 3, 1)).reshape(B * H, K, S)
    v = jnp.swapaxes(v_BxSxHxK, 1, 2).reshape(B * H, S, K)
    scores = batched_matmul(q, kt).reshape(B, H, C, S)
    probs = masked_probs(scores, mask_BxCxS, scale, dtype, softmax).astype(v.dtype)
    out = batched_matmul(probs.reshape(B * H, C, S), v)
    return out.reshape(B, H, C, K).astype(dtype)


def layer_matmul(x_MxI, w: LayerWeight, out_dtype):
    """`matmul(x, w.stack[w.index])` with the layer read in place
    (`ffi.ordered_matmul_layer`): a `lax.scan` or a dynamic slice over the stack
    would copy each layer's weight first. Not differentiable."""
    lead, i = x_MxI.shape[:-1], x_MxI.shape[-1]
    y = ordered_matmul_layer(x_MxI.reshape(-1, i).astype(jnp.float32), w.stack, w.index)
    return y.astype(out_dtype).reshape(*lead, w.stack.shape[-1])


@jax.custom_vjp
def rowsum(rows_MxN, keep):
    """`ordered_matmul(rows, ones_column)[:, :1]`'s bits from `ffi.row_sum` (fp32
    `[M, 1]`); `keep`: a tuple of arrays kept alive until the sum, not differentiated."""
    return row_sum(rows_MxN, keep)[:, None]


def _rowsum_fwd(rows_MxN, keep):
    return rowsum(rows_MxN, keep), (rows_MxN, keep)


def _rowsum_bwd(res, g_Mx1):
    """The product form's backward (plain dots of the sliced cotangent)."""
    rows_MxN, keep = res
    g_MxO = jnp.pad(g_Mx1, [(0, 0), (0, N_MIN - 1)])
    ones = jnp.asarray(ones_column(rows_MxN.shape[1]))
    dx = plain_matmul_grads(rows_MxN, ones, g_MxO, None)[0]
    # keep's cotangent a symbolic zero (None): an array of zeros added to x's gradient would
    # turn its -0.0 entries +0.0 outside jit
    return dx, tuple(None for _ in keep)


rowsum.defvjp(_rowsum_fwd, _rowsum_bwd)


def row_max_column(x_MxN):
    """Each row's max as `[M, 1]` (`ffi.row_max`)."""
    return row_max(x_MxN)[:, None]


def attention(q_BxHxCxK, k_BxSxHxK, v_BxSxHxK, mask_BxCxS, scale, softmax, precision=None):
    """`attention.attention_cpu` with the ordered products."""
    return attention_cpu(q_BxHxCxK, k_BxSxHxK, v_BxSxHxK, mask_BxCxS, scale, softmax,
                         ordered=True)


def attention_cached(q_BxHxCxK, kv: CachedKV, mask: jax.Array | KeyRange, scale, softmax):
    """`attention` over the K/V `kv` describes, read from the cache in place (no slot,
    sub-batch or block copied; GQA kv heads read without repeating them). Not
    differentiable."""
    return attention_cpu(q_BxHxCxK, None, None, mask, scale, softmax, ordered=True, cached=kv)
