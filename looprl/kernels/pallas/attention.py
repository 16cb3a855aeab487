"""Flash-style attention as one Pallas kernel: the attention of the `pallas-gpu` / `pallas-tpu`
forms, for every caller (prefill, chunked and deferred windows, decode, the learner's pass).

Program (b, h, t) owns query tile t (ROW_TILE = 64 query rows, zero-padded) of row b, head h;
kv head h // (H / J) is read by index (GQA without a repeated copy). Row b's key axis is cut into
K_BLOCK = 128-key blocks that start at the row's first live key `o_b` (the first key any of its
queries sees: the sampler's and the learner's rows cut the same blocks whatever their padding,
as the CPU form's rotation does). Blocks z = 0 .. n_t - 1 (n_t: up to the tile's last live key)
run in order, an online softmax in fp32 per query row:

    s = (q @ k_z^T) * scale, masked keys MASK_VALUE      (fp32; fp32 operands at HIGHEST)
    m' = max(m, max(s));  p = exp(s - m');  a = exp(m - m')
    l' = a * l + sum(p);  acc' = a * acc + p.astype(v) @ v_z    (fp32 accumulation)
    (m, l, acc) = (m', l', acc') on rows with a live key in block z, unchanged on the others

and out = acc / l (0 for a row that sees no key). No split over keys; every dot, reduction and
elementwise step has one shape whatever B, C, S or the tile's other queries, and a block with
no live key for a query leaves its state bit for bit, so a query's bits do not depend on how
many queries, rows or key slots share the call. K/V and the mask are padded by one block past
the key axis (no block read passes the end). On the GPU (and interpreted `pallas-gpu`) the
kernel reads block z at `o_b + z * K_BLOCK`, the row where it lies; on a TPU each row is first
rotated so that `o_b` is slot 0 (one more copy), since Mosaic TPU needs block loads at a
multiple of K_BLOCK (error E2003 otherwise). Both read the same keys per block in one order.
The sampler's GPU attention (`flash_attention_cached`) reads the KV cache itself, whole, at
the row's cache row (masked loads past the key axis, the chunk's window selected over its
slots): the same keys per block as over the slot copy, without the copy.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from looprl.kernels.operands import KeyRange
from looprl.kernels.pallas.matmul import pad_to_multiple
from looprl.kernels.pallas.target import compiler_params, fence, lowered
from looprl.kernels.tiling import K_BLOCK, MASK_VALUE, ROW_TILE


def _cached_block(refs, row, w0, col, start, dtype):
    """Keys and values `[K_BLOCK, K]` at slots [start, start + K_BLOCK) of the row's cache slot
    with the chunk's window over [w0, w0 + C): the cache `[N*B', S, J*K]` read in place at row
    `row`, columns [col, col + K), 0 past S (as `flash_attention`'s pad: a dead key's value
    still enters `p @ v` as 0 * v), slots in the window from the window `[C, K]` (a row gather
    at the slot's window index, clamped into [0, C)); cast to `dtype`."""
    kc_ref, vc_ref, kw_ref, vw_ref = refs
    S = kc_ref.shape[1]
    C, K = kw_ref.shape
    pos = start + jax.lax.broadcasted_iota(jnp.int32, (K_BLOCK, K), 0)
    at = (jnp.clip(pos - w0, 0, C - 1), jax.lax.broadcasted_iota(jnp.int32, (K_BLOCK, K), 1))
    in_window = (pos >= w0) & (pos < w0 + C)

    def one(cache_ref, win_ref):
        x = pltriton.load(cache_ref.at[row, pl.ds(start, K_BLOCK), pl.ds(col, K)],
                          mask=pos < S, other=0)
        return jnp.where(in_window, win_ref[at], x).astype(dtype)
    return one(kc_ref, kw_ref), one(vc_ref, vw_ref)


def online_init(R: int, K: int):
    """The online softmax's state for R query rows of width K: (m, l, acc), fp32."""
    return (jnp.full((R, 1), MASK_VALUE, jnp.float32), jnp.zeros((R, 1), jnp.float32),
            jnp.zeros((R, K), jnp.float32))


def online_step(q, k, v, live, carry, scale: float, precision):
    """One key block of the online softmax (module doc): q `[R, K]`, k and v `[K_BLOCK, K]`,
    live bool `[R, K_BLOCK]` (or broadcastable); rows with no live key keep their state bit
    for bit. Every Pallas attention kernel runs this, so their blocks' arithmetic is one."""
    m, l, acc = carry
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32, precision=precision)
    s = jnp.where(live, s * jnp.float32(scale), jnp.float32(MASK_VALUE))
    row_live = jnp.max(live.astype(jnp.int32), axis=1, keepdims=True) > 0
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    p = jnp.exp(s - m_new)
    a = jnp.exp(m - m_new)
    l_new = a * l + jnp.sum(p, axis=1, keepdims=True)
    acc_new = a * acc + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32,
                                precision=precision)
    return (jnp.where(row_live, m_new, m), jnp.where(row_live, l_new, l),
            jnp.where(row_live, acc_new, acc))


def online_out(carry, dtype):
    """out = acc / l, 0 for a row that saw no key, in `dtype`."""
    _, l, acc = carry
    seen = l > 0
    return jnp.where(seen, acc / jnp.where(seen, l, 1.0), 0.0).astype(dtype)


def _kernel(meta_ref, q_ref, k_ref, v_ref, mask_ref, *rest, scale, precision, smem, rotated,
            interpret, rep, key_range):
    """One program (module doc). The cached form (`window`: the K and V windows follow):
    q_ref and o_ref are whole `[M, C, H*K]` (the tile's rows past C masked: no padded copy),
    k_ref, v_ref the caches, meta holds the cache row and w0 (columns 2, 3). With `key_range`,
    mask_ref is the tile's last visible keys `[ROW_TILE, 1]` (`key_range_operands`) and meta's
    last column the row's pad: key s is live iff pad <= s <= last_c, built per block (rotated:
    slot j holds key j + pad, live iff j <= last_c - pad)."""
    *window, o_ref = rest
    if window:
        b, h, t = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        K = window[0].shape[1]
        rows = t * ROW_TILE + jax.lax.broadcasted_iota(jnp.int32, (ROW_TILE, K), 0)
        tile = (b, pl.ds(t * ROW_TILE, ROW_TILE), pl.ds(h * K, K))
        q = pltriton.load(q_ref.at[tile], mask=rows < q_ref.shape[1], other=0)
    else:
        q = q_ref[...]
    R, K = q.shape
    if smem:  # Mosaic TPU: the whole [B, T, 2 or 3] table in scalar memory
        b, t = pl.program_id(0), pl.program_id(2)
        offset, n = (None if rotated else meta_ref[b, t, 0]), meta_ref[b, t, 1]
        pad = meta_ref[b, t, 2] if key_range else None
    else:
        offset, n = meta_ref[0], meta_ref[1]
        pad = meta_ref[meta_ref.shape[0] - 1] if key_range else None
    q = fence(interpret, q)
    if window:  # the cache row, the window's start and the kv head's columns
        cache_at = (meta_ref[2], meta_ref[3], pl.multiple_of(jax.lax.div(h, rep) * K, K))

    def step(z, carry):
        if rotated:  # aligned: the caller rotated the row so that its first live key is 0
            start = pl.multiple_of(z * K_BLOCK, K_BLOCK)
        else:  # the row where it lies: blocks start at its first live key
            start = offset + z * K_BLOCK
        if window:
            k, v = _cached_block((k_ref, v_ref, *window), *cache_at, start, q.dtype)
        else:
            k = k_ref[pl.ds(start, K_BLOCK), :]
            v = v_ref[pl.ds(start, K_BLOCK), :]
        if key_range:
            pos = start + jax.lax.broadcasted_iota(jnp.int32, (R, K_BLOCK), 1)
            last = mask_ref[...]
            live = pos <= last - pad if rotated else (pos >= pad) & (pos <= last)
        else:
            live = mask_ref[:, pl.ds(start, K_BLOCK)] != 0
        k, v, live = fence(interpret, k, v, live)
        return online_step(q, k, v, live, carry, scale, precision)

    out = fence(interpret, online_out(jax.lax.fori_loop(0, n, step, online_init(R, K)),
                                      o_ref.dtype))
    if window:
        pltriton.store(o_ref.at[tile], out, mask=rows < o_ref.shape[1])
    else:
        o_ref[...] = out


def _call(meta, q, k, v, mask, *window, H, J, scale, precision, rotated, interpret, backend,
          key_range=False):
    B, T = meta.shape[:2]
    K = q.shape[2] // H
    rep = H // J
    smem = backend == "tpu" and not interpret
    meta_spec = (pl.BlockSpec(memory_space=pltpu.SMEM) if smem
                 else pl.BlockSpec((None, None, meta.shape[2]), lambda b, h, t: (b, t, 0)))
    if window:  # the caches whole (read at the row meta[2] in the kernel), the windows by row
        kv_spec = pl.BlockSpec(k.shape, lambda b, h, t: (0, 0, 0))
        win_spec = pl.BlockSpec((None, window[0].shape[1], K),
                                lambda b, h, t: (b, 0, jax.lax.div(h, rep)))
    else:
        kv_spec = pl.BlockSpec((None, k.shape[1], K), lambda b, h, t: (b, 0, jax.lax.div(h, rep)))
    tile_spec = (pl.BlockSpec(q.shape, lambda b, h, t: (0, 0, 0)) if window else
                 pl.BlockSpec((None, ROW_TILE, K), lambda b, h, t: (b, t, h)))
    return pl.pallas_call(
        functools.partial(_kernel, scale=scale, precision=precision, smem=smem,
                          rotated=rotated, interpret=interpret, rep=rep, key_range=key_range),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(B, H, T),
        in_specs=[meta_spec, tile_spec, kv_spec, kv_spec,
                  pl.BlockSpec((ROW_TILE, 1), lambda b, h, t: (t, 0)) if key_range else
                  pl.BlockSpec((None, ROW_TILE, mask.shape[2]), lambda b, h, t: (b, t, 0)),
                  *(win_spec for _ in window)],
        out_specs=tile_spec,
        interpret=interpret,
        # one pipeline stage: fp32 blocks of three stages overflow an H100's shared memory
        compiler_params=compiler_params(backend, interpret, gpu=dict(num_stages=1),
                                        dimension_semantics=(
            "parallel", "parallel", "parallel")),
        name="looprl_flash_attention",
    )(meta, q, k, v, mask, *window)


def block_table(mask_BxCpxS):
    """int32 `[B, T, 2]`: per row b and query tile t, the row's first live key and the number of
    K_BLOCK blocks from it up to the tile's last live key (0 for a tile that sees none)."""
    B, Cp, S = mask_BxCpxS.shape
    slots = jnp.arange(1, S + 1, dtype=jnp.int32)
    row_any = jnp.any(mask_BxCpxS, axis=1)
    offset_B = jnp.argmax(row_any, axis=-1).astype(jnp.int32)
    tiles = mask_BxCpxS.reshape(B, Cp // ROW_TILE, ROW_TILE, S)
    end_BxT = jnp.max(jnp.where(jnp.any(tiles, axis=2), slots, 0), axis=-1)
    n = jnp.maximum(end_BxT - offset_B[:, None] + K_BLOCK - 1, 0) // K_BLOCK
    return jnp.stack([jnp.broadcast_to(offset_B[:, None], n.shape), n], axis=-1)


def padded_keys(S: int) -> int:
    """The kernels' key axis for S keys: S rounded up to K_BLOCK, then one more block (no
    block read passes the end)."""
    return -(-S // K_BLOCK) * K_BLOCK + K_BLOCK


def mask_operands(mask_BxCxS):
    """The int32 mask `[B, Cp, padded_keys(S)]` (queries padded to ROW_TILE) and the block
    table."""
    mask = pad_to_multiple(pad_to_multiple(mask_BxCxS, 1, ROW_TILE), 2, K_BLOCK)
    meta = block_table(mask)
    return jnp.pad(mask, [(0, 0), (0, 0), (0, K_BLOCK)]).astype(jnp.int32), meta


def check_heads(H: int, J: int, name: str) -> None:
    """Raises ValueError naming `name` when H query heads are not a multiple of J kv heads."""
    if H % J:
        raise ValueError(f"{name}: {H} query heads are not a multiple of {J} kv heads")


def flash_attention(q_BxHxCxK, k_BxSxJxK, v_BxSxJxK, mask_BxCxS, scale: float, backend: str,
                    precision=None):
    """Attention of C queries over S keys (module doc), compiled for `backend` (`gpu`, `tpu`)
    where the program is lowered for it and interpreted on the CPU (`pallas.target`).

    Args: q `[B, H, C, K]`; k, v `[B, S, J, K]` with J kv heads, H % J == 0, one dtype;
      mask bool `[B, C, S]`, True where query c may see key s, or a `KeyRange` of S keys
      (built per block in the kernel: no `[B, C, S]` mask made or read; the same bits);
      scale: the score factor; precision: the dots' (`Precision.HIGHEST` for fp32 on an
      accelerator).
    Returns `[B, H, C, K]` in q's dtype.
    Raises ValueError when H is not a multiple of J."""
    B, H, C, K = q_BxHxCxK.shape
    S, J = k_BxSxJxK.shape[1], k_BxSxJxK.shape[2]
    check_heads(H, J, "flash_attention")
    q = pad_to_multiple(jnp.swapaxes(q_BxHxCxK, 1, 2), 1, ROW_TILE)
    q = q.reshape(B, q.shape[1], H * K)
    Cp, Sp = q.shape[1], padded_keys(S)
    key_range = isinstance(mask_BxCxS, KeyRange)
    if key_range:  # the mask's index vectors: built per block in the kernel
        meta, mask = key_range_operands(mask_BxCxS, Cp)
    else:
        mask, meta = mask_operands(mask_BxCxS)

    # on a TPU each row is rotated so that its first live key is slot 0: every block load is
    # aligned (Mosaic TPU proves it, E2003 otherwise); the keys moved to the end are dead for
    # the row. Elsewhere the kernel reads each block at the row's offset, no rotation.
    rotated = backend == "tpu"
    if rotated:
        slot_BxSp = (jnp.arange(Sp, dtype=jnp.int32)[None, :] + meta[:, :1, 0]) % Sp
        if not key_range:
            mask = jnp.take_along_axis(mask, slot_BxSp[:, None, :], axis=2)

    def kv(x):
        x = jnp.pad(x, [(0, 0), (0, Sp - x.shape[1]), (0, 0), (0, 0)])
        if rotated:
            x = jnp.take_along_axis(x, slot_BxSp[:, :, None, None], axis=1)
        return x.reshape(B, Sp, J * K)

    out = lowered(lambda interpret: functools.partial(
        _call, H=H, J=J, scale=float(scale), precision=precision, rotated=rotated,
        interpret=interpret, backend=backend, key_range=key_range), backend, meta, q,
        kv(k_BxSxJxK), kv(v_BxSxJxK), mask)
    return jnp.swapaxes(out.reshape(B, Cp, H, K)[:, :C], 1, 2)


def key_range_table(keys: KeyRange, Cp: int):
    """`block_table` of `keys.mask()` padded to Cp queries, from the index vectors alone (no
    mask made): row b's first live key is pad_b where some query sees it (pad_b <= last, last
    = min(max_c layout_c, S - 1)), else 0; tile t ends at min(max over its queries of
    layout_c, S - 1) + 1 where pad_b is at most that, else 0. Also the layout indices padded
    with -1 (a padded query sees no key): int32 `[B, T, 2]` and `[Cp, 1]`."""
    C = keys.layout_C.shape[0]
    layout = jnp.pad(keys.layout_C.astype(jnp.int32), (0, Cp - C), constant_values=-1)
    last_T = jnp.minimum(jnp.max(layout.reshape(-1, ROW_TILE), axis=1), keys.S - 1)
    pad_B = keys.pad_B.astype(jnp.int32)
    offset_B = jnp.where(pad_B <= jnp.max(last_T), pad_B, 0)
    end_BxT = jnp.where(pad_B[:, None] <= last_T[None, :], last_T[None, :] + 1, 0)
    n = jnp.maximum(end_BxT - offset_B[:, None] + K_BLOCK - 1, 0) // K_BLOCK
    return jnp.stack([jnp.broadcast_to(offset_B[:, None], n.shape), n], axis=-1), layout[:, None]


def key_range_operands(keys: KeyRange, Cp: int):
    """The kernels' operands for a `KeyRange` over Cp padded queries: the block table with the
    row's pad as a third column, int32 `[B, T, 3]`, and each query's last visible key
    min(layout_c, S - 1), int32 `[Cp, 1]` (-1: a padded query sees no key)."""
    meta, layout = key_range_table(keys, Cp)
    pad = jnp.broadcast_to(keys.pad_B.astype(jnp.int32)[:, None, None], (*meta.shape[:2], 1))
    return jnp.concatenate([meta, pad], axis=-1), jnp.minimum(layout, keys.S - 1)


def flash_attention_cached(q_BxHxCxK, kv, mask, scale: float, backend: str, precision=None):
    """`flash_attention(q, *kv.slots(), mask, ...)` with K/V read from the cache in place: the
    same keys per block in the same order (the same bits), no slot copied. `kv`: a
    `operands.CachedKV` (cache `[N, B', S, J, K]`, window `[M, C, J, K]`). The kernel gets the
    caches as `[N*B', S, J*K]` (a reshape, whole), row m's cache row `slot*B' + rows_M[m]` and
    the window start (clamped to [0, S - C], as `slots()` writes it) in its block table, and
    the windows cast to the cache's dtype. A `KeyRange` mask is built in the kernel from its
    index vectors (`key_range_table`; no `[M, C, S]` mask made). Where the window is the
    whole slot (C = S, a prefill) it is `flash_attention` over the window. GPU (Triton, and
    interpreted `pallas-gpu`) only: `backend` "gpu".

    Args: q `[M, H, C, K]`; mask bool `[M, C, S]` or a `KeyRange`; as `flash_attention`
      otherwise.
    Returns `[M, H, C, K]` in q's dtype. Raises ValueError when H is not a multiple of J or
    for another backend."""
    if backend != "gpu":
        raise ValueError(f"flash_attention_cached: backend {backend!r}: the in-place read is "
                         "the GPU's (a TPU reads the slot copy, kv.slots())")
    N, Bc, S, J, K = kv.k_NxBxSxJxK.shape
    M, H, C, _ = q_BxHxCxK.shape
    check_heads(H, J, "flash_attention_cached")
    dtype = kv.k_NxBxSxJxK.dtype
    wins = [w.astype(dtype) for w in (kv.k_win_MxCxJxK, kv.v_win_MxCxJxK)]
    key_range = isinstance(mask, KeyRange)
    if C == S:  # the window is the whole slot
        return flash_attention(q_BxHxCxK, *(w.astype(q_BxHxCxK.dtype) for w in wins),
                               mask.mask() if key_range else mask, scale, backend, precision)
    q = jnp.swapaxes(q_BxHxCxK, 1, 2).reshape(M, C, H * K)  # unpadded: rows masked in-kernel
    if key_range:
        meta, mask = key_range_operands(mask, -(-C // ROW_TILE) * ROW_TILE)
        meta, pad = meta[..., :2], meta[..., 2:]
    else:
        mask, meta = mask_operands(mask)
        pad = jnp.zeros((*meta.shape[:2], 0), jnp.int32)
    row_M = jnp.asarray(kv.slot, jnp.int32) * Bc + jnp.asarray(kv.rows_M, jnp.int32)
    w0 = jnp.clip(jnp.asarray(kv.w0, jnp.int32), 0, S - C)
    extra = jnp.stack(jnp.broadcast_arrays(row_M, w0), axis=-1)[:, None, :]
    meta = jnp.concatenate([meta, jnp.broadcast_to(extra, (*meta.shape[:2], 2)), pad], axis=-1)
    caches = [c.reshape(N * Bc, S, J * K) for c in (kv.k_NxBxSxJxK, kv.v_NxBxSxJxK)]
    out = lowered(lambda interpret: functools.partial(
        _call, H=H, J=J, scale=float(scale), precision=precision, rotated=False,
        interpret=interpret, backend=backend, key_range=key_range), backend, meta, q, *caches,
        mask, *(w.reshape(M, C, J * K) for w in wins))
    return jnp.swapaxes(out.reshape(M, C, H, K), 1, 2)
