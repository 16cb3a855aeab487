"""One Ouro decoder layer ("sandwich" norm) and the shared L-layer stack, as pure functions.

Layer (docs/DESIGN.md section 1, Ouro's modeling code):
  a = x + N_in2(Attn(N_in(x)));  y = a + N_post2(MLP(N_post(a)));  MLP(z) = W_down(silu(W_gate z) * W_up z)

Weights are a dict of arrays in compute dtype with Linear kernels stored `[in, out]`
(HF/PyTorch stores `[out, in]`; `looprl.model.hf` transposes). Stacked layer weights carry a
leading `L` axis and the stack is a `lax.scan` over it.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from looprl import kernels as kn
from looprl.model.config import OuroConfig

LAYER_KEYS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
              "input_layernorm", "input_layernorm_2", "post_attention_layernorm",
              "post_attention_layernorm_2")


def decoder_layer(cfg: OuroConfig, lw, x_BxCxD, cos, sin, k_BxSxJxK, v_BxSxJxK, write_BxC,
                  w0, mask_BxCxS, stock: bool = False, cached=None):
    """Apply one layer to a chunk of C positions whose first layout index is `w0`.

    The chunk's keys/values are written into the layer's KV slot `[B, S, J, K]` (J kv heads) at
    [w0, w0 + C) where `write_BxC` is True (elsewhere the slot keeps what it had), then the
    chunk's queries attend over the whole slot. Returns (y_BxCxD, k_win, v_win): the slot's
    window [w0, w0 + C) after the write, `[B, C, J, K]` (the caller puts it into its cache, so
    the updated slot itself never leaves the layer: no copy of the whole slot per layer).
    With `cached` = (k, v `[N, B', S, J, K]`, slot, rows `[B]`) instead of k/v (None), the slot
    is slot `slot` of that cache at those batch rows, read in place (`kernels.attention_cached`:
    the sampler's form, not differentiable).
    """
    def mm(x, w):  # a LayerWeight (the sampler's layer loop) is read in place
        if isinstance(w, kn.LayerWeight):
            return kn.layer_matmul(x, w)
        return kn.stock_matmul(x, w) if stock else kn.matmul(x, w)

    attend = kn.stock_attention if stock else kn.attention
    B, C, _ = x_BxCxD.shape
    H, J, K = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    eps = cfg.rms_norm_eps
    norm = functools.partial(kn.rms_norm, eps=eps, stock=stock)
    h = norm(x_BxCxD, lw["input_layernorm"])
    q = kn.apply_rope(mm(h, lw["q_proj"]).reshape(B, C, H, K), cos, sin)
    k = kn.apply_rope(mm(h, lw["k_proj"]).reshape(B, C, J, K), cos, sin)
    v = mm(h, lw["v_proj"]).reshape(B, C, J, K)
    if cached is None:
        k_old = jax.lax.dynamic_slice_in_dim(k_BxSxJxK, w0, C, axis=1)
        v_old = jax.lax.dynamic_slice_in_dim(v_BxSxJxK, w0, C, axis=1)
    else:
        k_cache, v_cache, slot, rows_B = cached
        k_old, v_old = (kn.cache_window(c, slot, rows_B, w0, C) for c in (k_cache, v_cache))
    wmask = write_BxC[:, :, None, None]
    k_win, v_win = jnp.where(wmask, k, k_old), jnp.where(wmask, v, v_old)
    if cached is None:
        k_BxSxJxK = jax.lax.dynamic_update_slice_in_dim(k_BxSxJxK, k_win, w0, 1)
        v_BxSxJxK = jax.lax.dynamic_update_slice_in_dim(v_BxSxJxK, v_win, w0, 1)
        o = attend(q, k_BxSxJxK, v_BxSxJxK, mask_BxCxS, K ** -0.5)
    else:
        o = kn.attention_cached(q, kn.CachedKV(k_cache, v_cache, slot, rows_B, w0, k_win, v_win),
                                mask_BxCxS, K ** -0.5, stock)
    o = o.reshape(B, C, H * K)
    a = x_BxCxD + norm(mm(o, lw["o_proj"]), lw["input_layernorm_2"])
    z = norm(a, lw["post_attention_layernorm"])
    m = mm(jax.nn.silu(mm(z, lw["gate_proj"])) * mm(z, lw["up_proj"]), lw["down_proj"])
    y = a + norm(m, lw["post_attention_layernorm_2"])
    return y, k_win, v_win


@jax.custom_jvp
def layer_bits(a):
    """A bf16 array as its uint16 bits (other dtypes unchanged), to be sliced per layer.

    XLA CPU's float normalization computes a dynamic slice of a bf16 array in fp32: it widens
    the whole operand first, and the widened stack, loop-invariant, is then hoisted out of the
    layer loop as an fp32 copy of every layer (a bf16 `generate` would hold more than an fp32
    one). An integer slice moves the bits only, so the values are the same bits.
    Not differentiable: differentiating through it raises (a bitcast's gradient would be a
    silent zero), so only the sampler, which takes no gradient, uses it."""
    return jax.lax.bitcast_convert_type(a, jnp.uint16) if a.dtype == jnp.bfloat16 else a


@layer_bits.defjvp
def _layer_bits_jvp(primals, tangents):
    raise TypeError("layer_bits is not differentiable (the sampler's weight slicing); the "
                    "learner's passes slice the fp32 master stacks (stack_pass bits=False)")


def _from_bits(a, dtype):
    return jax.lax.bitcast_convert_type(a, dtype) if a.dtype != dtype else a


MATMUL_WEIGHTS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def stack_pass(cfg: OuroConfig, w, x_BxCxD, positions_BxC, layout_C, pad_B, k_LxBxSxJxK,
               v_LxBxSxJxK, write_BxC, w0, stock: bool = False, bits: bool = False,
               loop=None, rows_B=None):
    """One loop (ut step): all L shared layers, then the shared final norm (`model.norm`).

    Args:
      w: `looprl.model.looped.cast_weights`' output: compute-dtype weights, the layer stacks as
        stored (fp32 master or a compute-dtype copy), each layer cast to `w["norm"]`'s dtype in
        the loop.
      x_BxCxD: the chunk's input hidden states (embeddings at loop 1, h(t-1) after).
      positions_BxC: RoPE positions (layout index minus the row's left padding).
      layout_C: layout indices of the chunk, `w0 + arange(C)`.
      k/v_LxBxSxJxK: this loop's KV slots for every layer; with `loop` given, instead the whole
        cache `[T, L, B', S, J, K]`, whose slots `[loop, l]` (`loop` 0-based, an int32 scalar)
        at the batch rows `rows_B` (int32 `[B]`; default all B' = B, in order) each layer's
        attention reads in place (the sampler's form: no copy of the loop's slots or of a
        sub-batch's rows; `kernels.attention_cached`; not differentiable).
      bits: slice bf16 layer weights as their bits (`layer_bits`; the sampler's form: the
        same values, without an fp32 copy of the stack on XLA CPU; not differentiable).
    Returns: (h_BxCxD normalised, k_LxBxCxJxK, v_LxBxCxJxK): every layer's KV window
      [w0, w0 + C) after the chunk's writes (with C = S and w0 = 0: the whole slots).
    """
    S = k_LxBxSxJxK.shape[-3]
    if loop is not None:  # the cache as N = T x L slots (a reshape: no copy)
        T, L = k_LxBxSxJxK.shape[:2]
        k_flat, v_flat = (c.reshape(T * L, *c.shape[2:]) for c in (k_LxBxSxJxK, v_LxBxSxJxK))
        if rows_B is None:
            rows_B = jnp.arange(x_BxCxD.shape[0], dtype=jnp.int32)
    cos, sin = kn.rope_cos_sin(positions_BxC, cfg.head_dim, cfg.rope_theta, x_BxCxD.dtype)
    # attention gets the mask's indices (`kernels.KeyRange`) where its kernels build the mask
    # from them (the sampler's form; the learner's on the Pallas forms), else the mask, once
    keys = kn.KeyRange(pad_B, layout_C, S)
    mask = keys if loop is not None or kn.attention_takes_key_range() else keys.mask()

    stack, dt = w["layers"], w["norm"].dtype
    # the sampler's form reads each matmul weight of the compute dtype in place at its layer
    # (kernels.layer_matmul; a scan slice of it would be a copy per layer pass)
    in_place = (set() if loop is None or stock or not bits or not kn.reads_layers_in_place()
                or dt not in (jnp.float32, jnp.bfloat16)  # the kernel's weight dtypes
                else {k for k in MATMUL_WEIGHTS if k in stack and stack[k].dtype == dt})
    xs_layers = {k: layer_bits(v) if bits else v for k, v in stack.items() if k not in in_place}

    def body(x, xs):
        lw, kv = xs
        if loop is None:
            (k_slot, v_slot), cached = kv, None
        else:  # kv is the layer index l: slot [loop, l] of the cache, read in place
            k_slot = v_slot = None
            cached = (k_flat, v_flat, loop * L + kv, rows_B)
        if bits:
            lw = {k: _from_bits(v, stack[k].dtype) for k, v in lw.items()}
        lw = {k: v.astype(dt) for k, v in lw.items()}  # this layer only (`cast_weights`)
        lw.update({k: kn.LayerWeight(stack[k], kv) for k in in_place})
        y, k_win, v_win = decoder_layer(cfg, lw, x, cos, sin, k_slot, v_slot, write_BxC, w0,
                                        mask, stock, cached)
        return y, (k_win, v_win)

    kv = ((k_LxBxSxJxK, v_LxBxSxJxK) if loop is None
          else jnp.arange(k_LxBxSxJxK.shape[1], dtype=jnp.int32))
    out, (k_new, v_new) = jax.lax.scan(body, x_BxCxD, (xs_layers, kv))
    return kn.rms_norm(out, w["norm"], cfg.rms_norm_eps, stock), k_new, v_new
