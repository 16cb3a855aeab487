"""The invariant kernels' operations: each dispatches through the form in force (`forms`).

The custom VJPs live here: `matmul` and `attention` take the form's kernels forward and its
`Form.backward` backward (plain dots, or on `cpu-ordered` the ordered kernels, so that a CPU
run's parameters do not depend on the ISA). `looprl.kernels` re-exports the public names.
"""
from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from looprl.kernels import forms, stock as _stock
from looprl.kernels.forms import Form
from looprl.kernels.operands import CachedKV, KeyRange, LayerWeight, repeat_kv_heads
from looprl.kernels.plain import rope_rotate_half
from looprl.kernels.tiling import LAST_AXIS_TILE, ROW_TILE, ones_column


def current_form() -> Form:
    """The kernel form in force (`forms.current`)."""
    return forms.current()


def kernel_version() -> str:
    """The numerics a rollout is sampled with (`Schedule.kernel_version`): the form's
    (`Form.kernel_version`)."""
    return forms.current().kernel_version()


def cpu_kernel_version() -> str:
    """The kernel version of the CPU form this environment selects: the form in force when it
    is a CPU form, else the one `LOOPRL_CPU_MATMUL` names (default `cpu-ordered`)."""
    form = forms.current()
    if not form.cpu:
        form = forms.resolve("cpu", {forms.CPU_ALIAS: os.environ.get(forms.CPU_ALIAS) or "ordered"})
    return form.kernel_version()


def row_tile() -> int:
    """The row padding quantum of the form in force (recorded in schedules): ROW_QUANTUM (8 or
    24) on the CPU forms, ROW_TILE on the accelerator forms, 1 for `stock`."""
    return forms.current().row_tile


def attention_takes_key_range() -> bool:
    """Whether the form in force builds attention's mask from a `KeyRange`'s index vectors
    (forward and backward), so callers need not make the `[B, C, S]` mask."""
    return forms.current().attention_key_range


def reads_layers_in_place() -> bool:
    """Whether `layer_matmul` reads a stacked weight's layer in place (the ordered CPU form)
    rather than slicing it out first."""
    return forms.current().reads_layers_in_place


def _matmul_fwd_impl(rows_MxI, w_IxO, out_dtype):
    form = forms.current()
    return form.matmul(rows_MxI, w_IxO, out_dtype, form.fp32_precision(rows_MxI, w_IxO))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _tiled_matmul(rows_MxI, w_IxO, out_dtype):
    return _matmul_fwd_impl(rows_MxI, w_IxO, out_dtype)


def _tiled_matmul_fwd(rows_MxI, w_IxO, out_dtype):
    return _matmul_fwd_impl(rows_MxI, w_IxO, out_dtype), (rows_MxI, w_IxO)


def _tiled_matmul_bwd(out_dtype, res, g_MxO):
    rows, w = res
    form = forms.current()
    return form.backward.matmul(rows, w, g_MxO, form.fp32_precision(g_MxO, w))


_tiled_matmul.defvjp(_tiled_matmul_fwd, _tiled_matmul_bwd)


def matmul(x_MxI: jax.Array, w_IxO: jax.Array, out_dtype=None) -> jax.Array:
    """Row-invariant `x @ w`: leading dims of x are flattened into rows, computed by the form
    in force; backward by the form's `Backward.matmul` (`jax.custom_vjp`).

    Args:
      x_MxI: `[..., I]` any float dtype. w_IxO: `[I, O]` same dtype as x.
      out_dtype: accumulate/return dtype (`preferred_element_type`); default x.dtype.
    Returns: `[..., O]`.
    Raises: ConfigError for an unknown LOOPRL_KERNELS (or alias) value, or when the ordered
      kernel cannot be built (no C++ compiler: `cpu.ffi.build`).
    """
    x = x_MxI
    lead = x.shape[:-1]
    i, o = x.shape[-1], w_IxO.shape[-1]
    rows = x.reshape(-1, i)
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    y = _tiled_matmul(rows, w_IxO, out_dtype)
    return y.reshape(*lead, o)


