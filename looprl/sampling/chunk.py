"""One chunk of the sampler: its loops, its exit decision and the token it emits
(docs/DESIGN.md §3).

The prefill is one chunk of every prompt position; a decode step is one chunk of the current
position (plus, under `deferred`, its pending window). The loops run in a `lax.while_loop`
that stops as soon as every row is done with the chunk, so early exit saves sequential depth.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from looprl.errors import SamplingError
from looprl.model.looped import (Layout, exit_lambda, exit_state_init, exit_state_update,
                                 lm_logits, q_exit_decision)
from looprl.sampling import thinking
from looprl.sampling.compaction import block_pass, compact_pass, loop_pass, record_rows
from looprl.sampling.processing import noise_position, process_logits, row_keys, sample_tokens
from looprl.sampling.state import DecodeState, RowInfo, Static


def run_chunk(st: Static, w, s: DecodeState, rows: RowInfo, step, *, w0, C: int, emit_p,
              eligible_C, force_full_B, running_B, peel_first_loop: bool = False,
              compact_rows: bool = False):
    """Run loops 1..(as needed) for the chunk [w0, w0+C), then emit from position `emit_p`.

    A chunk position is computed at loop d iff its row is running and it has computed exactly
    d - 1 loops. The emitting position's exit loop comes from the Q-exit rule (or fixed depth,
    or the forced schedule); rows in `force_full_B` keep looping to T after they exit.
    `peel_first_loop` runs loop 1 as a chunk of the emitting position alone: in a decode step
    every other chunk position has already computed loop 1 (deferred keeps only loops >= 2
    pending), so loop 1 costs what it costs under `dense`; the kernels are row-invariant, so
    the bits do not change. With `compact_rows` no peel is needed (nor compiled: it would be
    a third copy of the layer stack in the deferred decode program): at loop 1 no row has a
    pending position needing it, so the loop's position-alone pass runs every running row and
    its window pass runs none, the peel's computation and its `loop_rows` record.
    `compact_rows` (decode steps, with `st.row_menu`): each loop runs only the rows still
    running, as a sub-batch (`compact_pass`); under `deferred` each row runs the positions
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
            s = loop_pass(st, w, s, rows, positions_BxS, d, w0, C, active)
        elif C == 1:
            s, n = compact_pass(st, w, s, rows, positions_BxS, d, w0, 1, active, running)
            s = record_rows(s, emit_p, d, n, 0)
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
                s, n = (compact_pass if W == 1 else block_pass)(
                    st, w, s, rows, positions_BxS, d, wi0, W, act & run_B[:, None], run_B)
                s = record_rows(s, emit_p, d, n, i)
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
    thinking_on = scfg.thinking_budget is not None and not st.forced
    if thinking_on:  # an interrupted row's forced answer replaces the drawn token
        token, s = thinking.force_token(scfg, s, rows.think_budget_B, token, emitting, emit_p)
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
    if thinking_on:
        s = thinking.after_emit(scfg, s, emitting, emit_p)
    if st.forced:  # a recorded rollout that ended by length stops where the recording stopped
        n_forced = jnp.sum(rows.forced_exit_BxS > 0, axis=1)
        s = s._replace(done_B=s.done_B | (s.completion_len_B >= n_forced))
    return s
