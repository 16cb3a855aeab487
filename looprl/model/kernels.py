"""Batch-invariant kernels: the numerics that make sampler and learner agree bit for bit.

Every matmul whose row count differs between the sampler (1 query per decode step, a chunk of
pending positions, a prefill) and the learner (the whole teacher-forced sequence, another
minibatch size, permuted rows) must give each row the same bits whatever the number of rows M.

On XLA CPU (jax 0.10.2, Eigen dot emitter; looprl turns off the YNNPACK dot fusions with
`--xla_cpu_experimental_ynn_fusion_type=`, `looprl.determinism`) a `[M, K] @ [K, N]` dot is
row-invariant for every M, 1 included, as long as the contraction is at most `K_TILE` = 128 long
and N is a multiple of `N_MIN` = 16 (scanned over 448 row counts M in 1..4096, fp32 and bf16:
longer contractions are split by a blocking that depends on M, N < 8 takes a matrix-vector path,
N = 8 changed kernels for M in 658..~1000, and with N = 8j + 1 a single row computed the last
column differently). So on the CPU `matmul` runs unpadded rows, splits K into 128-long slices
summed in order in fp32 and pads N to a multiple of 16 (`rowsum`'s ones vector included); the
batched attention dots pad query rows to `QUERY_TILE` = 8 (1 query row is a matrix-vector
product), pad the key axis to a multiple of 16 (masked keys) and split it into 128-long slices
for the value product.
Unpadded rows are what makes batch-1 decoding cheap: the previous 64-row padding made a decode
step do 64 rows of matmul work. On other backends (GPU, TPU) the kernels keep the previous form,
rows padded to `ROW_TILE` = 64 and unsplit contractions: their bits are not invariant there
(reproducibility/gpu) and the trainer replays by re-running the sampler (`forced`).

Attention always runs over the whole fixed-length key axis (the KV cache length S) with a mask,
so its reductions have the same length and layout in every pass. Softmax and log-softmax run on
fixed `[64k, 64j]` tiles (`_tiled_rows`).

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

ROW_TILE = 64  # row padding off the CPU, and the softmax tiles
K_TILE = 128  # CPU: longest contraction of one dot
N_MIN = 16  # CPU: output columns of a dot are padded to a multiple of this
QUERY_TILE = 8  # CPU: attention query rows are padded to a multiple of this
# The numerics of the invariant kernels: a rollout records it (`Schedule.kernel_version`), and
# `looprl verify --rollout` refuses a rollout sampled under another version (its bits are
# another function's). Bump it whenever a kernel's arithmetic changes.
KERNEL_VERSION = "2026-12-01"
MASK_VALUE = -1e30  # finite, so fully-masked (padding) query rows never make NaN


def _pad_rows(x, axis: int, tile: int = ROW_TILE):
    n = x.shape[axis]
    n_pad = -(-n // tile) * tile
    if n_pad == n:
        return x, n
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, n_pad - n)
    return jnp.pad(x, widths), n


def on_cpu() -> bool:
    """True when jax compiles for XLA CPU (the kernels' invariant form there; see module doc)."""
    return jax.default_backend() == "cpu"


def _fp32_precision(*xs):
    """Off the CPU, fp32 dots run at `Precision.HIGHEST`: GPUs otherwise use TF32 for fp32
    matmuls (the H200 run in reproducibility/gpu differed from the CPU by ~5e-4 in fp32, beyond
    the matrix's 1e-4 bound for the stock control). None (the default) on the CPU, whose fp32 dots
    are full precision, so CPU programs are unchanged. Not yet run on a GPU."""
    if on_cpu() or not all(x.dtype == jnp.float32 for x in xs):
        return None
    return jax.lax.Precision.HIGHEST


def row_tile() -> int:
    """The matmul row padding in force: 1 on the CPU, ROW_TILE elsewhere (recorded in schedules)."""
    return 1 if on_cpu() else ROW_TILE


def _contract(spec: str, a, b, a_axis: int, b_axis: int, out_dtype):
    """`einsum(spec, a, b)` with the contracted axis (a's `a_axis`, b's `b_axis`) split into
    K_TILE-long slices whose fp32 products are summed in order, then cast to `out_dtype`."""
    k = a.shape[a_axis]
    if k <= K_TILE:
        return jnp.einsum(spec, a, b, preferred_element_type=out_dtype)
    acc = None
    for i in range(0, k, K_TILE):
        n = min(K_TILE, k - i)
        part = jnp.einsum(spec, jax.lax.slice_in_dim(a, i, i + n, axis=a_axis),
                          jax.lax.slice_in_dim(b, i, i + n, axis=b_axis),
                          preferred_element_type=jnp.float32)
        acc = part if acc is None else acc + part
    return acc.astype(out_dtype)


def _dot(spec: str, a, b, a_axis: int, b_axis: int, out_dtype):
    """The invariant kernels' dot: on the CPU `_contract` (K_TILE slices); elsewhere one einsum,
    fp32 at `Precision.HIGHEST` (`_fp32_precision`)."""
    if on_cpu():
        return _contract(spec, a, b, a_axis, b_axis, out_dtype)
    return jnp.einsum(spec, a, b, preferred_element_type=out_dtype,
                      precision=_fp32_precision(a, b))


def matmul(x_MxK: jax.Array, w_KxN: jax.Array, out_dtype=None) -> jax.Array:
    """Row-invariant `x @ w` (module doc): leading dims of x are flattened into rows.

    On the CPU: rows unpadded, K split into K_TILE slices (fp32 partial sums), N padded to a
    multiple of N_MIN with zero columns. Elsewhere: rows padded to ROW_TILE, one dot.

    Args:
      x_MxK: `[..., K]` any float dtype. w_KxN: `[K, N]` same dtype as x.
      out_dtype: accumulate/return dtype (`preferred_element_type`); default x.dtype.
    Returns: `[..., N]`.
    """
    x = x_MxK
    lead = x.shape[:-1]
    k, n = x.shape[-1], w_KxN.shape[-1]
    rows = x.reshape(-1, k)
    out_dtype = out_dtype or x.dtype
    m, w = rows.shape[0], w_KxN
    if on_cpu():
        w, _ = _pad_rows(w_KxN, 1, N_MIN)  # zero columns, cut off below
    else:
        rows, _ = _pad_rows(rows, 0)
    y = _dot("mk,kn->mn", rows, w, 1, 0, out_dtype)[:m, :n]
    return y.reshape(*lead, n)


def attention(q_BxCxHxK, k_BxSxHxK, v_BxSxHxK, mask_BxCxS, scale: float):
    """Causal softmax attention of C queries over the whole key axis S (fixed length).

    Scores are accumulated in fp32, masked with a finite large negative value, softmax in fp32,
    probabilities cast to the compute dtype for the value product (the HF eager convention).
    Query rows are padded to QUERY_TILE (CPU; ROW_TILE elsewhere); on the CPU the key axis is
    padded to a multiple of N_MIN (masked) and contractions are split into K_TILE slices, so
    every query row sees the same kernel (module doc).

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
    cpu = on_cpu()
    tile = QUERY_TILE if cpu else ROW_TILE
    if cpu:  # masked key padding: the score dot's N and the value dot's K are multiples of 16
        k_BxSxHxK, _ = _pad_rows(k_BxSxHxK, 1, N_MIN)
        v_BxSxHxK, _ = _pad_rows(v_BxSxHxK, 1, N_MIN)
        mask_BxCxS, _ = _pad_rows(mask_BxCxS, 2, N_MIN)
    q_BxHxCxK, _ = _pad_rows(jnp.swapaxes(q_BxCxHxK, 1, 2), 2, tile)
    k_BxHxSxK = jnp.swapaxes(k_BxSxHxK, 1, 2)
    v_BxHxSxK = jnp.swapaxes(v_BxSxHxK, 1, 2)
    scores = _dot("bhck,bhsk->bhcs", q_BxHxCxK, k_BxHxSxK, 3, 3, jnp.float32)
    scores = scores * jnp.float32(scale)
    mask, _ = _pad_rows(mask_BxCxS, 1, tile)
    scores = jnp.where(mask[:, None], scores, MASK_VALUE)
    probs = softmax(scores).astype(q_BxCxHxK.dtype)
    out = _dot("bhcs,bhsk->bhck", probs, v_BxHxSxK, 3, 2, q_BxCxHxK.dtype)[:, :, :C]
    return jnp.swapaxes(out, 1, 2)


def rowsum(x, keepdims: bool = True):
    """Row-invariant sum over the last axis, fp32: a matmul with a ones vector, so that every
    row reduces in the same order whatever the number of rows (XLA's reduce emitter does not
    guarantee that: RMSNorm rows differed between [B, S, D] and [B, 1, D] inputs)."""
    x = x.astype(jnp.float32)
    ones = np.zeros((x.shape[-1], N_MIN), np.float32)  # a literal: XLA rewrote a dot with a
    ones[:, 0] = 1.0  # broadcast ones operand into a reduce, whose order depends on the rows
    y = matmul(x, jnp.asarray(ones))[..., :1]
    return y if keepdims else y[..., 0]


LAST_AXIS_TILE = 64


def _tiled_rows(fn, x):
    """Apply the row-wise `fn` (last axis = a row) to `x` as a `[M, N]` block with M padded to a
    multiple of ROW_TILE (zero rows; always at least one) and N to a multiple of LAST_AXIS_TILE
    (-inf entries), then cut back.

    XLA CPU compiles `exp(x - max)` differently depending on what it fuses with: a producer
    fused into the exp loop (a temperature multiply) is contracted into an FMA there, but not
    when it ends in a padding op first, and row counts below 64 or rows that are not whole
    vectors compiled differently too (log-softmax over a vocabulary of 58 differed between 32
    and 128 rows in low bits). Padding every call, at fixed tiles, gives every row the same
    code: the producer always ends in the pad, fn always reads a materialised tile."""
    lead, n = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, n)
    m = rows.shape[0]
    m_pad = (m // ROW_TILE + 1) * ROW_TILE
    n_pad = -(-n // LAST_AXIS_TILE) * LAST_AXIS_TILE
    rows = jnp.pad(rows, [(0, m_pad - m), (0, 0)])
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
    return jnp.einsum("...k,kn->...n", x, w, preferred_element_type=out_dtype or x.dtype,
                      precision=_fp32_precision(x, w))


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
                        k_BxSxHxK, precision=_fp32_precision(q_BxCxHxK, k_BxSxHxK)
                        ).astype(jnp.float32)
    scores = jnp.where(mask_BxCxS[:, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q_BxCxHxK.dtype)
    return jnp.einsum("bhcs,bshk->bchk", probs, v_BxSxHxK,
                      precision=_fp32_precision(probs, v_BxSxHxK))


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