def layer_matmul(x_MxI: jax.Array, w: LayerWeight, out_dtype=None) -> jax.Array:
    """`matmul(x, w.stack[w.index])`, the same bits, with the layer read in place where the form
    can (`reads_layers_in_place`); elsewhere the layer is sliced first. Not differentiable on
    the ordered CPU form (the sampler's form).

    Args: x `[..., I]` float; w a `LayerWeight` of a `[L, I, O]` stack in x's dtype (float32 or
      bfloat16); out_dtype as `matmul`. Returns `[..., O]`."""
    if not reads_layers_in_place():
        return matmul(x_MxI, jax.lax.dynamic_index_in_dim(w.stack, w.index, 0, False), out_dtype)
    return forms.current().layer_matmul(x_MxI, w, jnp.dtype(out_dtype or x_MxI.dtype))


def rowsum(x, keepdims: bool = True, keep: tuple = ()):
    """Row-invariant sum over the last axis, fp32 `[..., 1]` (`[...]` without keepdims): the
    product of x with a `[N, 16]` ones-in-column-0 literal (XLA's reduce emitter does not give
    every row one order; a literal, so that XLA cannot rewrite the dot into a reduce). On the
    ordered CPU form the product's column 0 comes from `cpu.ffi.row_sum`, the same chains
    without the 15 zero columns, and `keep` (arrays) stay alive until the sum is taken
    (`softmax`). Differentiable (the product's backward)."""
    x = x.astype(jnp.float32)
    form = forms.current()
    if form.rowsum is not None:
        y = form.rowsum(x.reshape(-1, x.shape[-1]), tuple(keep))
        y = y.reshape(*x.shape[:-1], 1)
    else:
        y = matmul(x, jnp.asarray(ones_column(x.shape[-1])))[..., :1]
    return y if keepdims else y[..., 0]


def _row_max(x_MxN):
    """Each row's max as `[M, 1]`, not differentiated (the softmaxes' shift): the form's
    kernel, else XLA's reduce. Which one cannot move a bit (docs/NUMERICS.md, "Softmax")."""
    x_MxN = jax.lax.stop_gradient(x_MxN)
    form = forms.current()
    if form.row_max is not None:
        return form.row_max(x_MxN)
    return jnp.max(x_MxN, axis=-1, keepdims=True)


def _tiled_rows(fn, x):
    """Apply the row-wise `fn` (last axis = a row) to `x` as a `[M, N]` block with M padded to a
    multiple of ROW_TILE (zero rows; always at least one) and N to a multiple of LAST_AXIS_TILE
    (-inf entries), then cut back: every row compiles to the same elementwise code, whatever
    produced x and however many rows there are (docs/NUMERICS.md, "Softmax")."""
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
    """Row-invariant fp32 softmax over the last axis (max is order-free; the sum is `rowsum`),
    on fixed tiles (`_tiled_rows`)."""
    def fn(x):
        e = jnp.exp(x - _row_max(x))
        return e / rowsum(e, keep=(x,))  # x alive: XLA does not write e over it in place

    return _tiled_rows(fn, x.astype(jnp.float32))


def log_softmax(x):
    """Row-invariant fp32 log-softmax over the last axis (entries of -inf stay -inf), on fixed
    tiles (`_tiled_rows`)."""
    def fn(x):
        shifted = x - _row_max(x)
        return shifted - jnp.log(rowsum(jnp.exp(shifted), keep=(x,)))

    return _tiled_rows(fn, x.astype(jnp.float32))


def row_argmax(x_RxN):
    """`jnp.argmax(x, axis=-1)` (int32 `[R]`, each row's first maximum) of x float32 `[R, N]`;
    on the ordered CPU form an FFI call on materialised x (`cpu.ffi.row_argmax`), so
    that XLA cannot fuse x's producer into its reduce's scalar loop. The same index either
    way."""
    form = forms.current()
    if form.row_argmax is not None:
        return form.row_argmax(x_RxN)
    return jnp.argmax(x_RxN, axis=-1).astype(jnp.int32)


