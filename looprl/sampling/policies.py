"""KV policies for early-exited positions (DESIGN.md §3).

`dense`: every position computes all T loops at its own step; exit only picks the logits.
`deferred`: a position stops at its exit loop k; its loops k+1..T run later, when a later
  position of that row first needs that loop's KV, grouped with it in one chunk. After step p the
  loops computed per position are a suffix maximum of exit loops, so the pending positions of a
  row are a contiguous suffix and a window of C = max_pending + 1 positions ending at the current
  one covers them. Before each step, a row with max_pending or more positions pending is
  *flushed*: its current position runs every loop (catching all pending positions up to T). The
  flush is recorded in the schedule (`flush_BxS`). With max_pending 0 (the automatic bound from
  16 rows per device, `auto_max_pending`) every row is flushed at every step: dense's execution.
`copy`: loops k+1..T never run; a query at loop d reads this position's K/V from loop min(d, k)
  (vime's LAST_EXITED layout): after the step the position's loop-k K/V is copied into its slots
  k+1..T. Not equal to dense math (an approximation); the learner reproduces it exactly.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from looprl.errors import SamplingError

KV_POLICIES = ("dense", "deferred", "copy")


def check_policy(name: str) -> str:
    if name not in KV_POLICIES:
        raise SamplingError(f"unknown kv_policy {name!r}; expected one of {list(KV_POLICIES)}")
    return name


AUTO_DENSE_ROWS = 16  # rows per device from which the automatic pending bound is 0


def auto_max_pending(local_rows: int) -> int:
    """The default pending bound for `local_rows` rows per device: 64 // rows - 1, clamped to
    [7, 63] (63 at batch 1, 15 at 4 rows, 7 at 8 rows), and 0 from AUTO_DENSE_ROWS (16) rows on:
    no position is left pending, every row is flushed at every step, which is dense's
    execution, recorded as deferred's (a flush per position).

    Why 0 there (issue 18: deferred must never cost more than dense): postponing a loop pays
    when a step costs about what its overhead costs, whatever its rows (a small batch, or a
    weight-bound accelerator); on a compute-bound device it runs dense's work in more, smaller
    passes. Decode speed of `deferred` over `dense` on a 2-core AVX-512 CPU (2026-12-04,
    benchmarks/rollout.py's models, 32 new tokens, 5 interleaved rounds; this rule's windows
    below 16 rows): one layer of Ouro-1.4B width, q = 0.5, 16 new tokens: 0.83 at 4 rows, 0.51
    at 16, 0.69 at 32 (window 1 or 4: no better above 4 rows); the main job's model (hidden 64,
    one layer), q = 0.5: 1.18 at 4 rows, 1.08 at 8, 1.01 at 16, 0.88 / 0.77 / 0.77 / 0.92 at
    32 / 64 / 128 / 256 (window 1 or 4: no better). The one model that gains at any batch is
    the `tiny` preset (hidden 128, two layers, q = 0.9): 1.2-1.4x up to 128 rows, which it
    loses under this rule (set `deferred_max_pending` to keep it). Below 16 rows the windows
    stay, and there the rule does not keep deferred within dense's cost at every width: at
    1.4B width 4 rows run at 0.83 of dense (a window of 4: 1.005), while the main job's model
    and `tiny` gain 1.08-2.1x at 4-8 rows. The rule is a CPU
    measurement, so measure an accelerator's own before relying on it
    (`benchmarks/deferred_window.py` repeats it side by side).

    A flush runs the remaining loops for the whole window, `rows x (max_pending + 1)` chunk
    rows. While that is small, a chunk costs little more than one position (the per-step work
    dominates), so a wide window makes flushes rare at almost no cost; once rows x window is
    large, chunk cost grows with it and a wider window only delays the same work. Measured on
    the tiny preset (benchmarks/rollout.py, 2026-11-30): at batch 1 and 128 new tokens a window
    of 64 decoded at 3.71x `dense` against 3.33x for 16; at batch 16 (64 new tokens), windows 8
    and 16 were equal and 4 or 32 slower."""
    if local_rows >= AUTO_DENSE_ROWS:
        return 0
    return int(min(63, max(7, 64 // max(local_rows, 1) - 1)))


def row_menu(local_rows: int) -> tuple[int, ...]:
    """Sub-batch sizes of row compaction (issue 18) for `local_rows` rows per device: 16, 24,
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


