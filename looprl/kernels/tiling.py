"""Tiling helpers and constants every kernel form shares: row tiles, contraction blocks, and the
per-row rotation of the key axis into 128-key blocks (docs/NUMERICS.md, "Attention").

All of them only pad, slice, reshape or gather: they move no bits.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from looprl.determinism import cpu_isa, cpu_row_quantum

ROW_TILE = 64  # the fixed row tile of the accelerator forms, and the softmax tiles
CPU_ISA = cpu_isa()  # read once: the quantum and the kernel version must name the same ISA
# CPU: a row tile is a multiple of this, the sgemm register block of the machine's ISA (8 with
# AVX-512, 24 elsewhere: `looprl.determinism.cpu_row_quantum`), recorded as `Schedule.row_tile`
ROW_QUANTUM = cpu_row_quantum(CPU_ISA)
ROW_TILE_MAX = 512 // ROW_QUANTUM * ROW_QUANTUM  # CPU: the largest row tile of a dot (512, 504)
N_MIN = 16  # output columns of a blocked dot are padded to a multiple of this
K_BLOCK = 128  # longest contraction of one dot (longer ones: blocks summed in order)
BATCHED_MAX_ROWS = 16  # CPU XLA form: tiles up to this many rows take their partials in one dot
MASK_VALUE = -1e30  # finite, so fully-masked (padding) query rows never make NaN
LAST_AXIS_TILE = 64  # softmax tiles: the last axis padded to a multiple of this


def pad_to_multiple(x, axis: int, multiple: int):
    """`x` zero-padded at the end of `axis` to a multiple of `multiple` (unchanged if it is one);
    every form's padding."""
    n = x.shape[axis]
    n_pad = -(-n // multiple) * multiple
    if n_pad == n:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, n_pad - n)
    return jnp.pad(x, widths)


def ones_column(n: int) -> np.ndarray:
    """The literal `[n, 16]` weight of `kernels.rowsum`'s product: ones in column 0, zeros
    elsewhere."""
    ones = np.zeros((n, N_MIN), np.float32)
    ones[:, 0] = 1.0
    return ones


def pad_rows(x, axis: int, tile: int = ROW_TILE):
    """(`x` zero-padded along `axis` to a multiple of `tile`, the length it had)."""
    return pad_to_multiple(x, axis, tile), x.shape[axis]


