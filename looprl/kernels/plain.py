"""The plain math every form shares: the backward of the invariant matmul and attention (plain
dots; gradients need no invariance, docs/DESIGN.md section 4) and the attention core that the
accelerator form runs in key blocks. The functions of `forms.PLAIN`, the backward of every form
but `cpu-ordered`, sit here."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from looprl.kernels.tiling import masked_probs


def rope_rotate_half(x_BxCxHxK, cos_BxCxK, sin_BxCxK):
    """`x*cos + rotate_half(x)*sin` with rotate_half(x) = cat(-x2, x1), in x's dtype."""
    half = x_BxCxHxK.shape[-1] // 2
    x1, x2 = x_BxCxHxK[..., :half], x_BxCxHxK[..., half:]
    rot = jnp.concatenate([-x2, x1], axis=-1)
    return x_BxCxHxK * cos_BxCxK[:, :, None] + rot * sin_BxCxK[:, :, None]


def matmul_grads(rows_MxI, w_IxO, g_MxO, precision):
    """`(dx, dw)` of `rows @ w` by plain dots, in the operands' dtypes."""
    dx = jnp.dot(g_MxO, w_IxO.T.astype(g_MxO.dtype), preferred_element_type=jnp.float32,
                 precision=precision)
    dw = jnp.dot(rows_MxI.T.astype(g_MxO.dtype), g_MxO, preferred_element_type=jnp.float32,
                 precision=precision)
    return dx.astype(rows_MxI.dtype), dw.astype(w_IxO.dtype)


def attention_probs_values(q_BxHxRxK, k_BxHxSxK, v_BxHxSxK, mask_BxRxS, scale, dtype, prec,
                           softmax_fn, key_block=None, score_blocks=False):
    """Attention on one block of queries: fp32 scores, mask, fp32 softmax, probabilities cast
    to the compute dtype, value product accumulated in fp32, cast to `dtype`. With
    `score_blocks` (the accelerator form) the scores too come in `key_block`-key blocks, one
    `[R, K] x [K, key_block]` dot per (b, h, block), so no dot's shape depends on S; the value
    product is in key blocks whenever S > key_block, partials summed in block order."""
    if score_blocks:
        B, H, R, K = q_BxHxRxK.shape
        nb = k_BxHxSxK.shape[2] // key_block
        q_BxHxZxRxK = jnp.broadcast_to(q_BxHxRxK[:, :, None], (B, H, nb, R, K))
        k_BxHxZxCxK = k_BxHxSxK.reshape(B, H, nb, key_block, K)
        scores = jnp.einsum("bhjck,bhjsk->bhjcs", q_BxHxZxRxK, k_BxHxZxCxK,
                            preferred_element_type=jnp.float32, precision=prec)
        scores = jnp.moveaxis(scores, 2, 3).reshape(B, H, R, nb * key_block)
    else:
        scores = jnp.einsum("bhck,bhsk->bhcs", q_BxHxRxK, k_BxHxSxK,
                            preferred_element_type=jnp.float32, precision=prec)
    probs = masked_probs(scores, mask_BxRxS, scale, dtype, softmax_fn).astype(v_BxHxSxK.dtype)
    S = v_BxHxSxK.shape[2]
    if key_block is None or S <= key_block:
        return jnp.einsum("bhcs,bhsk->bhck", probs, v_BxHxSxK, precision=prec,
                          preferred_element_type=jnp.float32).astype(dtype)
    B, H, R, _ = probs.shape
    nb = S // key_block
    p = jnp.moveaxis(probs.reshape(B, H, R, nb, key_block), 3, 2)
    v = v_BxHxSxK.reshape(B, H, nb, key_block, -1)
    parts = jnp.einsum("bhjck,bhjkd->bhjcd", p, v, preferred_element_type=jnp.float32,
                       precision=prec)
    acc = parts[:, :, 0]
    for j in range(1, nb):
        acc = acc + parts[:, :, j]
    return acc.astype(dtype)


def attention_plain(q_BxHxCxK, k_BxSxHxK, v_BxSxHxK, mask, scale, prec):
    """The attention math without tiles or padding (`jax.nn.softmax`): `[B, H, C, K]`."""
    return attention_probs_values(q_BxHxCxK, jnp.swapaxes(k_BxSxHxK, 1, 2),
                                  jnp.swapaxes(v_BxSxHxK, 1, 2), mask, scale, q_BxHxCxK.dtype,
                                  prec, functools.partial(jax.nn.softmax, axis=-1))


def attention_for_grads(q_BxHxCxK, k_BxSxHxK, v_BxSxHxK, mask, scale, softmax, precision):
    """`attention_plain` (`softmax` unused): the function whose vjp is attention's plain
    backward. `[B, H, C, K]` in q's dtype."""
    return attention_plain(q_BxHxCxK, k_BxSxHxK, v_BxSxHxK, mask, scale, precision)


def global_norm(tree):
    """fp32 scalar: the l2 norm of every leaf of `tree` together (`optax.tree.norm`)."""
    return optax.tree.norm(tree)


def scale_last(x_xD, w_D):
    """`x * w`, w `[D]` broadcast over x's last axis; XLA's gradients."""
    return x_xD * w_D


def add_last(x_xD, b_D):
    """`x + b`, b `[D]` broadcast over x's last axis; XLA's gradients."""
    return x_xD + b_D
