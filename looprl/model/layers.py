"""One Ouro decoder layer ("sandwich" norm) and the shared L-layer stack, as pure functions.

Layer (DESIGN.md §1, Ouro's modeling code):
  a = x + N_in2(Attn(N_in(x)));  y = a + N_post2(MLP(N_post(a)));  MLP(z) = W_down(silu(W_gate z) * W_up z)

Weights are a dict of arrays in compute dtype with Linear kernels stored `[in, out]`
(HF/PyTorch stores `[out, in]`; `looprl.model.hf` transposes). Stacked layer weights carry a
leading `L` axis and the stack is a `lax.scan` over it.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from looprl.model import kernels as kn
from looprl.model.config import OuroConfig

LAYER_KEYS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
              "input_layernorm", "input_layernorm_2", "post_attention_layernorm",
              "post_attention_layernorm_2")


def key_mask(positions_in_layout_C, pad_B, seq_len: int):
    """Mask `[B, C, S]`: query at layout index c may see key s iff pad_b <= s <= c.

    The layout is left-padded: row b's tokens occupy [pad_b, S). Masks come from indices and
    lengths, never from token values."""
    s = jnp.arange(seq_len)
    q = positions_in_layout_C
    return (s[None, None, :] >= pad_B[:, None, None]) & (s[None, None, :] <= q[None, :, None])


def decoder_layer(cfg: OuroConfig, lw, x_BxCxD, cos, sin, k_BxSxJxK, v_BxSxJxK, write_BxC,
                  w0, mask_BxCxS, stock: bool = False):
    """Apply one layer to a chunk of C positions whose first layout index is `w0`.

    The chunk's keys/values are written into the layer's KV slot `[B, S, J, K]` (J kv heads) at
    [w0, w0 + C) where `write_BxC` is True (elsewhere the slot keeps what it had), then the
    chunk's queries attend over the whole slot. Returns (y_BxCxD, k_slot, v_slot).
    """
    mm = kn.stock_matmul if stock else kn.matmul
    attend = kn.stock_attention if stock else kn.attention
    B, C, _ = x_BxCxD.shape
    H, J, K = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    eps = cfg.rms_norm_eps
    norm = functools.partial(kn.rms_norm, eps=eps, stock=stock)
    h = norm(x_BxCxD, lw["input_layernorm"])
    q = kn.apply_rope(mm(h, lw["q_proj"]).reshape(B, C, H, K), cos, sin)
    k = kn.apply_rope(mm(h, lw["k_proj"]).reshape(B, C, J, K), cos, sin)
    v = mm(h, lw["v_proj"]).reshape(B, C, J, K)
    k_old = jax.lax.dynamic_slice_in_dim(k_BxSxJxK, w0, C, axis=1)
    v_old = jax.lax.dynamic_slice_in_dim(v_BxSxJxK, w0, C, axis=1)
    wmask = write_BxC[:, :, None, None]
    k_BxSxJxK = jax.lax.dynamic_update_slice_in_dim(k_BxSxJxK, jnp.where(wmask, k, k_old), w0, 1)
    v_BxSxJxK = jax.lax.dynamic_update_slice_in_dim(v_BxSxJxK, jnp.where(wmask, v, v_old), w0, 1)
    o = attend(q, k_BxSxJxK, v_BxSxJxK, mask_BxCxS, K ** -0.5).reshape(B, C, H * K)
    a = x_BxCxD + norm(mm(o, lw["o_proj"]), lw["input_layernorm_2"])
    z = norm(a, lw["post_attention_layernorm"])
    m = mm(jax.nn.silu(mm(z, lw["gate_proj"])) * mm(z, lw["up_proj"]), lw["down_proj"])
    y = a + norm(m, lw["post_attention_layernorm_2"])
    return y, k_BxSxJxK, v_BxSxJxK


def stack_pass(cfg: OuroConfig, w, x_BxCxD, positions_BxC, layout_C, pad_B, k_LxBxSxJxK,
               v_LxBxSxJxK, write_BxC, w0, stock: bool = False):
    """One loop (ut step): all L shared layers, then the shared final norm (`model.norm`).

    Args:
      w: compute-dtype weights (see `looprl.model.looped.cast_weights`).
      x_BxCxD: the chunk's input hidden states (embeddings at loop 1, h(t-1) after).
      positions_BxC: RoPE positions (layout index minus the row's left padding).
      layout_C: layout indices of the chunk, `w0 + arange(C)`.
      k/v_LxBxSxJxK: this loop's KV slots for every layer.
    Returns: (h_BxCxD normalised, k_LxBxSxJxK, v_LxBxSxJxK).
    """
    S = k_LxBxSxJxK.shape[2]
    cos, sin = kn.rope_cos_sin(positions_BxC, cfg.head_dim, cfg.rope_theta, x_BxCxD.dtype)
    mask = key_mask(layout_C, pad_B, S)

    def body(x, xs):
        lw, k_slot, v_slot = xs
        y, k_slot, v_slot = decoder_layer(cfg, lw, x, cos, sin, k_slot, v_slot, write_BxC, w0,
                                          mask, stock)
        return y, (k_slot, v_slot)

    out, (k_new, v_new) = jax.lax.scan(body, x_BxCxD, (w["layers"], k_LxBxSxJxK, v_LxBxSxJxK))
    return kn.rms_norm(out, w["norm"], cfg.rms_norm_eps, stock), k_new, v_new
