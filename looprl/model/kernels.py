"""Batch-invariant kernels: the numerics that make sampler and learner agree bit for bit.

Every matmul whose row count differs between the sampler (1 query per decode step, a chunk of
pending positions, a prefill) and the learner (the whole teacher-forced sequence, another
minibatch size, permuted rows) is written with its rows padded to a multiple of a fixed tile
(`ROW_TILE` = 64). On XLA CPU (jax 0.10.2) the low bits of `x @ W` rows depend on the number of
rows M for small M (M = 1, 3 differ from M = 64) but not across multiples of 64; padding every
call to a multiple of the tile gives every row the same kernel whatever M is
(tests/model/test_kernels.py pins this). Attention always runs over the whole fixed-length key
axis (the KV cache length S) with a mask, so its reductions have the same length and layout in
every pass.

Elementwise code must also compile the same way in every program: XLA CPU's newer fusion
emitters generated numerically different loops for the same elementwise ops depending on the
surrounding program (the learner's `copy` program differed from its `dense` one at loop 1), so
looprl turns them off (`looprl.determinism`, `--xla_cpu_use_fusion_emitters=false`).

`stock_*` functions are the same math written the common way (plain `x @ W`, attention over the
live prefix): the negative control of the reproducibility matrix.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

ROW_TILE = 64
MASK_VALUE = -1e30  # finite, so fully-masked (padding) query rows never make NaN


def _pad_rows(x, axis: int, tile: int = ROW_TILE):
    n = x.shape[axis]
    n_pad = -(-n // tile) * tile
    if n_pad == n:
        return x, n
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, n_pad - n)
    return jnp.pad(x, widths), n


def matmul(x_MxK: jax.Array, w_KxN: jax.Array, out_dtype=None) -> jax.Array:
    """Row-invariant `x @ w`: leading dims of x are flattened into rows and padded to ROW_TILE.

    Args:
      x_MxK: `[..., K]` any float dtype. w_KxN: `[K, N]` same dtype as x.
      out_dtype: accumulate/return dtype (`preferred_element_type`); default x.dtype.
    Returns: `[..., N]`.
    """
    x = x_MxK
    lead = x.shape[:-1]
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    rows, m = _pad_rows(rows, 0)
    y = jnp.einsum("mk,kn->mn", rows, w_KxN, preferred_element_type=out_dtype or x.dtype)[:m]
    return y.reshape(*lead, w_KxN.shape[-1])


def attention(q_BxCxHxK, k_BxSxHxK, v_BxSxHxK, mask_BxCxS, scale: float):
    """Causal softmax attention of C queries over the whole key axis S (fixed length).

    Scores are accumulated in fp32, masked with a finite large negative value, softmax in fp32,
    probabilities cast to the compute dtype for the value product (the HF eager convention).
    Query rows are padded to ROW_TILE so every query row sees the same kernel.

    Args:
      q_BxCxHxK: queries `[B, C, H, K]`; k/v `[B, S, Hkv, K]` with H % Hkv == 0 (GQA);
      mask_BxCxS: bool, True where query c may attend to key s.
    Returns: `[B, C, H, K]` in q's dtype.
    """
    B, C, H, K = q_BxCxHxK.shape
    hkv = k_BxSxHxK.shape[2]
    if hkv != H:
        k_BxSxHxK = jnp.repeat(k_BxSxHxK, H // hkv, axis=2)
        v_BxSxHxK = jnp.repeat(v_BxSxHxK, H // hkv, axis=2)
    q_BxHxCxK, _ = _pad_rows(jnp.swapaxes(q_BxCxHxK, 1, 2), 2)
    k_BxHxSxK = jnp.swapaxes(k_BxSxHxK, 1, 2)
    v_BxHxSxK = jnp.swapaxes(v_BxSxHxK, 1, 2)
    scores = jnp.einsum("bhck,bhsk->bhcs", q_BxHxCxK, k_BxHxSxK,
                        preferred_element_type=jnp.float32)
    scores = scores * jnp.float32(scale)
    mask, _ = _pad_rows(mask_BxCxS, 1)
    scores = jnp.where(mask[:, None], scores, MASK_VALUE)
    probs = softmax(scores).astype(q_BxCxHxK.dtype)
    out = jnp.einsum("bhcs,bhsk->bhck", probs, v_BxHxSxK,
                     preferred_element_type=q_BxCxHxK.dtype)
    out = out[:, :, :C]
    return jnp.swapaxes(out, 1, 2)


def rowsum(x, keepdims: bool = True):
    """Row-invariant sum over the last axis, fp32: a matmul with a ones vector, so that every
    row reduces in the same order whatever the number of rows (XLA's reduce emitter does not
    guarantee that: RMSNorm rows differed between [B, S, D] and [B, 1, D] inputs)."""
    x = x.astype(jnp.float32)
    y = matmul(x, jnp.ones((x.shape[-1], 1), jnp.float32))
    return y if keepdims else y[..., 0]


LAST_AXIS_TILE = 64


def _tiled_rows(fn, x):
    """Apply the row-wise `fn` (last axis = a row) to `x` as a `[M, N]` block with M padded to a
    multiple of ROW_TILE (zero rows) and N to a multiple of LAST_AXIS_TILE (-inf entries), then
    cut back. XLA CPU compiled the fused `exp(x - max)` of a reduction differently for different
    row counts (< 64 rows) and for rows that are not a whole number of vectors (log-softmax over
    a vocabulary of 58 differed between 32 and 128 rows in low bits); at fixed tiles every row
    sees the same code."""
    lead, n = x.shape[:-1], x.shape[-1]
    rows, m = _pad_rows(x.reshape(-1, n), 0)
    n_pad = -(-n // LAST_AXIS_TILE) * LAST_AXIS_TILE
    if n_pad != n:
        rows = jnp.pad(rows, [(0, 0), (0, n_pad - n)], constant_values=-jnp.inf)
    return fn(rows)[:m, :n].reshape(*lead, n)


def softmax(x):
    """Row-invariant fp32 softmax over the last axis (max is order-free; the sum is `rowsum`).

    Computed on fixed tiles (`_tiled_rows`)."""
    def fn(x):
        e = jnp.exp(x - jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True)))
        return e / rowsum(e)

    return _tiled_rows(fn, x.astype(jnp.float32))


def log_softmax(x):
    """Row-invariant fp32 log-softmax over the last axis (entries of -inf stay -inf), on fixed
    tiles (`_tiled_rows`)."""
    def fn(x):
        shifted = x - jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
        return shifted - jnp.log(rowsum(jnp.exp(shifted)))

    return _tiled_rows(fn, x.astype(jnp.float32))


def stock_matmul(x, w, out_dtype=None):
    """`x @ w` the common way (no row padding): the baseline, not batch-invariant."""
    return jnp.einsum("...k,kn->...n", x, w, preferred_element_type=out_dtype or x.dtype)


def stock_attention(q_BxCxHxK, k_BxSxHxK, v_BxSxHxK, mask_BxCxS, scale: float):
    """Attention the common way: keys trimmed to the live prefix (the last query's position + 1
    over all rows, which the caller guarantees by passing a live-length key axis), no row padding,
    scores in the compute dtype as PyTorch eager does before an fp32 softmax."""
    B, C, H, K = q_BxCxHxK.shape
    hkv = k_BxSxHxK.shape[2]
    if hkv != H:
        k_BxSxHxK = jnp.repeat(k_BxSxHxK, H // hkv, axis=2)
        v_BxSxHxK = jnp.repeat(v_BxSxHxK, H // hkv, axis=2)
    scores = jnp.einsum("bchk,bshk->bhcs", q_BxCxHxK * jnp.asarray(scale, q_BxCxHxK.dtype),
                        k_BxSxHxK).astype(jnp.float32)
    scores = jnp.where(mask_BxCxS[:, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q_BxCxHxK.dtype)
    return jnp.einsum("bhcs,bshk->bchk", probs, v_BxSxHxK)


def rms_norm(x, weight, eps: float, stock: bool = False):
    """RMSNorm as the reference code does it: normalise in fp32, cast back to x's dtype, then
    multiply by the weight (cast to x's dtype). `x` `[..., D]`, `weight` `[D]`. The mean of
    squares is a `rowsum` (row-invariant) unless `stock`."""
    xf = x.astype(jnp.float32)
    if stock:
        var = jnp.mean(xf * xf, axis=-1, keepdims=True)
    else:
        var = rowsum(xf * xf) * jnp.float32(1.0 / x.shape[-1])
    out = (xf * jax.lax.rsqrt(var + jnp.float32(eps))).astype(x.dtype) * weight.astype(x.dtype)
    return out


def rope_cos_sin(positions, head_dim: int, theta: float, dtype):
    """RoPE tables for integer `positions` `[...]`: cos, sin `[..., head_dim]` (rotate-half
    layout: frequencies repeated twice), computed in fp32 and cast to `dtype` (HF convention)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(x_BxCxHxK, cos_BxCxK, sin_BxCxK):
    """q*cos + rotate_half(q)*sin with rotate_half(x) = cat(-x2, x1)."""
    half = x_BxCxHxK.shape[-1] // 2
    x1, x2 = x_BxCxHxK[..., :half], x_BxCxHxK[..., half:]
    rot = jnp.concatenate([-x2, x1], axis=-1)
    return x_BxCxHxK * cos_BxCxK[:, :, None] + rot * sin_BxCxK[:, :, None]
