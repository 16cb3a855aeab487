"""KV policies: the K/V a later query reads for a position that exited early (docs/DESIGN.md §3).

A position exits at loop k; a query at loop d > k still reads some K/V of it. Each policy is an
object that the sampler and the learner's log-probs call, and says:
- what it computes: `learner_kv_depth`, the K/V the learner's teacher-forced pass reads;
- its pending and flush rules: `step_start` (the rows whose current position runs every loop
  this decode step) and `step_end` (what it writes after the step);
- its window: `chunk_size` (positions per decode chunk) and `window_widths` (the widths of a
  decode loop's passes under row compaction, `looprl.sampling.compaction`).
`POLICIES` maps each name of the config's `rollout.kv_policy` (`looprl.config.KVPolicy`) to
its object; `policy_named` looks one up.
"""
from __future__ import annotations

import typing

import jax
import jax.numpy as jnp

from looprl.config import KVPolicy
from looprl.errors import SamplingError


class Policy:
    """A KV policy. The base holds the rules `dense` and `copy` share: a chunk of one position,
    one pass width, nothing written after a step, every loop's own K/V."""
    name: str = ""
    pending: bool = False  # positions may wait for their later loops (the pending bound applies)

    def chunk_size(self, max_pending: int) -> int:
        """Positions per decode chunk: the current one."""
        return 1

    def window_widths(self, chunk: int, local_rows: int) -> tuple[int, ...]:
        """Widths of a decode loop's passes: the current position alone."""
        return (1,)

    def step_start(self, s, p, live_B, forced_flush_BxS, *, prompt_len: int, T: int,
                   chunk: int):
        """Before decode step p of the sampler's state `s` (`looprl.sampling.state.DecodeState`):
        returns (s, full_B), full_B `[B]` bool the rows whose position p keeps looping to T after
        its exit. `live_B`: rows not done; `forced_flush_BxS`: a forced re-run's recorded flushes
        (None when sampling)."""
        raise NotImplementedError

    def step_end(self, s, p, live_B, T: int):
        """After decode step p: the state with what the policy writes (nothing here)."""
        return s

    def learner_kv_depth(self, kv_depth_BxS):
        """The `kv_depth_BxS` of the learner's teacher-forced pass
        (`looprl.model.looped.teacher_forced_loops`): None, every loop reads its own K/V."""
        return None


class Dense(Policy):
    """`dense`: every position computes all T loops at its own step; its exit only picks the
    logits it emits from."""
    name = "dense"

    def step_start(self, s, p, live_B, forced_flush_BxS, *, prompt_len, T, chunk):
        return s, live_B


class Deferred(Policy):
    """`deferred`: a position stops at its exit loop k; its loops k+1..T run later, when a later
    position of its row first needs that loop's K/V, in one chunk with it. The K/V equal dense's.

    After step p the loops computed per position are a suffix maximum of exit loops, so a row's
    pending positions are a contiguous suffix, covered by a window of C = max_pending + 1
    positions ending at the current one. A row with max_pending or more positions pending is
    flushed before the step (its current position runs every loop, catching all pending
    positions up to T), and the flush is recorded (`flush_BxS`). With max_pending 0 every row is
    flushed at every step: dense's execution."""
    name = "deferred"
    pending = True

    def chunk_size(self, max_pending: int) -> int:
        """Positions per decode chunk: the current one plus the pending window."""
        return max_pending + 1

    def window_widths(self, chunk: int, local_rows: int) -> tuple[int, ...]:
        """Widths for a chunk of `chunk` positions and `local_rows` rows per device: 1 (the
        current position alone), then 2, 4, 8, ... below `chunk`, then `chunk`; `(1, chunk)` up
        to 16 rows (as `compaction.row_menu` keeps one size there); `(1,)` for a chunk of one.

        At loop d a row's positions still needing loop d are a suffix of its window ending at
        the current position, of some length n; the row runs in the pass of the smallest width
        >= n, on the positions [p - width + 1, p] (`compaction.block_pass`), so a row with one
        pending position computes 2 positions, not the whole window. Each width is up to two
        more copies of the layer stack in the decode program (`compaction.window_block_rows`),
        hence powers of two only."""
        if chunk <= 1:
            return (1,)
        if local_rows <= 16:
            return (1, chunk)
        widths, w = [1], 2
        while w < chunk:
            widths.append(w)
            w *= 2
        return (*widths, chunk)

    def step_start(self, s, p, live_B, forced_flush_BxS, *, prompt_len, T, chunk):
        """The rows flushed at step p: recorded ones when forced, else those with chunk - 1 or
        more positions pending; written into `s.flush_BxS`."""
        if forced_flush_BxS is not None:
            full_B = jax.lax.dynamic_index_in_dim(forced_flush_BxS, p, 1, False)
        else:
            full_B = pending_count(s.depth_BxS, p, prompt_len, T) >= chunk - 1
        full_B = full_B & live_B
        s = s._replace(flush_BxS=jax.lax.dynamic_update_index_in_dim(s.flush_BxS, full_B, p, 1))
        return s, full_B


