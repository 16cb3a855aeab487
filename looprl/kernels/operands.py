"""The operand forms the kernels accept besides plain arrays: a causal mask as its two index
vectors (`KeyRange`), a layer's K/V as the sampler's cache holds them (`CachedKV`), and one
layer of a stacked weight (`LayerWeight`). The ordered CPU form reads each in place; the other
forms make the plain array first, with the same values."""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from looprl.kernels.tiling import K_BLOCK


@functools.partial(jax.tree_util.register_dataclass, data_fields=["pad_B", "layout_C"],
                   meta_fields=["S"])
@dataclasses.dataclass(frozen=True)
class KeyRange:
    """The causal, left-padded key mask as its two index vectors: query c of row b may see key
    s iff `pad_B[b] <= s <= layout_C[c]` (s < S). `mask()` is that `[B, C, S]` mask. The layout
    is left-padded (row b's tokens occupy [pad_b, S)): masks come from indices and lengths,
    never from token values. pad_B:
    left-padding counts, 0 <= pad_b <= S; layout_C: C >= 1 layout indices (`w0 + arange(C)`
    in the sampler and the learner; any order works); both int32-range. A pytree whose S is
    static, so it passes through `jit`, `scan` and `custom_vjp` as its two vectors."""
    pad_B: jax.Array  # int [B]
    layout_C: jax.Array  # int [C]
    S: int

    def mask(self):
        s = jnp.arange(self.S)
        return ((s[None, None, :] >= self.pad_B[:, None, None])
                & (s[None, None, :] <= self.layout_C[None, :, None]))

    def rotated_blocks(self):
        """`(mask, offset_B)` with the values `tiling.mask_in_blocks` then
        `tiling.keys_from_first_live(mask, offset_B, 2)` give from `mask()`, built by an iota
        compare instead of a pad, an argmax and a gather. The first key any query of row b sees
        is pad_b when `pad_b <= last` (last = min(max_c layout_c, S - 1)), else none (offset 0,
        the row all masked); rotated slot t is key `(t + pad_b) mod Sp`, which a query at
        layout_c sees iff `t <= min(layout_c, S - 1) - pad_b`. Returns bool `[B, C, Sp]` (Sp =
        S rounded up to K_BLOCK) and int32 `[B]`."""
        Sp = -(-self.S // K_BLOCK) * K_BLOCK
        pad_B = self.pad_B.astype(jnp.int32)
        last_C = jnp.minimum(self.layout_C.astype(jnp.int32), self.S - 1)
        offset_B = jnp.where(pad_B <= jnp.max(last_C), pad_B, 0)
        t = jnp.arange(Sp, dtype=jnp.int32)
        mask = t[None, None, :] <= (last_C[None, :, None] - pad_B[:, None, None])
        return mask, offset_B


class CachedKV(NamedTuple):
    """A layer's keys and values as the sampler's KV cache holds them, to be read in place.

    Row m's keys are slot `slot` of `k_NxBxSxJxK` (N slots, one per (loop, layer): the
    sampler's `[T, L, B, S, J, K]` cache reshaped) at batch row `rows_M[m]`, with the chunk's
    window `k_win_MxCxJxK` written over slots [w0, w0 + C) (w0 clamped to [0, S - C]); values
    alike. `slots()` makes that slot (a copy); `kernels.attention_cached` reads it without one
    where the form can."""
    k_NxBxSxJxK: jax.Array
    v_NxBxSxJxK: jax.Array
    slot: jax.Array  # int32 scalar
    rows_M: jax.Array  # int32 [M]
    w0: jax.Array  # int32 scalar
    k_win_MxCxJxK: jax.Array
    v_win_MxCxJxK: jax.Array

    def slots(self):
        """`(k, v)`, each `[M, S, J, K]`: the rows' slot with the window written (a copy; the
        cache's dtype)."""
        def one(cache, win):
            rows = jax.lax.dynamic_index_in_dim(cache, self.slot, 0, keepdims=False)[self.rows_M]
            return jax.lax.dynamic_update_slice_in_dim(rows, win.astype(rows.dtype), self.w0, 1)
        return one(self.k_NxBxSxJxK, self.k_win_MxCxJxK), one(self.v_NxBxSxJxK,
                                                              self.v_win_MxCxJxK)


def cache_window(cache_NxBxSxJxK, slot, rows_M, w0, C: int):
    """Slots [w0, w0 + C) of cache slot `slot` at batch rows `rows_M`: `[M, C, J, K]` (w0
    clamped to [0, S - C], as `dynamic_slice` clamps)."""
    N, B, S, J, K = cache_NxBxSxJxK.shape
    win = jax.lax.dynamic_slice(cache_NxBxSxJxK, (slot, 0, w0, 0, 0), (1, B, C, J, K))[0]
    return win[rows_M]


class LayerWeight(NamedTuple):
    """Layer `index` (an int32 scalar, may be traced) of a stacked weight `[L, I, O]`, for
    `kernels.layer_matmul` to read in place (the sampler's layer loop, `layers.stack_pass`)."""
    stack: jax.Array
    index: jax.Array


def repeat_kv_heads(k_BxSxJxK, v_BxSxJxK, H: int):
    """GQA: each of the J key/value heads repeated H // J times along the head axis (head h
    reads kv head h // (H // J), HF's `repeat_kv`), giving `[B, S, H, K]` each; unchanged when
    J = H. An exact copy."""
    J = k_BxSxJxK.shape[2]
    if J == H:
        return k_BxSxJxK, v_BxSxJxK
    return (jnp.repeat(k_BxSxJxK, H // J, axis=2), jnp.repeat(v_BxSxJxK, H // J, axis=2))
