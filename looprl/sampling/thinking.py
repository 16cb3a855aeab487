"""The thinking budget with a forced answer (ScaleRL's interruptions, arXiv 2510.13786 §3).

A completion that has emitted `budget` tokens without closing its thinking (the close's token
ids, `SamplingConfig.think_close_ids`, as its latest tokens) is interrupted: its next
`len(forced_answer_ids)` tokens are the forced answer text, teacher-forced (written, not
drawn), and at most `answer_budget` sampled tokens follow before the completion ends. A forced
position runs its loops and exit rule as any other (later positions read its K/V, and its
log-prob is recorded), so replay covers the whole completion bit for bit; its token was not
sampled, so `RolloutBatch.forced_BxS` takes it out of the loss and of every log-prob claim
(`RolloutBatch.sampled_mask_BxS`). Forced re-runs take the recorded tokens and need none of
this. The budget is one integer per step, drawn uniformly in [lo, hi] from the run seed and the
step (`draw_budget`), so a resumed run draws the same ones.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

NEVER = np.iinfo(np.int32).max // 2  # force_at_B of a row that is not interrupted
_TAG = 0x7468696E  # folds the budget's stream out of the run seed ("thin")


def draw_budget(seed: int, step: int, lo: int, hi: int) -> int:
    """The thinking budget of step `step`: uniform in [lo, hi] (ints, lo <= hi), from the run
    `seed` and `step` alone (threefry), so it does not depend on what else the run drew."""
    if lo == hi:
        return int(lo)
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), _TAG), step)
    return int(jax.random.randint(key, (), lo, hi + 1))


def init_state(B: int, S: int) -> dict:
    """The decode state's thinking fields for B rows of S positions, nothing forced yet."""
    return {"forced_BxS": jnp.zeros((B, S), bool),
            "force_at_B": jnp.full((B,), NEVER, jnp.int32), "closed_B": jnp.zeros((B,), bool)}


def force_token(scfg, s, budget_B, token_B, emitting_B, emit_p):
    """(token_B, state): the token emitted at `emit_p` with the forced answer written over the
    drawn one where a row is interrupted, and `forced_BxS` / `force_at_B` updated. `token_B`
    int32 [B] the drawn tokens; `budget_B` int32 [B]."""
    ids = jnp.asarray(scfg.forced_answer_ids, jnp.int32)
    F = len(scfg.forced_answer_ids)
    n = s.completion_len_B  # the completion index of the token emitted now
    begin = emitting_B & (n == budget_B) & ~s.closed_B & (s.force_at_B == NEVER)
    start = jnp.where(begin, n, s.force_at_B)
    k = n - start
    forced = emitting_B & (k >= 0) & (k < F)
    token_B = jnp.where(forced, ids[jnp.clip(k, 0, F - 1)], token_B)
    col = jax.lax.dynamic_index_in_dim(s.forced_BxS, emit_p, 1, False)
    forced_BxS = jax.lax.dynamic_update_index_in_dim(s.forced_BxS, col | forced, emit_p, 1)
    return token_B, s._replace(forced_BxS=forced_BxS, force_at_B=start)


def after_emit(scfg, s, emitting_B, emit_p):
    """The state after a token was written at `emit_p + 1` (completion lengths counted):
    `closed_B` where the completion now ends with the close's ids, and done where an
    interrupted row has emitted `answer_budget` tokens after its forced answer."""
    close = scfg.think_close_ids
    Kc = len(close)
    n = s.completion_len_B
    S = s.tokens_BxS.shape[1]
    closed = s.closed_B
    if Kc <= S:
        first = jnp.maximum(emit_p + 2 - Kc, 0)
        win = jax.lax.dynamic_slice_in_dim(s.tokens_BxS, first, Kc, axis=1)
        match = jnp.all(win == jnp.asarray(close, jnp.int32)[None], axis=1) & (n >= Kc)
        closed = closed | (emitting_B & match)
    F = len(scfg.forced_answer_ids)
    spent = emitting_B & (s.force_at_B != NEVER) & (n >= s.force_at_B + F + scfg.answer_budget)
    return s._replace(closed_B=closed, done_B=s.done_B | spent)