class Copy(Policy):
    """`copy`: loops k+1..T never run; a query at loop d reads the position's K/V from loop
    min(d, k) (vime's LAST_EXITED layout): after the step the position's loop-k K/V is copied
    into its slots k+1..T. An approximation of dense's math, which the learner reproduces
    exactly."""
    name = "copy"

    def step_start(self, s, p, live_B, forced_flush_BxS, *, prompt_len, T, chunk):
        return s, jnp.zeros_like(live_B)

    def step_end(self, s, p, live_B, T):
        """Copies position p's exit-loop K/V into its later slots; its depth becomes T."""
        k_B = jax.lax.dynamic_index_in_dim(s.exit_loop_BxS, p, 1, False)
        rows_B = live_B & (k_B > 0)
        return s._replace(
            k_cache=copy_fill(s.k_cache, p, k_B, rows_B),
            v_cache=copy_fill(s.v_cache, p, k_B, rows_B),
            depth_BxS=jax.lax.dynamic_update_index_in_dim(
                s.depth_BxS, jnp.where(rows_B, T, 0), p, 1))

    def learner_kv_depth(self, kv_depth_BxS):
        """At loop d position j reads the K/V of loop min(d, kv_depth_BxS[:, j])."""
        return kv_depth_BxS


POLICIES: dict[str, Policy] = {p.name: p for p in (Dense(), Deferred(), Copy())}
KV_POLICIES = typing.get_args(KVPolicy)  # the names the config accepts: the keys of POLICIES


def policy_named(name: str) -> Policy:
    """The policy called `name`. Raises SamplingError for an unknown name."""
    if name not in POLICIES:
        raise SamplingError(f"unknown kv_policy {name!r}; expected one of {list(POLICIES)}")
    return POLICIES[name]


AUTO_DENSE_ROWS = 16  # rows per device from which the automatic pending bound is 0


def auto_max_pending(local_rows: int) -> int:
    """The default pending bound of `deferred` for `local_rows` rows per device: 64 // rows - 1,
    clamped to [7, 63] (63 at batch 1, 15 at 4 rows, 7 at 8 rows), and 0 from AUTO_DENSE_ROWS
    rows on, where every row is flushed at every step (dense's execution, recorded as
    deferred's).

    Postponing a loop pays when a step costs about what its overhead costs; on a compute-bound
    batch it runs dense's work in more, smaller passes, hence 0 from 16 rows. A flush runs
    `rows x (max_pending + 1)` chunk rows: while that is small a wide window makes flushes rare
    at almost no cost. A CPU rule: `benchmarks/deferred_window.py` sets it (and measures an
    accelerator's own)."""
    if local_rows >= AUTO_DENSE_ROWS:
        return 0
    return int(min(63, max(7, 64 // max(local_rows, 1) - 1)))


def pending_count(depth_BxS, p, prompt_len: int, T: int):
    """Completion positions before p whose KV is not computed for every loop, `[B]` int32."""
    idx = jnp.arange(depth_BxS.shape[1])
    live = (idx >= prompt_len) & (idx < p)
    return jnp.sum(live[None] & (depth_BxS < T), axis=1, dtype=jnp.int32)


def copy_fill(cache_TxLxBxSxHxK, p, exit_loop_B, rows_B):
    """`copy`: for rows `rows_B`, write position p's loop-k K/V into its slots k+1..T."""
    col = jax.lax.dynamic_index_in_dim(cache_TxLxBxSxHxK, p, axis=3, keepdims=False)  # T,L,B,H,K
    T = col.shape[0]
    src = jnp.take_along_axis(col, (jnp.maximum(exit_loop_B, 1) - 1)[None, None, :, None, None],
                              axis=0)  # 1,L,B,H,K
    t = jnp.arange(1, T + 1)[:, None, None, None, None]
    take = (t > exit_loop_B[None, None, :, None, None]) & rows_B[None, None, :, None, None]
    col = jnp.where(take, src, col)
    return jax.lax.dynamic_update_index_in_dim(cache_TxLxBxSxHxK, col, p, axis=3)
