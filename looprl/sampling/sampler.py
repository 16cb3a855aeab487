"""The rollout engine: jitted prefill + decode with per-token early exit and a (loop, layer) KV
cache, recording the schedule (DESIGN.md §3). One concept, kept in one file: the decode loop, its
forced re-run (the same program) and its per-device form share their state and helpers.

Layout: B = prompts x G rows, left-padded to the longest prompt rounded up to a multiple of
`prompt_len_multiple` (P; the compiled shapes depend on P, so a multiple > 1 lets batches of
different prompts share one compilation); the cache holds S = P + max_new_tokens positions for
each of the T x L (loop, layer) slots: `[T, L, B, S, Hkv, K]`.
Prefill runs every prompt position through all T loops as one chunk; each decode step runs the
current position (plus, under `deferred`, the pending window) loop by loop in a
`lax.while_loop` that stops as soon as every row of the batch is done with the step, so early
exit saves sequential depth; and each loop runs only the rows that still need it (row
compaction, issue 18: a sub-batch whose size comes from `policies.row_menu`; under `deferred`
each row runs only the narrowest window of `policies.window_widths` holding its positions that
need the loop, in blocks of rows; recorded in `RolloutBatch.loop_rows`), so early exit saves
work at RL batch sizes too. All matmuls and attention use the batch-invariant kernels of
`looprl.kernels`, so a row's numbers do not depend on the chunk or batch it ran in.

`forced` mode re-runs a recorded rollout (its tokens, exit loops and flushes) at other parameters:
the sampler "in forced mode" of the reproducibility matrix.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as PS

from looprl.config.sections import KERNELS
from looprl.distributed import mesh as ml
from looprl.distributed.mesh import ROW_AXES, mesh_record
from looprl.errors import SamplingError
from looprl.model.config import OuroConfig
from looprl.kernels import kernel_version, row_tile
from looprl.model.layers import stack_pass
from looprl.model.looped import (Layout, cast_weights, embed, exit_lambda, exit_state_init,
                                 exit_state_update, lm_logits, q_exit_decision)
from looprl.sampling import policies
from looprl.sampling.processing import (NOISE_KEYING, NOISE_KEYINGS, noise_position,
                                        process_logits, row_keys, sample_tokens)
from looprl.sampling.schedule import RolloutBatch, Schedule, params_fingerprint


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How to sample. `exit_threshold` is q of the Q-exit rule (q = 1.0: always loop T);
    `fixed_depth` (1..T) overrides it. RL rollouts are untruncated by default (top_k 0 = off,
    top_p 1.0 = off) so that the recorded log-prob is the behaviour probability."""
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    exit_threshold: float = 1.0
    fixed_depth: int | None = None
    kv_policy: str = "dense"
    deferred_max_pending: int | None = None  # None: policies.auto_max_pending(rows per device)
    stop_ids: tuple[int, ...] = (2,)
    compute_dtype: str = "float32"
    max_seq_len: int | None = None  # cache length S; default P + max_new_tokens
    kernels: str = "invariant"  # "invariant" (row-tiled, replayable by the learner's dense pass)
    #                             or "stock" (plain matmuls: faster at small batch; its bits are
    #                             reproduced only by re-running the sampler in forced mode)
    prompt_len_multiple: int = 1    # P = the longest prompt rounded up to a multiple of this
    noise_keying: str = NOISE_KEYING  # "completion" (token index in its completion) or "layout"
    #                                   (padded position; runs and rollouts before 2026-12-01)
    row_compaction: bool = True  # each decode loop runs only the rows that need it, gathered
    #                              into a sub-batch of a size from `policies.row_menu` or, for a
    #                              deferred window, in blocks of rows (issue 18)

    @classmethod
    def from_rollout_config(cls, rollout, compute_dtype: str, *, greedy: bool = False,
                            stop_ids: tuple[int, ...] = (2,), **overrides) -> "SamplingConfig":
        """The sampler settings of an experiment's `rollout` section (`looprl.config.
        RolloutConfig`) at the model's `compute_dtype`: the one mapping from the experiment
        config (the trainer's rollouts, the run's evaluations, what checkpoints record).
        `greedy`: temperature 0 and untruncated (the held-out evaluation). `overrides` replace
        fields (e.g. `exit_threshold=` for an evaluation at another q)."""
        kw = dict(max_new_tokens=rollout.max_new_tokens,
                  temperature=0.0 if greedy else rollout.temperature,
                  top_k=0 if greedy else rollout.top_k, top_p=1.0 if greedy else rollout.top_p,
                  exit_threshold=rollout.exit_threshold, fixed_depth=rollout.fixed_depth,
                  kv_policy=rollout.kv_policy, deferred_max_pending=rollout.deferred_max_pending,
                  stop_ids=tuple(stop_ids), compute_dtype=compute_dtype,
                  prompt_len_multiple=rollout.prompt_len_multiple, kernels=rollout.kernels,
                  noise_keying=rollout.noise_keying)
        return cls(**{**kw, **overrides})

    @classmethod
    def from_schedule(cls, schedule, **overrides) -> "SamplingConfig":
        """The settings a recorded rollout was sampled with, from its `Schedule`: what re-running
        it (forced mode) needs. The cache length is the recorded S (`max_seq_len`) and
        `max_new_tokens` = S - P; q is 1.0 when the schedule records a fixed depth instead.
        `prompt_len_multiple` is not recorded (the forced re-run takes the recorded layout)."""
        kw = dict(max_new_tokens=schedule.seq_len - schedule.prompt_len,
                  temperature=schedule.temperature, top_k=schedule.top_k, top_p=schedule.top_p,
                  exit_threshold=(1.0 if schedule.exit_threshold is None
                                  else schedule.exit_threshold),
                  fixed_depth=schedule.fixed_depth, kv_policy=schedule.kv_policy,
                  deferred_max_pending=schedule.deferred_max_pending,
                  stop_ids=tuple(schedule.stop_ids), compute_dtype=schedule.compute_dtype,
                  max_seq_len=schedule.seq_len, kernels=schedule.kernels,
                  noise_keying=schedule.noise_keying)
        return cls(**{**kw, **overrides})

    def validate(self, T: int) -> None:
        """Raises SamplingError naming the bad field."""
        policies.check_policy(self.kv_policy)
        if not (0.0 < self.exit_threshold <= 1.0):
            raise SamplingError(f"exit_threshold q must lie in (0, 1], got {self.exit_threshold}")
        if not (0.0 < self.top_p <= 1.0):
            raise SamplingError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SamplingError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 <= self.temperature < float("inf"):  # also rejects nan
            raise SamplingError(f"temperature must be finite and >= 0, got {self.temperature}")
        if self.max_new_tokens < 1:
            raise SamplingError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.fixed_depth is not None and not (1 <= self.fixed_depth <= T):
            raise SamplingError(f"fixed_depth must lie in 1..{T}, got {self.fixed_depth}")
        if self.deferred_max_pending is not None and self.deferred_max_pending < 0:
            raise SamplingError(f"deferred_max_pending must be >= 0 (or None: automatic), "
                                f"got {self.deferred_max_pending}")
        if self.kernels not in KERNELS:
            raise SamplingError(f"kernels must be one of {list(KERNELS)}, got {self.kernels!r}")
        if self.noise_keying not in NOISE_KEYINGS:
            raise SamplingError(f"noise_keying must be one of {list(NOISE_KEYINGS)}, got "
                                f"{self.noise_keying!r}")
        if self.prompt_len_multiple < 1:
            raise SamplingError(f"prompt_len_multiple must be >= 1, got {self.prompt_len_multiple}")
        if self.compute_dtype not in ("float32", "bfloat16"):
            raise SamplingError(f"compute_dtype must be float32 or bfloat16, "
                                f"got {self.compute_dtype!r}")


