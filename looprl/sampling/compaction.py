"""Row compaction: each loop of a decode step runs only the rows that need it (docs/DESIGN.md §3).

A chunk's loop d runs in one of three passes, all on the row-invariant kernels of
`looprl.kernels`, so a row's bits are those it gets in the full batch:
- `loop_pass`: every row (the prefill; compaction off);
- `compact_pass`: the rows that need the loop, gathered into a sub-batch of a `row_menu` size;
- `block_pass`: a deferred window wider than one position, in blocks of `window_block_rows`.
`record_rows` writes the rows each pass ran into `DecodeState.loop_rows_1xSxTxW`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from looprl.errors import SamplingError
from looprl.model.layers import stack_pass
from looprl.sampling.state import DecodeState, RowInfo, Static


def row_menu(local_rows: int) -> tuple[int, ...]:
    """Sub-batch sizes of row compaction for `local_rows` rows per device: 16, 24,
    32, 48, 64, 96, ... (2^k and 3 * 2^(k-1)) below `local_rows`, then `local_rows` itself;
    `(local_rows,)` up to 16 rows.

    A loop runs n rows as the smallest size >= n, so it does at most 1.5x the rows it needs
    (and 16 rows at the least); a loop no row needs runs nothing. The sizes bound the compiled
    shapes (9 at 256 rows; every size is one more copy of the loop in the decode program).
    Below 16 rows a smaller sub-batch saves less than its gather and its compile time cost, so
    small batches keep one size: the whole batch, in place. All sizes from 16 on are multiples
    of the kernels' row quantum on AVX-512 (`looprl.kernels.ROW_QUANTUM` = 8); where it is
    24 the kernels pad a sub-batch up to a multiple of 24 rows (the same bits, some waste)."""
    n = max(int(local_rows), 1)
    sizes = {n}
    k = 16
    while k < n:
        sizes.add(k)
        if k * 3 // 2 < n:
            sizes.add(k * 3 // 2)
        k *= 2
    return tuple(sorted(sizes))


def window_block_rows(width: int) -> tuple[int, int]:
    """Rows per block of a deferred window pass of `width` positions (`block_pass`):
    (full blocks, tail blocks) = (64 // width, 16 // width) rows, at least 1: full blocks of 64
    positions give the matmuls rows enough for the kernels' packed path, and the rows left
    over run in blocks of 16 positions, so a pass computes at most 15 filler positions."""
    return max(1, 64 // width), max(1, 16 // width)


def _window_pass(st: Static, w, d, w0, C: int, h_win, positions, pad_B, k_cache, v_cache,
                 active_BxC, depth_win, rows_M=None, cache_loop=None):
    """Loop d over the chunk [w0, w0 + C) for the rows given (all, or a gathered sub-batch:
    batch rows `rows_M` of the cache): positions in `active_BxC` compute their loop-d KV and
    hidden state, the others keep theirs. `k_cache`/`v_cache`: the whole cache `[T, L, B, S,
    Hkv, K]`, read in place at loop d (or at `cache_loop`, 0-based, for a cache holding other
    loops) and rows `rows_M` (`layers.stack_pass`'s `loop`).
    Returns the chunk's windows: (k, v `[L, rows, C, Hkv, K]`, h `[rows, C, D]`, depth)."""
    h_new, k_m, v_m = stack_pass(st.cfg, w, h_win, positions, w0 + jnp.arange(C), pad_B,
                                 k_cache, v_cache, active_BxC, w0, st.scfg.kernels == "stock",
                                 bits=True, loop=d - 1 if cache_loop is None else cache_loop,
                                 rows_B=rows_M)
    return (k_m, v_m, jnp.where(active_BxC[..., None], h_new, h_win),
            jnp.where(active_BxC, d, depth_win))


def _chunk_windows(s: DecodeState, positions_BxS, d, w0, C: int):
    """The chunk's windows of the state: h, depth and positions."""
    return (jax.lax.dynamic_slice_in_dim(s.h_BxSxD, w0, C, axis=1),
            jax.lax.dynamic_slice_in_dim(s.depth_BxS, w0, C, axis=1),
            jax.lax.dynamic_slice_in_dim(positions_BxS, w0, C, axis=1))


def _put_windows(s: DecodeState, d, w0, k_w, v_w, h_w, depth_w) -> DecodeState:
    """Write the chunk's windows back: loop d's KV slots at [w0, w0 + C), h and depth."""
    put = lambda cache, win: jax.lax.dynamic_update_slice(  # noqa: E731
        cache, win[None].astype(cache.dtype), (d - 1, 0, 0, w0, 0, 0))
    return s._replace(k_cache=put(s.k_cache, k_w), v_cache=put(s.v_cache, v_w),
                      h_BxSxD=jax.lax.dynamic_update_slice_in_dim(s.h_BxSxD, h_w, w0, 1),
                      depth_BxS=jax.lax.dynamic_update_slice_in_dim(s.depth_BxS, depth_w, w0,
                                                                    1))


def loop_pass(st: Static, w, s: DecodeState, rows: RowInfo, positions_BxS, d, w0, C: int,
              active_BxC):
    """Loop d for every row over the chunk [w0, w0 + C) (the prefill; compaction off)."""
    h_win, depth_win, positions = _chunk_windows(s, positions_BxS, d, w0, C)
    return _put_windows(s, d, w0, *_window_pass(st, w, d, w0, C, h_win, positions, rows.pad_B,
                                                s.k_cache, s.v_cache, active_BxC, depth_win))


def compact_pass(st: Static, w, s: DecodeState, rows: RowInfo, positions_BxS, d, w0, C: int,
                 active_BxC, run_B):
    """Loop d over the chunk [w0, w0 + C) for the rows `run_B` only.

    The n = sum(run_B) rows are gathered, in row order, into a sub-batch of M rows, M the
    smallest size of `st.row_menu` >= n (the menu bounds the compiled shapes; n = 0 runs
    nothing); the M - n filler rows compute nothing (no active position) and are dropped on the
    way back. M = B runs the rows in place, without the gather. Only the chunk's window of the
    loop-d KV slots, hidden states and depths is scattered back. The kernels are row-invariant
    (`looprl.kernels`), so a row's bits are those it gets in the full batch.
    Returns (state, M), M an int32 scalar."""
    B = run_B.shape[0]
    if st.row_menu[-1] != B:  # every count n <= B must have a size: the menu ends at B
        raise SamplingError(f"row menu {st.row_menu} does not end at the {B} rows per device")
    n = jnp.sum(run_B, dtype=jnp.int32)
    which = jnp.where(n > 0, 1 + jnp.searchsorted(jnp.asarray(st.row_menu, jnp.int32), n,
                                                  method="compare_all"), 0)
    order = _running_first(run_B)
    h_win, depth_win, positions = _chunk_windows(s, positions_BxS, d, w0, C)
    k_win, v_win = (jax.lax.dynamic_slice(c, (d - 1, 0, 0, w0, 0, 0), (1, *c.shape[1:3], C,
                                                                       *c.shape[4:]))[0]
                    for c in (s.k_cache, s.v_cache))  # L, B, C, Hkv, K

    def whole_batch(_):  # M = B: every row in place (rows not in run_B have nothing active)
        return _window_pass(st, w, d, w0, C, h_win, positions, rows.pad_B, s.k_cache,
                            s.v_cache, active_BxC, depth_win)

    def run(M):
        if M == B:
            return whole_batch

        def branch(_):
            idx = order[:M]
            back = jnp.where(jnp.arange(M) < n, idx, B)  # filler rows: dropped (index B)
            act = active_BxC[idx] & (jnp.arange(M) < n)[:, None]
            k_m, v_m, h_m, depth_m = _window_pass(st, w, d, w0, C, h_win[idx], positions[idx],
                                                  rows.pad_B[idx], s.k_cache, s.v_cache, act,
                                                  depth_win[idx], rows_M=idx)
            return (k_win.at[:, back].set(k_m, mode="drop"),
                    v_win.at[:, back].set(v_m, mode="drop"),
                    h_win.at[back].set(h_m, mode="drop"),
                    depth_win.at[back].set(depth_m, mode="drop"))
        return branch

    # (the whole caches never leave the switch: XLA CPU copies an operand a branch updates)
    branches = [lambda _: (k_win, v_win, h_win, depth_win)] + [run(M) for M in st.row_menu]
    s = _put_windows(s, d, w0, *jax.lax.switch(which, branches, None))
    return s, jnp.asarray((0,) + st.row_menu, jnp.int32)[which]


def _running_first(run_B):
    """Row indices `[B]` int32: the rows of `run_B` first, in row order, then row 0 (filler)."""
    B = run_B.shape[0]
    return jnp.zeros((B,), jnp.int32).at[jnp.where(run_B, jnp.cumsum(run_B) - 1, B)].set(
        jnp.arange(B, dtype=jnp.int32), mode="drop")


def block_pass(st: Static, w, s: DecodeState, rows: RowInfo, positions_BxS, d, w0, C: int,
                active_BxC, run_B):
    """Loop d over the window [w0, w0 + C) for the rows `run_B` only, in blocks of
    R = `window_block_rows(C)` rows (a deferred window pass, C > 1).

    The n = sum(run_B) rows are taken R at a time, in row order, by a loop of ceil(n / R)
    blocks (none when n = 0); a block gathers its rows' inputs (the last block's filler rows
    compute nothing and are dropped) and scatters their windows of the loop-d KV slots, hidden
    states and depths straight into the state, in place (a `lax.switch` over sub-batch sizes,
    as the width-1 pass uses, would return the windows of all B rows: XLA CPU copies an operand
    a branch updates, so the caches cannot pass through one). One block shape per width, so
    one copy of the layer stack. A block gathers its rows' KV slots of loop d (R rows, not the
    cache) for its attention rather than reading the cache in place as the other passes do:
    reading the cache in place from inside this loop, which also updates it, slows the
    deferred decode several times over (`benchmarks/rollout.py` measures the decode).
    Returns (state, rows run: blocks x R, int32)."""
    B = run_B.shape[0]
    R, R_tail = (min(r, B) for r in window_block_rows(C))
    n = jnp.sum(run_B, dtype=jnp.int32)
    order = jnp.concatenate([_running_first(run_B), jnp.zeros((R,), jnp.int32)])
    cols = (w0 + jnp.arange(C))[None, :]
    if R_tail < R:  # blocks of R rows, then blocks of R_tail rows for the rest
        n_full = n // R
        n_tail = (n - n_full * R + R_tail - 1) // R_tail
    else:  # (R = R_tail: a batch of at most 16 // C rows) one loop of blocks
        n_full, n_tail = (n + R - 1) // R, jnp.int32(0)

    def block(start, R, arrays):
        k_cache, v_cache, h, depth = arrays
        idx = jax.lax.dynamic_slice_in_dim(order, start, R)
        ok = start + jnp.arange(R) < n
        back = jnp.where(ok, idx, B)[:, None]  # filler rows: dropped (index B)
        rws = idx[:, None]
        # the block's rows of the loop's slots, gathered: `[1, L, R, S, J, K]` (docstring)
        k_slots, v_slots = (jax.lax.dynamic_index_in_dim(c, d - 1, 0)[:, :, idx]
                            for c in (k_cache, v_cache))
        k_m, v_m, h_m, depth_m = _window_pass(
            st, w, d, w0, C, h[rws, cols], positions_BxS[rws, cols], rows.pad_B[idx], k_slots,
            v_slots, active_BxC[idx] & ok[:, None], depth[rws, cols], cache_loop=0)
        put = lambda c, win: c.at[d - 1, :, back, cols].set(  # noqa: E731  win [L, R, C, J, K]
            jnp.moveaxis(win, 0, 2).astype(c.dtype), mode="drop")
        return (put(k_cache, k_m), put(v_cache, v_m), h.at[back, cols].set(h_m, mode="drop"),
                depth.at[back, cols].set(depth_m, mode="drop"))

    arrays = jax.lax.fori_loop(0, n_full, lambda j, a: block(j * R, R, a),
                               (s.k_cache, s.v_cache, s.h_BxSxD, s.depth_BxS))
    if R_tail < R:
        arrays = jax.lax.fori_loop(0, n_tail, lambda j, a: block(n_full * R + j * R_tail,
                                                                 R_tail, a), arrays)
    k_cache, v_cache, h, depth = arrays
    s = s._replace(k_cache=k_cache, v_cache=v_cache, h_BxSxD=h, depth_BxS=depth)
    return s, n_full * R + n_tail * R_tail


def record_rows(s: DecodeState, p, d, rows_m, pass_index: int) -> DecodeState:
    """Write the rows `rows_m` that loop d's pass `pass_index` (the index into
    `Static.window_widths`: 0 the current position alone) ran at decode position p into
    `loop_rows_1xSxTxW`."""
    return s._replace(loop_rows_1xSxTxW=s.loop_rows_1xSxTxW.at[0, p, d - 1, pass_index].set(
        rows_m))