def row_tile_for(m: int) -> int:
    """The CPU row tile for an m-row call: the fewest tiles of at most ROW_TILE_MAX rows, each
    the equal share of m rounded up to a multiple of ROW_QUANTUM (quantum 8: m = 300: one
    304-row tile; 1000: two of 504; 4096: eight of 512; quantum 24: 312, two of 504, nine of
    456). Any multiple of the quantum gives the same bits (docs/NUMERICS.md), so this choice is
    only about cost."""
    n = -(-max(m, 1) // ROW_TILE_MAX)
    share = -(-max(m, 1) // n)
    return -(-share // ROW_QUANTUM) * ROW_QUANTUM


def tiles_map(fn, x, axis: int):
    """`fn` applied to row tiles of `x` along `axis` (zero-padded to a multiple of
    `row_tile_for(n)`), results joined and cut back to n. One tile runs without a loop; more
    run in one `lax.map`, so `fn` is traced once, at one shape."""
    n = x.shape[axis]
    t = row_tile_for(n)
    x, _ = pad_rows(x, axis, t)
    tiles = x.shape[axis] // t
    if tiles == 1:
        y = fn(x)
    else:
        xs = jnp.moveaxis(x.reshape(*x.shape[:axis], tiles, t, *x.shape[axis + 1:]), axis, 0)
        ys = jax.lax.map(fn, xs)
        y = jnp.moveaxis(ys, 0, axis)
        y = y.reshape(*y.shape[:axis], tiles * t, *y.shape[axis + 2:])
    return jax.lax.slice_in_dim(y, 0, n, axis=axis)


def k_blocks(w_IxO):
    """`[nb, kb, O16]`: O zero-padded to a multiple of N_MIN, I cut into kb = min(I, K_BLOCK)
    long blocks (zero-padded), in the weight's own dtype. Zero rows add exact zeros."""
    w, _ = pad_rows(w_IxO, 1, N_MIN)
    kb = min(w.shape[0], K_BLOCK)
    w, _ = pad_rows(w, 0, kb)
    return w.reshape(-1, kb, w.shape[1])


def keys_from_first_live(x, offset_B, axis: int, start=0, length=None, period=None):
    """Slots `start .. start + length` (default: all) of `x`'s key axis rotated left per row by
    its offset modulo `period` (default: the axis length S): rotated slot s holds the key at
    `(s + offset_b) mod period`. An exact gather. With `period` > S the slots at S or past it
    are masked padding slots and read x's last key (any finite value serves under probability
    +0). `start` may be traced. A bf16 x is gathered as its uint16 bits: XLA CPU widens the
    whole operand of a bf16 gather to fp32 first."""
    if x.dtype == jnp.bfloat16:
        bits = jax.lax.bitcast_convert_type(x, jnp.uint16)
        return jax.lax.bitcast_convert_type(
            keys_from_first_live(bits, offset_B, axis, start, length, period), jnp.bfloat16)
    S = x.shape[axis]
    period = S if period is None else period
    length = period if length is None else length
    idx = (start + jnp.arange(length)[None, :] + offset_B[:, None]) % period  # [B, length]
    if period > S:
        idx = jnp.minimum(idx, S - 1)
    shape = [1] * x.ndim
    shape[0], shape[axis] = idx.shape
    return jnp.take_along_axis(x, idx.reshape(shape), axis=axis)


def mask_in_blocks(mask_BxCxS):
    """The mask padded to a multiple of K_BLOCK key slots (the new slots masked), and each row's
    first key any of its queries may see (`offset_B`, int `[B]`: the rotation)."""
    mask, _ = pad_rows(mask_BxCxS, 2, K_BLOCK)
    return mask, jnp.argmax(jnp.any(mask, axis=1), axis=-1)


def keys_in_blocks_from_first_live(k_BxHxSxK, v_BxHxSxK, mask_BxCxS):
    """K, V and the mask padded to K_BLOCK multiples and rotated per row so that the row's first
    live key sits in slot 0 (exact: pads and gathers)."""
    mask, offset_B = mask_in_blocks(mask_BxCxS)
    k, _ = pad_rows(k_BxHxSxK, 2, K_BLOCK)
    v, _ = pad_rows(v_BxHxSxK, 2, K_BLOCK)
    return tuple(keys_from_first_live(x, offset_B, 2) for x in (k, v, mask))


def map_query_tiles(tile, q_BxHxCxK, mask_BxCxS, t: int):
    """`tile((q [B, H, t, K], mask [B, t, S]))` over the t-row query tiles of padded queries, in
    one `lax.map` (traced once, at one shape), results joined back to `[B, H, C, K]`."""
    B, H, C, K = q_BxHxCxK.shape
    tiles = C // t
    qs = jnp.moveaxis(q_BxHxCxK.reshape(B, H, tiles, t, K), 2, 0)
    ms = jnp.moveaxis(mask_BxCxS.reshape(B, tiles, t, -1), 1, 0)
    return jnp.moveaxis(jax.lax.map(tile, (qs, ms)), 0, 2).reshape(B, H, tiles * t, K)


def live_key_blocks(mask_BxRxS):
    """How many K_BLOCK-key blocks, from slot 0, hold every key any query row of the tile may
    see: int32 scalar, 0 when no row sees a key (a tile of padding rows)."""
    S = mask_BxRxS.shape[-1]
    live_S = jnp.any(mask_BxRxS, axis=(0, 1))
    last = jnp.max(jnp.where(live_S, jnp.arange(1, S + 1, dtype=jnp.int32), 0))
    return (last + K_BLOCK - 1) // K_BLOCK


def masked_probs(scores_BxHxRxS, mask_BxRxS, scale, dtype, softmax_fn):
    """fp32 scores -> probabilities in the compute dtype: scaled, masked slots set to MASK_VALUE
    (probability exactly 0), fp32 softmax over the key axis, cast to `dtype`."""
    scores = jnp.where(mask_BxRxS[:, None], scores_BxHxRxS * jnp.float32(scale), MASK_VALUE)
    return softmax_fn(scores).astype(dtype)