class DecodeState(NamedTuple):
    tokens_BxS: jax.Array
    h_BxSxD: jax.Array  # latest hidden state of each position (its h(depth))
    depth_BxS: jax.Array  # loops whose KV the position has computed
    k_cache: jax.Array  # [T, L, B, S, Hkv, K]
    v_cache: jax.Array
    exit_loop_BxS: jax.Array
    logprob_BxS: jax.Array
    logprob_processed_BxS: jax.Array
    flush_BxS: jax.Array
    done_B: jax.Array
    completion_len_B: jax.Array
    loop_rows_1xSxTxW: jax.Array  # rows run per (decode step, loop, pass): a menu size or a
    #                               window's blocks x their rows
    p: jax.Array  # next position to run (int32 scalar)


class RowInfo(NamedTuple):
    pad_B: jax.Array
    prompt_index_B: jax.Array
    sample_index_B: jax.Array
    forced_tokens_BxS: jax.Array | None
    forced_exit_BxS: jax.Array | None
    forced_flush_BxS: jax.Array | None


@dataclasses.dataclass(frozen=True)
class _Static:
    cfg: OuroConfig
    scfg: SamplingConfig
    P: int
    S: int
    seed: int
    forced: bool
    row_menu: tuple[int, ...] = ()  # sub-batch sizes of row compaction; () = off
    window_widths: tuple[int, ...] = (1,)  # widths of a decode loop's passes (policies.
    #                                        window_widths), with compaction