def _dense(mask):
    """The bool `[B, C, S]` mask of `mask` (a `KeyRange` or already the mask)."""
    return mask.mask() if isinstance(mask, KeyRange) else mask


def _attention_tiled_impl(q, k, v, mask, scale):
    form = forms.current()
    mask = mask if form.attention_key_range else _dense(mask)
    return form.attention(q, k, v, mask, scale, softmax, form.fp32_precision(q, k))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention_tiled(q, k, v, mask, scale):
    """The form's attention, q `[B, H, C, K]`, K/V `[B, S, J, K]`: J = H, or the J kv heads
    themselves where the form reads them by index (`Form.kv_heads_by_index`)."""
    return _attention_tiled_impl(q, k, v, mask, scale)


def _attention_tiled_fwd(q, k, v, mask, scale):
    out = _attention_tiled_impl(q, k, v, mask, scale)
    saved = out if forms.current().backward.attention_grads is not None else None
    return out, (q, k, v, mask, saved)


def _attention_tiled_bwd(scale, res, g):
    """The form's own backward where it has one (`Backward.attention_grads`: the Pallas forms'
    flash backward), else the same math without tiles or padding over the repeated heads (the
    repeat's transpose sums each kv head's share; no repeat where J = H): the backward needs no
    invariance."""
    q, k, v, mask, out = res
    form = forms.current()
    prec = form.fp32_precision(q, k)
    if form.backward.attention_grads is not None:
        mask = mask if form.attention_key_range else _dense(mask)
        return (*form.backward.attention_grads(q, k, v, mask, out, g, scale, prec), None)

    def fn(q, k, v):
        return form.backward.attention(q, *repeat_kv_heads(k, v, q.shape[1]), _dense(mask),
                                       scale, softmax, prec)
    _, vjp = jax.vjp(fn, q, k, v)
    return (*vjp(g), None)


_attention_tiled.defvjp(_attention_tiled_fwd, _attention_tiled_bwd)


def attention(q_BxCxHxK, k_BxSxJxK, v_BxSxJxK, mask_BxCxS, scale: float):
    """Causal softmax attention of C queries over the whole key axis S (fixed length), by the
    form in force: fp32 scores, masked with a finite large negative value, fp32 softmax,
    probabilities cast to the compute dtype for the value product (the HF eager convention).
    Backward by the form's `Backward.attention` (`jax.custom_vjp`).

    Args:
      q_BxCxHxK: queries `[B, C, H, K]`; k/v `[B, S, J, K]` with J kv heads, H % J == 0 (GQA,
        `repeat_kv_heads`);
      mask_BxCxS: bool, True where query c may attend to key s; or the `KeyRange` it comes
        from (made dense here unless `attention_takes_key_range()`).
    Returns: `[B, C, H, K]` in q's dtype.
    """
    B, C, H, K = q_BxCxHxK.shape
    q_BxHxCxK = jnp.swapaxes(q_BxCxHxK, 1, 2)  # K/V stay in the cache's layout [B, S, H, K]
    if not forms.current().kv_heads_by_index:
        k_BxSxJxK, v_BxSxJxK = repeat_kv_heads(k_BxSxJxK, v_BxSxJxK, H)  # now J = H
    out = _attention_tiled(q_BxHxCxK, k_BxSxJxK, v_BxSxJxK, mask_BxCxS, float(scale))
    return jnp.swapaxes(out, 1, 2)


