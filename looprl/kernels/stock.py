"""The stock math: `x @ w` and attention written the common way (no row tiles, no key blocks),
not batch-invariant. `kernels.stock_matmul` / `kernels.stock_attention` are the reproducibility
matrix's negative control; `LOOPRL_KERNELS=stock` makes the invariant API run this math too."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from looprl.kernels.operands import repeat_kv_heads
from looprl.kernels.plain import attention_plain


def stock_matmul(x, w, out_dtype, precision):
    """`x @ w` `[..., O]` with fp32 dots at `precision`."""
    return jnp.einsum("...k,kn->...n", x, w, preferred_element_type=out_dtype,
                      precision=precision)


def stock_attention(q_BxCxHxK, k_BxSxJxK, v_BxSxJxK, mask_BxCxS, scale: float, precision_fn):
    """Attention over the keys given (the caller passes the live prefix), scores in the compute
    dtype as PyTorch eager computes them before an fp32 softmax; `precision_fn(*operands)` gives
    each dot's precision. `[B, C, H, K]` in q's dtype."""
    B, C, H, K = q_BxCxHxK.shape
    k_BxSxHxK, v_BxSxHxK = repeat_kv_heads(k_BxSxJxK, v_BxSxJxK, H)
    scores = jnp.einsum("bchk,bshk->bhcs", q_BxCxHxK * jnp.asarray(scale, q_BxCxHxK.dtype),
                        k_BxSxHxK, precision=precision_fn(q_BxCxHxK, k_BxSxHxK)
                        ).astype(jnp.float32)
    scores = jnp.where(mask_BxCxS[:, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q_BxCxHxK.dtype)
    return jnp.einsum("bhcs,bshk->bchk", probs, v_BxSxHxK,
                      precision=precision_fn(probs, v_BxSxHxK))


def matmul(rows_MxI, w_IxO, out_dtype, precision):
    """The stock form's matmul: one plain dot, fp32 accumulation."""
    return stock_matmul(rows_MxI, w_IxO, out_dtype, precision)


def attention(q_BxHxCxK, k_BxSxHxK, v_BxSxHxK, mask_BxCxS, scale, softmax, precision):
    """The stock form's attention: the whole key axis at once, `jax.nn.softmax`."""
    return attention_plain(q_BxHxCxK, k_BxSxHxK, v_BxSxHxK, mask_BxCxS, scale, precision)