def _window_pass(st: _Static, w, d, w0, C: int, h_win, positions, pad_B, k_cache, v_cache,
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


def _loop_pass(st: _Static, w, s: DecodeState, rows: RowInfo, positions_BxS, d, w0, C: int,
               active_BxC):
    """Loop d for every row over the chunk [w0, w0 + C) (the prefill; compaction off)."""
    h_win, depth_win, positions = _chunk_windows(s, positions_BxS, d, w0, C)
    return _put_windows(s, d, w0, *_window_pass(st, w, d, w0, C, h_win, positions, rows.pad_B,
                                                s.k_cache, s.v_cache, active_BxC, depth_win))


def _compact_pass(st: _Static, w, s: DecodeState, rows: RowInfo, positions_BxS, d, w0, C: int,
                  active_BxC, run_B):
    """Loop d over the chunk [w0, w0 + C) for the rows `run_B` only (issue 18).

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


def _block_pass(st: _Static, w, s: DecodeState, rows: RowInfo, positions_BxS, d, w0, C: int,
                active_BxC, run_B):
    """Loop d over the window [w0, w0 + C) for the rows `run_B` only, in blocks of
    R = `policies.window_block_rows(C)` rows (issue 18; a deferred window pass, C > 1).

    The n = sum(run_B) rows are taken R at a time, in row order, by a loop of ceil(n / R)
    blocks (none when n = 0); a block gathers its rows' inputs (the last block's filler rows
    compute nothing and are dropped) and scatters their windows of the loop-d KV slots, hidden
    states and depths straight into the state, in place (a `lax.switch` over sub-batch sizes,
    as the width-1 pass uses, would return the windows of all B rows: XLA CPU copies an operand
    a branch updates, so the caches cannot pass through one). One block shape per width, so
    one copy of the layer stack. A block gathers its rows' KV slots of loop d (R rows, not the
    cache) for its attention rather than reading the cache in place as the other passes do:
    measured at 256 rows (2026-12-03, decode tokens/s, dense 20-24k), reading the cache in
    place from inside this loop, which also updates it, ran the deferred decode at 3.9k, and
    carrying only the windows while reading the unchanged cache at 10.6k (both as if XLA CPU
    copied the cache into the loop; not traced); the gather: 20.1k.
    Row-invariant kernels (`looprl.kernels`): a row's bits are those it gets in the full
    batch. Returns (state, rows run: blocks x R, int32)."""
    B = run_B.shape[0]
    R, R_tail = (min(r, B) for r in policies.window_block_rows(C))
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


def _record_rows(s: DecodeState, p, d, rows_m, pass_index: int) -> DecodeState:
    """Write the rows `rows_m` that loop d's pass `pass_index` (the index into
    `_Static.window_widths`: 0 the current position alone) ran at decode position p into
    `loop_rows_1xSxTxW`."""
    return s._replace(loop_rows_1xSxTxW=s.loop_rows_1xSxTxW.at[0, p, d - 1, pass_index].set(
        rows_m))


def _run_chunk(st: _Static, w, s: DecodeState, rows: RowInfo, step, *, w0, C: int, emit_p,
               eligible_C, force_full_B, running_B, peel_first_loop: bool = False,
               compact_rows: bool = False):
    """Run loops 1..(as needed) for the chunk [w0, w0+C), then emit from position `emit_p`.

    A chunk position is computed at loop d iff its row is running and it has computed exactly
    d - 1 loops. The emitting position's exit loop comes from the Q-exit rule (or fixed depth,
    or the forced schedule); rows in `force_full_B` keep looping to T after they exit.
    `peel_first_loop` runs loop 1 as a chunk of the emitting position alone: in a decode step
    every other chunk position has already computed loop 1 (deferred keeps only loops >= 2
    pending), so loop 1 costs what it costs under `dense`; the kernels are row-invariant, so
    the bits do not change. With `compact_rows` no peel is needed (nor compiled: it was a
    third copy of the layer stack in the deferred decode program): at loop 1 no row has a
    pending position needing it, so the loop's position-alone pass runs every running row and
    its window pass runs none, the peel's computation and its `loop_rows` record.
    `compact_rows` (decode steps, with `st.row_menu`): each loop runs only the rows still
    running, as a sub-batch (`_compact_pass`); under `deferred` each row runs the positions
    [emit_p - W + 1, emit_p], W the smallest of `st.window_widths` covering its positions that
    need the loop (W = 1, the current position alone, for a row with none pending), one pass
    per width. Row-invariant kernels again keep every bit.
    Returns the updated state (tokens, log-probs, exits written at emit_p / emit_p + 1).
    """
    cfg, scfg = st.cfg, st.scfg
    stock = scfg.kernels == "stock"
    T = cfg.total_ut_steps
    B = s.tokens_BxS.shape[0]
    q = scfg.exit_threshold
    compact = bool(st.row_menu) and compact_rows
    positions_BxS = Layout(rows.pad_B).positions(st.S)
    forced_exit_B = (jax.lax.dynamic_index_in_dim(rows.forced_exit_BxS, emit_p, 1, False)
                     if st.forced else None)

    def loop(c, w0, C, eligible_C):
        """One loop d over the chunk [w0, w0 + C) (C static)."""
        d, s, xs, exited, exit_loop, h_exit, running = c
        d = d + 1
        depth_win = jax.lax.dynamic_slice_in_dim(s.depth_BxS, w0, C, axis=1)
        active = running[:, None] & eligible_C[None, :] & (depth_win == d - 1)
        if not compact:
            s = _loop_pass(st, w, s, rows, positions_BxS, d, w0, C, active)
        elif C == 1:
            s, n = _compact_pass(st, w, s, rows, positions_BxS, d, w0, 1, active, running)
            s = _record_rows(s, emit_p, d, n, 0)
        else:  # each row in the pass of the narrowest window holding its active positions
            if st.window_widths[0] != 1 or st.window_widths[-1] != C:  # no row may go unrun
                raise SamplingError(f"window widths {st.window_widths} do not run from 1 to the "
                                    f"chunk of {C} positions")
            first_B = jnp.min(jnp.where(active, w0 + jnp.arange(C)[None, :], emit_p + 1), axis=1)
            need_B = emit_p + 1 - first_B  # 0: nothing to run; active is within [first, emit_p]
            widths = jnp.asarray(st.window_widths, jnp.int32)
            pass_B = jnp.searchsorted(widths, need_B, method="compare_all")
            for i, W in enumerate(st.window_widths):
                run_B = (need_B > 0) & (pass_B == i)
                wi0 = jnp.maximum(emit_p - W + 1, 0) if W > 1 else emit_p  # in [w0, emit_p]
                act = jax.lax.dynamic_slice_in_dim(active, wi0 - w0, W, axis=1)
                s, n = (_compact_pass if W == 1 else _block_pass)(
                    st, w, s, rows, positions_BxS, d, wi0, W, act & run_B[:, None], run_B)
                s = _record_rows(s, emit_p, d, n, i)
        h_cur = jax.lax.dynamic_index_in_dim(s.h_BxSxD, emit_p, 1, keepdims=True)  # B,1,D
        lam = exit_lambda(w, h_cur, stock)[:, 0]
        xs, _ = exit_state_update(xs, lam, d, T)
        if st.forced:
            decide = d == forced_exit_B
        elif scfg.fixed_depth is not None:
            decide = jnp.broadcast_to(d >= scfg.fixed_depth, (B,))
        else:
            decide = q_exit_decision(xs.cdf, d, T, q)
        new_exit = running & ~exited & decide
        h_exit = jnp.where(new_exit[:, None], h_cur[:, 0], h_exit)
        exit_loop = jnp.where(new_exit, d, exit_loop)
        exited = exited | new_exit
        running = running & (~exited | force_full_B) & (d < T)
        return d, s, xs, exited, exit_loop, h_exit, running

    def cond(c):
        return jnp.any(c[-1])

    D = cfg.hidden_size
    c = (jnp.int32(0), s, exit_state_init((B,)), jnp.zeros((B,), bool),
         jnp.zeros((B,), jnp.int32), jnp.zeros((B, D), w["embed_tokens"].dtype), running_B)
    if peel_first_loop and C > 1 and not compact:
        c = loop(c, emit_p, 1, jnp.ones((1,), bool))
    c = jax.lax.while_loop(cond, lambda c: loop(c, w0, C, eligible_C), c)
    _, s, _, exited, exit_loop, h_exit, _ = c

    # Emit token emit_p + 1 from the exit loop's logits.
    emitting = exited & ~s.done_B
    logits = lm_logits(w, h_exit[:, None], stock)[:, 0]
    full, processed = process_logits(logits, scfg.temperature, scfg.top_k, scfg.top_p, stock)
    if st.forced:
        token = jax.lax.dynamic_index_in_dim(rows.forced_tokens_BxS, emit_p + 1, 1, False)
    else:
        keys = row_keys(st.seed, step, rows.prompt_index_B, rows.sample_index_B,
                        noise_position(scfg.noise_keying, emit_p, st.P))
        token = sample_tokens(keys, processed, greedy=scfg.temperature == 0)
    lp = jnp.take_along_axis(full, token[:, None], axis=1)[:, 0]
    lpp = jnp.take_along_axis(processed, token[:, None], axis=1)[:, 0]
    token = jnp.where(emitting, token, 0)

    def put(arr, val, idx=emit_p):
        col = jax.lax.dynamic_index_in_dim(arr, idx, 1, False)
        return jax.lax.dynamic_update_index_in_dim(arr, jnp.where(emitting, val, col), idx, 1)

    stop = jnp.isin(token, jnp.asarray(scfg.stop_ids, jnp.int32))
    s = s._replace(
        tokens_BxS=put(s.tokens_BxS, token, emit_p + 1),
        exit_loop_BxS=put(s.exit_loop_BxS, exit_loop),
        logprob_BxS=put(s.logprob_BxS, lp),
        logprob_processed_BxS=put(s.logprob_processed_BxS, lpp),
        completion_len_B=s.completion_len_B + emitting.astype(jnp.int32),
        done_B=s.done_B | (emitting & stop),
    )
    if st.forced:  # a recorded rollout that ended by length stops where the recording stopped
        n_forced = jnp.sum(rows.forced_exit_BxS > 0, axis=1)
        s = s._replace(done_B=s.done_B | (s.completion_len_B >= n_forced))
    return s


@functools.partial(jax.jit, static_argnums=(0,))
def _prefill(st: _Static, params, tokens_BxS, rows: RowInfo, step):
    cfg = st.cfg
    w = cast_weights(params, st.scfg.compute_dtype)
    B = tokens_BxS.shape[0]
    T, L, Hkv, K = cfg.total_ut_steps, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    dt = w["embed_tokens"].dtype
    cache = jnp.zeros((T, L, B, st.S, Hkv, K), dt)
    s = DecodeState(
        tokens_BxS=tokens_BxS, h_BxSxD=embed(w, tokens_BxS), depth_BxS=jnp.zeros((B, st.S),
                                                                                 jnp.int32),
        k_cache=cache, v_cache=cache, exit_loop_BxS=jnp.zeros((B, st.S), jnp.int32),
        logprob_BxS=jnp.zeros((B, st.S), jnp.float32),
        logprob_processed_BxS=jnp.zeros((B, st.S), jnp.float32),
        flush_BxS=jnp.zeros((B, st.S), bool), done_B=jnp.zeros((B,), bool),
        completion_len_B=jnp.zeros((B,), jnp.int32),
        loop_rows_1xSxTxW=jnp.zeros((1, st.S, T, len(st.window_widths)), jnp.int32),
        p=jnp.int32(st.P))
    ones = jnp.ones((B,), bool)
    return _run_chunk(st, w, s, rows, step, w0=0, C=st.P, emit_p=st.P - 1,
                      eligible_C=jnp.ones((st.P,), bool), force_full_B=ones, running_B=ones)


@functools.partial(jax.jit, static_argnums=(0, 5), donate_argnums=(2,))
def _decode(st: _Static, params, s: DecodeState, rows: RowInfo, step, n_steps: int):
    """Run up to `n_steps` decode steps (fewer when every row is done or the cache is full)."""
    cfg, scfg = st.cfg, st.scfg
    T = cfg.total_ut_steps
    w = cast_weights(params, scfg.compute_dtype)
    C = min(policies.chunk_size(scfg.kv_policy, scfg.deferred_max_pending), st.S)

    def one_step(carry):
        s, i = carry
        p = s.p
        w0 = jnp.maximum(p - C + 1, 0)
        layout_C = w0 + jnp.arange(C)
        h_p = embed(w, jax.lax.dynamic_index_in_dim(s.tokens_BxS, p, 1, True))
        s = s._replace(h_BxSxD=jax.lax.dynamic_update_slice_in_dim(s.h_BxSxD, h_p, p, 1),
                       depth_BxS=jax.lax.dynamic_update_index_in_dim(
                           s.depth_BxS, jnp.zeros_like(s.done_B, jnp.int32), p, 1))
        live_B = ~s.done_B
        if scfg.kv_policy == "dense":
            full_B = live_B
        elif scfg.kv_policy == "deferred":
            if st.forced:
                full_B = jax.lax.dynamic_index_in_dim(rows.forced_flush_BxS, p, 1, False)
            else:
                full_B = policies.pending_count(s.depth_BxS, p, st.P, T) >= C - 1
            full_B = full_B & live_B
            s = s._replace(flush_BxS=jax.lax.dynamic_update_index_in_dim(
                s.flush_BxS, full_B, p, 1))
        else:
            full_B = jnp.zeros_like(live_B)
        eligible = (layout_C <= p) & ((layout_C >= st.P) | (layout_C == p))
        s = _run_chunk(st, w, s, rows, step, w0=w0, C=C, emit_p=p, eligible_C=eligible,
                       force_full_B=full_B, running_B=live_B, peel_first_loop=True,
                       compact_rows=True)
        if scfg.kv_policy == "copy":
            k_B = jax.lax.dynamic_index_in_dim(s.exit_loop_BxS, p, 1, False)
            rows_B = live_B & (k_B > 0)
            s = s._replace(
                k_cache=policies.copy_fill(s.k_cache, p, k_B, rows_B),
                v_cache=policies.copy_fill(s.v_cache, p, k_B, rows_B),
                depth_BxS=jax.lax.dynamic_update_index_in_dim(
                    s.depth_BxS, jnp.where(rows_B, T, 0), p, 1))
        return s._replace(p=p + 1), i + 1

    def cond(carry):
        s, i = carry
        return (i < n_steps) & (s.p < st.S - 1) & jnp.any(~s.done_B)

    s, _ = jax.lax.while_loop(cond, one_step, (s, jnp.int32(0)))
    return s


def layout_prompts(prompts: list[list[int]], max_new_tokens: int, max_seq_len: int | None,
                   prompt_len_multiple: int = 1):
    """Left-pad prompts into `[B, S]` int32; returns (tokens, pad_B, P, S), P = the longest prompt
    rounded up to a multiple of `prompt_len_multiple`. Raises SamplingError for an empty prompt
    or a prompt that does not fit the cache."""
    if not prompts:
        raise SamplingError("no prompts given")
    for i, pr in enumerate(prompts):
        if len(pr) == 0:
            raise SamplingError(f"prompt {i} is empty (needs at least one token)")
    P = -(-max(len(pr) for pr in prompts) // prompt_len_multiple) * prompt_len_multiple
    S = P + max_new_tokens
    if max_seq_len is not None:
        if P >= max_seq_len:
            raise SamplingError(f"prompt of {P} tokens does not fit the cache of "
                                f"{max_seq_len} positions (needs room for at least one new token)")
        S = min(S, max_seq_len)
    tokens = np.zeros((len(prompts), S), np.int32)
    pad = np.zeros((len(prompts),), np.int32)
    for b, pr in enumerate(prompts):
        pad[b] = P - len(pr)
        tokens[b, pad[b]:P] = pr
    return tokens, pad, P, S


def generate(cfg: OuroConfig, params, prompts: list[list[int]], scfg: SamplingConfig, *,
             group_size: int = 1, seed: int = 0, step: int = 0,
             prompt_indices: list[int] | None = None, decode_steps_per_call: int | None = None,
             progress=None, forced: RolloutBatch | None = None, mesh=None,
             timings: dict | None = None, master_fingerprint: str | None = None) -> RolloutBatch:
    """Sample `group_size` completions for each prompt; returns a `RolloutBatch` with schedule.

    Args:
      params: fp32 master parameter dict (`looprl.model.looped.param_dict`), or its copy in
        the compute dtype (`looprl.sampling.resident.ComputeWeights`: the same bits, half the
        memory in bf16), which needs `master_fingerprint`.
      prompts: token id lists (non-empty). Row b = prompt b // G, sample b % G.
      prompt_indices: each prompt's global index in its dataset (seeds its noise); default 0..n-1.
      decode_steps_per_call: decode steps per jitted call (progress granularity); default all.
      progress: optional callable(n_new_tokens_so_far, total) for a progress bar.
      forced: re-run this recorded rollout (tokens, exits, flushes, layout) at `params`.
      mesh: a `jax.sharding.Mesh` (`looprl.distributed.mesh`): rows and the KV cache are split
        over its row axes and each device runs this one-device program on its rows
        (`shard_map`; params all-gathered), so every row gets the bits it gets on one device.
      timings: a dict to fill with wall seconds `prefill_s` (prefill, which emits the first new
        token; waits for it to finish) and `decode_s` (the decode steps, which emit the rest),
        `decode_steps` (steps run), so decode throughput can be told from prefill, and
        `kv_cache_bytes` (`policies.kv_cache_bytes` of the whole batch).
      master_fingerprint: `params_fingerprint` of the fp32 master when `params` is a
        compute-dtype copy; the schedule records it (else the fingerprint of `params`).
    Raises: SamplingError on bad input (see `SamplingConfig.validate`, `layout_prompts`), or
      for weights held in a dtype other than fp32 without `master_fingerprint` or with another
      compute dtype (their bits would not be the master's cast).
    """
    T = cfg.total_ut_steps
    scfg.validate(T)
    held = jnp.dtype(params["layers"]["q_proj"].dtype)
    if held != jnp.float32 and (held != jnp.dtype(scfg.compute_dtype)
                                or master_fingerprint is None):
        raise SamplingError(f"parameters held in {held.name}: sampling from them needs "
                            f"compute_dtype {held.name} (found {jnp.dtype(scfg.compute_dtype).name})"
                            f" and master_fingerprint, the fp32 master's (ComputeWeights)")
    if forced is not None:
        fb = forced.to_numpy()
        sched = fb.schedule
        tokens = np.where(np.arange(sched.seq_len)[None] < sched.prompt_len, fb.tokens_BxS, 0)
        tokens = tokens.astype(np.int32)
        pad, P, S = fb.pad_B.astype(np.int32), sched.prompt_len, sched.seq_len
        prompt_index, sample_index = fb.prompt_index_B, fb.sample_index_B
        seed, step = sched.seed, sched.step
        frows = (jnp.asarray(fb.tokens_BxS, jnp.int32), jnp.asarray(fb.exit_loop_BxS, jnp.int32),
                 jnp.asarray(fb.flush_BxS, bool))
        scfg = dataclasses.replace(scfg, noise_keying=sched.noise_keying)  # tokens are forced
    else:
        G = group_size
        idx = list(range(len(prompts))) if prompt_indices is None else list(prompt_indices)
        rows_prompts = [pr for pr in prompts for _ in range(G)]
        tokens, pad, P, S = layout_prompts(rows_prompts, scfg.max_new_tokens, scfg.max_seq_len,
                                           scfg.prompt_len_multiple)
        prompt_index = np.repeat(np.asarray(idx, np.int32), G)
        sample_index = np.tile(np.arange(G, dtype=np.int32), len(prompts))
        frows = (None, None, None)
    for pr in prompts:
        bad = [t for t in pr if not (0 <= t < cfg.vocab_size)]
        if bad:
            raise SamplingError(f"prompt token ids {bad[:5]} outside the vocabulary "
                                f"[0, {cfg.vocab_size})")
    if forced is not None and scfg.kv_policy == "deferred":  # the recorded window
        rec = sched.deferred_max_pending
        if scfg.deferred_max_pending not in (None, rec):
            raise SamplingError(f"forced re-run with deferred_max_pending "
                                f"{scfg.deferred_max_pending}, but the rollout was sampled with "
                                f"{rec}")
        scfg = dataclasses.replace(scfg, deferred_max_pending=rec)
    local_rows = -(-tokens.shape[0] // (mesh.size if mesh is not None else 1))
    if scfg.deferred_max_pending is None:  # resolved here, recorded in the schedule
        scfg = dataclasses.replace(scfg, deferred_max_pending=policies.auto_max_pending(
            local_rows))
    menu = policies.row_menu(local_rows) if scfg.row_compaction else ()
    C = min(policies.chunk_size(scfg.kv_policy, scfg.deferred_max_pending), S)
    widths = policies.window_widths(C, local_rows)
    if forced is not None and sched.row_menu and sched.row_menu[-1] == local_rows:
        menu = tuple(sched.row_menu)  # the recorded compaction, on the recorded rows per device
        recorded = tuple(sorted({min(W, C) for W in sched.window_widths}))
        if recorded[:1] == (1,) and recorded[-1:] == (C,):  # (another policy's: not used)
            widths = recorded
    st = _Static(cfg, scfg, int(P), int(S), int(seed), forced is not None, menu, widths)
    rows = RowInfo(jnp.asarray(pad), jnp.asarray(prompt_index, jnp.int32),
                   jnp.asarray(sample_index, jnp.int32), *frows)
    if not all(isinstance(x, jax.Array) for x in jax.tree.leaves(params)):
        params = jax.device_put(params)  # once per call; callers should pass device arrays
    step_arr = jnp.int32(step)
    prefill, decode, fetch = _prefill, _decode, np.asarray
    B = tokens.shape[0]
    tokens_in = jnp.asarray(tokens)
    if mesh is not None and mesh.size > 1:
        prefill, decode, fetch, tokens_in, rows, step_arr = _on_mesh(mesh, tokens, rows, step)
    t0 = time.perf_counter()
    s = prefill(st, params, tokens_in, rows, step_arr)
    if timings is not None:
        jax.block_until_ready(s)
        t1 = time.perf_counter()
        timings["prefill_s"] = t1 - t0
    n_total = S - 1 - P
    per_call = decode_steps_per_call or max(n_total, 1)
    done_steps = 0
    while done_steps < n_total:
        s = decode(st, params, s, rows, step_arr, per_call)
        done_steps = int(jnp.max(s.p)) - P  # on a mesh: the furthest device (module doc)
        if progress is not None:
            progress(done_steps + 1, n_total + 1)
        if bool(jnp.all(s.done_B)):
            break
    if timings is not None:
        jax.block_until_ready(s)
        timings["decode_s"] = time.perf_counter() - t1
        timings["decode_steps"] = done_steps
        timings["kv_cache_bytes"] = policies.kv_cache_bytes(cfg, B, S, scfg.compute_dtype)
    sched = Schedule(
        kv_policy=scfg.kv_policy,
        exit_threshold=None if scfg.fixed_depth is not None else float(scfg.exit_threshold),
        fixed_depth=scfg.fixed_depth, deferred_max_pending=scfg.deferred_max_pending,
        chunk_size=policies.chunk_size(scfg.kv_policy, scfg.deferred_max_pending),
        prompt_len=int(P), seq_len=int(S), batch_size=int(tokens.shape[0]),
        total_ut_steps=T, compute_dtype=scfg.compute_dtype, temperature=float(scfg.temperature),
        top_k=int(scfg.top_k), top_p=float(scfg.top_p), seed=int(seed), step=int(step),
        params_fingerprint=master_fingerprint or params_fingerprint(params),
        devices=1 if mesh is None else int(mesh.size),
        backend=jax.default_backend(), stop_ids=tuple(scfg.stop_ids),
        row_tile=row_tile() if scfg.kernels == "invariant" else 1, kernels=scfg.kernels,
        mesh=_mesh_record(mesh, params), noise_keying=scfg.noise_keying,
        kernel_version=kernel_version(), row_menu=menu,
        window_widths=widths if menu else ())
    return RolloutBatch(
        tokens_BxS=fetch(s.tokens_BxS)[:B], pad_B=np.asarray(pad),
        exit_loop_BxS=fetch(s.exit_loop_BxS)[:B], logprob_BxS=fetch(s.logprob_BxS)[:B],
        logprob_processed_BxS=fetch(s.logprob_processed_BxS)[:B],
        flush_BxS=fetch(s.flush_BxS)[:B], prompt_index_B=np.asarray(prompt_index, np.int32),
        sample_index_B=np.asarray(sample_index, np.int32),
        completion_len_B=fetch(s.completion_len_B)[:B], schedule=sched,
        loop_rows=fetch(s.loop_rows_1xSxTxW) if menu else None)


# --- on a mesh (issue 7): the same programs, one per device on its rows -------------------------

def _mesh_record(mesh, params):
    return mesh_record(mesh if mesh is not None and mesh.size > 1 else None, params)


def _state_specs():
    row, kv = PS(ROW_AXES), PS(None, None, ROW_AXES)  # the caches are [T, L, B, S, Hkv, K]
    return DecodeState(row, row, row, kv, kv, row, row, row, row, row, row, row, row)


@functools.lru_cache(maxsize=32)
def _mesh_prefill(st: _Static, mesh):
    def body(params, tokens_BxS, rows, step):
        s = _prefill(st, params, tokens_BxS, rows, step)
        return s._replace(p=s.p[None])  # each device's position: p is [devices] on the mesh
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(PS(), PS(ROW_AXES), PS(ROW_AXES),
                                                             PS()),
                                 out_specs=_state_specs(), check_vma=False))


@functools.lru_cache(maxsize=32)
def _mesh_decode(st: _Static, mesh, n_steps: int):
    def body(params, s, rows, step):
        s = _decode(st, params, s._replace(p=s.p[0]), rows, step, n_steps)
        return s._replace(p=s.p[None])
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(PS(), _state_specs(), PS(ROW_AXES),
                                                             PS()),
                                 out_specs=_state_specs(), check_vma=False), donate_argnums=(1,))


def _on_mesh(mesh, tokens, rows: RowInfo, step: int):
    """Place a rollout on `mesh`: rows padded (copies of row 0) to a multiple of the row shards
    and split; returns (prefill, decode, fetch, tokens, rows, step) for `generate`'s loop.

    Each device's decode loop stops when its own rows are done, so `p` differs per device;
    devices still running advance together, hence `generate` counts steps by the largest p."""
    n = ml.padded_rows(tokens.shape[0], mesh)
    put = lambda a: ml.put_global(ml.pad_rows(np.asarray(a), n, fill="first"),  # noqa: E731
                                  ml.row_sharding(mesh, np.ndim(a)))
    rows = RowInfo(*(None if a is None else put(a) for a in rows))
    step_arr = ml.put_global(np.int32(step), ml.replicated(mesh))

    def prefill(st, params, tokens_BxS, rows, step):
        return _mesh_prefill(st, mesh)(params, tokens_BxS, rows, step)

    def decode(st, params, s, rows, step, n_steps):
        return _mesh_decode(st, mesh, n_steps)(params, s, rows, step)
    return prefill, decode, ml.to_host, put(tokens), rows, step_arr