def attention_cached(q_BxCxHxK, kv: CachedKV, mask_BxCxS, scale: float, stock: bool = False):
    """`attention` (or `stock_attention`) over the keys and values `kv` describes, the same
    bits as `attention(q, *kv.slots(), ...)`. The ordered CPU form and the Pallas forms
    (`pallas-gpu`; `pallas-tpu` in the decode step) read the cache in place (no slot,
    sub-batch or K/V block copied; GQA kv heads read without repeating them); the others make
    the slot first (`kv.slots()`). The sampler's form: not differentiable where it reads in
    place.

    Args: q `[B, C, H, K]` (B = M rows); kv: `CachedKV`; mask `[B, C, S]` bool, or the
      `KeyRange` it comes from.
    Returns `[B, C, H, K]` in q's dtype."""
    form = forms.current()
    if stock or form.attention_cached is None:
        mask_BxCxS = _dense(mask_BxCxS)
        fn = stock_attention if stock else attention
        return fn(q_BxCxHxK, *kv.slots(), mask_BxCxS, scale)
    out = form.attention_cached(jnp.swapaxes(q_BxCxHxK, 1, 2), kv, mask_BxCxS, float(scale),
                                softmax)
    return jnp.swapaxes(out, 1, 2)


def stock_matmul(x, w, out_dtype=None):
    """`x @ w` the common way (no row padding): the baseline, not batch-invariant."""
    return _stock.stock_matmul(x, w, out_dtype or x.dtype, forms.current().fp32_precision(x, w))


def stock_attention(q_BxCxHxK, k_BxSxJxK, v_BxSxJxK, mask_BxCxS, scale: float):
    """Attention the common way: keys trimmed to the live prefix (the caller passes a
    live-length key axis), no row padding, scores in the compute dtype as PyTorch eager
    computes them before an fp32 softmax. `mask_BxCxS`: bool, or a `KeyRange`."""
    return _stock.stock_attention(q_BxCxHxK, k_BxSxJxK, v_BxSxJxK, _dense(mask_BxCxS), scale,
                                  forms.current().fp32_precision)


def rms_norm(x, weight, eps: float, stock: bool = False):
    """RMSNorm as the reference code does it: normalise in fp32, cast back to x's dtype, then
    multiply by the weight (cast to x's dtype). `x` `[..., D]`, `weight` `[D]`. The mean of
    squares is a `rowsum` (row-invariant) unless `stock`."""
    xf = x.astype(jnp.float32)
    if stock:
        var = jnp.mean(xf * xf, axis=-1, keepdims=True)
    else:
        var = rowsum(xf * xf) * jnp.float32(1.0 / x.shape[-1])
    out = (xf * jax.lax.rsqrt(var + jnp.float32(eps))).astype(x.dtype)
    return scale_last(out, weight.astype(x.dtype))


def global_norm(tree):
    """fp32 scalar: the l2 norm of every leaf of `tree` together (`optax.tree.norm`'s value). On
    `cpu-ordered` each leaf's sum of squares is an ordered sum (`cpu.ordered.sum_all`) and the
    leaves add in tree order, so the bits do not depend on the ISA; elsewhere
    `optax.tree.norm`."""
    return forms.current().backward.global_norm(tree)


def scale_last(x_xD, w_D):
    """`x * w`, w `[D]` broadcast over x's last axis; on `cpu-ordered` w's gradient is an
    ordered sum over the rows (`cpu.ordered.scale_last`). The same forward bits everywhere."""
    return forms.current().backward.scale_last(x_xD, w_D)


def add_last(x_xD, b_D):
    """`x + b`, b `[D]` broadcast over x's last axis; on `cpu-ordered` b's gradient is an
    ordered sum over the rows (`cpu.ordered.add_last`). The same forward bits everywhere."""
    return forms.current().backward.add_last(x_xD, b_D)


def rope_cos_sin(positions, head_dim: int, theta: float, dtype):
    """RoPE tables for integer `positions` `[...]`: cos, sin `[..., head_dim]` (rotate-half
    layout: frequencies repeated twice), computed in fp32 and cast to `dtype` (HF convention)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(x_BxCxHxK, cos_BxCxK, sin_BxCxK):
    """q*cos + rotate_half(q)*sin with rotate_half(x) = cat(-x2, x1); the form's own `rope`
    where it has one (the Pallas forms: the same expression, fenced)."""
    rope = forms.current().rope
    return (rope or rope_rotate_half)(x_BxCxHxK, cos_BxCxK, sin_BxCxK)