def window_widths(chunk: int, local_rows: int) -> tuple[int, ...]:
    """Widths of a deferred decode loop's passes under row compaction, for a chunk of `chunk`
    positions and `local_rows` rows per device: 1 (the current position alone), then 2, 4,
    8, ... below `chunk`, then `chunk` (the whole window); `(1, chunk)` up to 16 rows, where
    `row_menu` keeps one size for the same reason; `(1,)` for a chunk of one (dense, copy).

    At loop d a row's positions still needing loop d are a suffix of its window ending at the
    current position (the loops computed per position are a suffix maximum of exit loops,
    module doc), of some length n; the row runs in the pass of the smallest width >= n, on the
    positions [p - width + 1, p] (`sampler._block_pass`). A row with one pending position then
    computes 2 positions, not the whole window: with the widths `(1, chunk)` alone (format
    version 2, before 2026-12-03) a deferred decode ran 1.31x dense's matmul rows at the main
    job's 256 rows (`benchmarks/rollout.py`), most of them masked, and was 0.85x as fast as
    dense. Each width is up to two more copies of the layer stack in the decode program
    (`window_block_rows`), hence powers of two, not every width, and small batches, whose
    steps cost little more than their overhead, keep the two widths."""
    if chunk <= 1:
        return (1,)
    if local_rows <= 16:
        return (1, chunk)
    widths, w = [1], 2
    while w < chunk:
        widths.append(w)
        w *= 2
    return (*widths, chunk)


def window_block_rows(width: int) -> tuple[int, int]:
    """Rows per block of a deferred window pass of `width` positions (`sampler._block_pass`):
    (full blocks, tail blocks) = (64 // width, 16 // width) rows, at least 1: full blocks of 64
    positions give the matmuls rows enough for the kernels' packed path, and the rows left
    over run in blocks of 16 positions, so a pass computes at most 15 filler positions."""
    return max(1, 64 // width), max(1, 16 // width)


def chunk_size(policy: str, max_pending: int) -> int:
    """Positions per decode chunk: the current one plus (for deferred) the pending window."""
    return max_pending + 1 if policy == "deferred" else 1


def pending_count(depth_BxS, p, prompt_len: int, T: int):
    """Completion positions before p whose KV is not computed for every loop, `[B]` int32."""
    idx = jnp.arange(depth_BxS.shape[1])
    live = (idx >= prompt_len) & (idx < p)
    return jnp.sum(live[None] & (depth_BxS < T), axis=1, dtype=jnp.int32)


def copy_fill(cache_TxLxBxSxHxK, p, exit_loop_B, rows_B):
    """`copy` policy: for rows `rows_B`, write position p's loop-k K/V into its slots k+1..T."""
    col = jax.lax.dynamic_index_in_dim(cache_TxLxBxSxHxK, p, axis=3, keepdims=False)  # T,L,B,H,K
    T = col.shape[0]
    src = jnp.take_along_axis(col, (jnp.maximum(exit_loop_B, 1) - 1)[None, None, :, None, None],
                              axis=0)  # 1,L,B,H,K
    t = jnp.arange(1, T + 1)[:, None, None, None, None]
    take = (t > exit_loop_B[None, None, :, None, None]) & rows_B[None, None, :, None, None]
    col = jnp.where(take, src, col)
    return jax.lax.dynamic_update_index_in_dim(cache_TxLxBxSxHxK, col, p, axis=3)


def kv_cache_bytes(cfg, rows: int, seq_len: int, compute_dtype) -> int:
    """Bytes of the sampler's KV cache for `rows` rows of `seq_len` positions: keys and values,
    `[T, L, B, S, Hkv, K]` each in the compute dtype (every loop keeps its own cache, DESIGN.md
    §3; the memory budgets of issue 19 are stated on top of it)."""
    per = (cfg.total_ut_steps * cfg.num_layers * rows * seq_len * cfg.num_kv_heads *
           cfg.head_dim)
    return 2 * per * jnp.dtype(compute_dtype).itemsize
