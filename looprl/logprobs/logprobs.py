"""Learner log-probabilities of sampled tokens: `dense`, `replay`, `hybrid`, `stock` (DESIGN.md §4).

All four take a rollout's layout (tokens, left padding), its recorded exit loops and KV policy,
and return `logprob_BxS` fp32: at every emitting position i (exit_loop_BxS[:, i] > 0) the
temperature-scaled, full-vocabulary log-prob of tokens[:, i + 1] at loop exit_loop[:, i]; 0
elsewhere. Logits are built only at each position's exit loop (`[B, S, V]`, never `[T, B, S, V]`).

- `dense`: teacher-forced, differentiable pass over the whole sequence with the batch-invariant
  kernels; KV as the policy implies (dense/deferred: every loop's own K/V; copy: at loop d a
  position's K/V from loop min(d, k)). Because every matmul is row-tiled and attention runs
  over key blocks aligned to each row's first live key, it reproduces the sampler's bits
  (tests/logprobs), over the recorded cache length S or over the batch's live prefix
  (`live_seq_len`, below).
- `replay`: the recorded schedule re-executed under stop_gradient. `replay_impl="invariant"`
  (default) is the dense pass under stop_gradient, exact where the kernels are invariant (XLA CPU,
  checked by `looprl verify`); `replay_impl="forced"` re-runs the sampler itself in forced mode
  on the whole recorded batch (same code, same shapes), the fallback for backends where
  invariance does not hold.
- `hybrid = stop_gradient(replay) + (dense - stop_gradient(dense))`: replay's value, dense's
  gradient.
- `stock`: the same math written the common way (plain `x @ W`, attention over the live prefix,
  scores in the compute dtype): the baseline and negative control.

Two learners that ignore the schedule, the documented baselines of what a framework without
looprl computes (`experiments/mismatch_study.py`; both differentiable, dense gradients):
- `full_depth`: every emitting position's log-prob from loop T, what an ordinary forward gives
  (dense KV, whatever the rollout's exits and KV policy were).
- `expected`: `log_softmax(sum_t p_t logits_t / temperature)`, the exit-distribution-weighted
  mixture of logits that the upstream HF Ouro forward computes when given labels
  (`p_t = lambda_t prod_{j<t}(1 - lambda_j)`, `p_T` the remainder). Since the lm_head is linear
  and bias-free, `sum_t p_t W h_t = W sum_t p_t h_t`: the mixture is accumulated loop by loop
  on the hidden state `[B, S, D]` (never `[T, B, S, V]`) and projected once. p_t carries the
  gate's gradient, so the gate trains, as in HF.

**The live prefix** (`live_seq_len`, the learner's `learner.seq_bucket`): a rollout's layout is
P + max_new_tokens positions long, but no row emits past P + its completion length. The passes
may run on the first S' = P + (the longest completion, rounded up to a multiple of the bucket)
positions only (at most S), the rest padded back with zeros. Why the bits at every emitting
position are those of the whole length: (1) every pass is causal: position i reads tokens,
exits and KV depths at positions <= i < S' only; (2) the matmuls are row-invariant, so fewer
rows change no row; (3) attention: a query's live keys sit in the same slots of the same 128-key
blocks, cut at its row's first live key (`looprl.kernels`), at any key-axis length, and
every other slot is masked for it (a query at i < S' sees keys <= i). What the cut changes is
masked slots only: whole blocks of them go (the key axis is shorter), and since the rotation is
modulo the padded length, the row's left-padding keys move into the last kept block, into slots
that held future keys at the whole length. A masked slot adds `0 * v` (v finite) to its block's
value partial and 0 to its softmax sum, and a block of masked slots alone gives partials of +0
(summed from +0), which leave a running block sum x unchanged: x + 0 == x for every x but -0,
the caveat the kernels' exact-zero argument for masked keys has anyway. The max is order-free.
No dot's shape depends on the key-axis length: scores and values are one `[R, K] x [K, 128]`
and `[R, 128] x [128, K]` dot per (b, h, key block), over the blocks holding a live key only
(`looprl.kernels`; tests/model/test_kernels_ouro_shapes.py checks the program's dots and
the bits at Ouro widths for caches of 384 to 2048 slots). The logits are per position.
Bucketing bounds the compiled shapes to max_new_tokens / bucket + 1 lengths. Checked bit for
bit against the recorded log-probs by tests/logprobs/test_live_prefix.py (a reviewer also cut
`attention` alone at head_dim 64 and 128, fp32 and bf16, pads 0-23, S of 155-700 cut to
37-640: 0 bits differed).
The loss and gradient sum their terms over S' positions, so they equal the whole length's to
fp32 rounding, not bit for bit (a resumed run keeps its own `seq_bucket`).
"""
from __future__ import annotations

import functools
import typing

import jax
import jax.numpy as jnp
import numpy as np

from looprl.config import LogprobMethod
from looprl.distributed.mesh import row_sharded_call
from looprl.errors import ScheduleError
from looprl.model.config import OuroConfig
from looprl.model.looped import (cast_weights, exit_lambda, gate_logits, lm_logits,
                                 next_token_targets, teacher_forced_loops)
from looprl.sampling.processing import process_logits
from looprl.sampling.sampler import SamplingConfig, generate

METHODS = typing.get_args(LogprobMethod)  # the config's choices: hybrid, replay, dense, stock, ...
SCHEDULE_UNAWARE = ("full_depth", "expected")  # learners that ignore the recorded schedule


def exit_hidden(model_cfg: OuroConfig, w, tokens_BxS, pad_B, exit_loop_BxS, kv_depth_BxS, *,
                copy_kv: bool, stock: bool = False, remat: bool = True):
    """Teacher-forced loops (`teacher_forced_loops`); returns h at each position's exit loop
    `[B, S, D]` (zeros where exit_loop is 0).

    copy_kv: the `copy` policy: at loop d, position j's K/V are those of loop min(d, kv_depth_j).
    remat: rematerialise each loop in the backward pass (memory O(1 loop) instead of O(T)).

    The T loops run as a `lax.scan` (an XLA while loop), not unrolled: each loop's input h is
    then read from memory, as in the sampler's loop-by-loop while loop. Unrolled, XLA fuses
    loop d's final norm (`h = (x * rsqrt) * w`) into loop d+1's residual add, where LLVM's
    FMA contraction rounds `x + h` differently than when h comes from memory (seen with
    L = 1, whose layer scan XLA inlines: tests/logprobs/test_small_dims_exact.py).
    """
    def keep_exit(h_exit, h, _, d):
        return jnp.where((exit_loop_BxS == d)[..., None], h, h_exit)

    return teacher_forced_loops(model_cfg, w, tokens_BxS, pad_B, fold=keep_exit,
                                init=jnp.zeros_like,
                                kv_depth_BxS=kv_depth_BxS if copy_kv else None, stock=stock,
                                remat=remat, unroll=False)


def expected_hidden(model_cfg: OuroConfig, w, tokens_BxS, pad_B, *, remat: bool = True):
    """`sum_t p_t h(t)` `[B, S, D]` fp32 over the T loops of a dense teacher-forced pass, with
    p_t the exit distribution of the gate (HF Ouro's `stacked_exit_pdf`: `p_t = lambda_t *
    remaining` for t < T, `p_T = remaining`). Differentiable in the gate and the stack."""
    B, S = tokens_BxS.shape
    T = model_cfg.total_ut_steps

    def mix_in(carry, h, lam, t):
        mix, remaining = carry
        p = jnp.where(t < T, lam * remaining, remaining)
        remaining = remaining * (1.0 - lam)
        return mix + p[..., None] * h.astype(jnp.float32), remaining

    mix, _ = teacher_forced_loops(
        model_cfg, w, tokens_BxS, pad_B, readout=lambda h, t: exit_lambda(w, h), fold=mix_in,
        init=lambda h: (jnp.zeros(h.shape, jnp.float32), jnp.ones((B, S), jnp.float32)),
        remat=remat, unroll=False)
    return mix


def token_logprobs(w, h_exit_BxSxD, tokens_BxS, exit_loop_BxS, temperature: float,
                   top_k: int = 0, top_p: float = 1.0, stock: bool = False):
    """(full, processed) log-probs `[B, S]` fp32 of tokens[:, i+1] at emitting positions i."""
    logits = lm_logits(w, h_exit_BxSxD, stock)
    B, S, V = logits.shape
    full, processed = process_logits(logits.reshape(B * S, V), temperature, top_k, top_p)
    t = next_token_targets(tokens_BxS).reshape(B * S, 1)
    lp = jnp.take_along_axis(full, t, axis=1).reshape(B, S)
    lpp = jnp.take_along_axis(processed, t, axis=1).reshape(B, S)
    emit = exit_loop_BxS > 0
    return jnp.where(emit, lp, 0.0), jnp.where(emit, lpp, 0.0)


def sequence_logprobs(model_cfg: OuroConfig, params, tokens_BxS, pad_B, exit_loop_BxS, kv_depth_BxS,
                      *, kv_policy: str, compute_dtype: str, temperature: float,
                      method: str = "hybrid", top_k: int = 0, top_p: float = 1.0,
                      remat: bool = True):
    """Learner log-probs by `method` (traceable; call inside jit/grad).

    Args: params fp32 master dict; tokens/exit_loop/kv_depth `[B, S]` int32; pad_B int32;
    kv_policy `dense|deferred|copy`; method `dense|replay|hybrid|stock`.
    Returns (logprob_BxS, logprob_processed_BxS) fp32.
    """
    w = cast_weights(params, compute_dtype)
    copy_kv = kv_policy == "copy"
    stock = method == "stock"
    if method == "expected":  # the mixed hidden state and the lm_head in fp32
        h = expected_hidden(model_cfg, w, tokens_BxS, pad_B, remat=remat)
        w = {**w, "lm_head": w["lm_head"].astype(jnp.float32)}
    else:
        exits = exit_loop_BxS
        if method == "full_depth":  # loop T everywhere, dense KV: an ordinary forward
            exits = jnp.where(exit_loop_BxS > 0, model_cfg.total_ut_steps, 0)
            copy_kv = False
        h = exit_hidden(model_cfg, w, tokens_BxS, pad_B, exits, kv_depth_BxS, copy_kv=copy_kv,
                        stock=stock, remat=remat)
    full, proc = token_logprobs(w, h, tokens_BxS, exit_loop_BxS, temperature, top_k, top_p,
                                stock)
    if method in ("dense", "stock", "full_depth", "expected"):
        return full, proc
    sg_full, sg_proc = jax.lax.stop_gradient(full), jax.lax.stop_gradient(proc)
    if method == "replay":
        return sg_full, sg_proc
    if method == "hybrid":
        return sg_full + (full - sg_full), sg_proc + (proc - sg_proc)
    raise ValueError(f"unknown learner log-prob method {method!r}; expected one of {METHODS}")


@functools.partial(jax.jit, static_argnames=("cfg", "kv_policy", "compute_dtype", "temperature",
                                             "method", "top_k", "top_p", "remat"))
def _jit_logprobs(params, tokens, pad, exit_loop, kv_depth, *, cfg, kv_policy, compute_dtype,
                  temperature, method, top_k, top_p, remat):
    return sequence_logprobs(cfg, params, tokens, pad, exit_loop, kv_depth, kv_policy=kv_policy,
                             compute_dtype=compute_dtype, temperature=temperature,
                             method=method, top_k=top_k, top_p=top_p, remat=remat)


def live_seq_len(batch, bucket: int) -> int:
    """The live prefix of a `RolloutBatch` the learner's passes run on (module doc): P + the
    longest completion (stop token included) rounded up to a multiple of `bucket`, at most the
    layout's length S; S when `bucket` is 0 (off). Every emitting position and the token it
    emits lie inside it."""
    S, P = batch.schedule.seq_len, batch.schedule.prompt_len
    if bucket <= 0:
        return S
    longest = int(np.max(np.asarray(batch.completion_len_B), initial=1))
    return min(S, P + -(-max(longest, 1) // bucket) * bucket)


def batch_logprobs(cfg: OuroConfig, params, batch, method: str = "replay", rows=None,
                   remat: bool = False, mesh=None, seq_len: int | None = None):
    """Learner log-probs for rows `rows` of a `RolloutBatch` (all rows by default), as numpy.

    `seq_len`: run on the first `seq_len` positions (`live_seq_len`; the same bits at every
    emitting position, module doc) and pad the result back to S with zeros; default S, except
    for `stock`, whose default is the exact live prefix (P + the longest completion, as common
    code pads a batch). The learner passes its bucketed live prefix to every method, `stock`
    included, so a GRPO step compiles at most max_new_tokens / seq_bucket + 1 lengths of each
    pass (an unbucketed stock control compiled again for each new longest completion, 0.7-0.9 s
    a step at 256 rows; experiments/README "Whole GRPO step"). A stock pass's bits may depend on
    the key-axis length; it is the baseline, not a replay. A rollout sampled with
    `kernels="stock"` has no invariant pass that reproduces it: its `replay` (and `hybrid`,
    whose value is replay's) is `forced_replay_logprobs`. With a `mesh` of several devices the
    rows are split over its row axes and each device runs this one-device program on its rows
    (`looprl.distributed.mesh.row_sharded_call`). Returns (logprob_BxS, processed_BxS)."""
    if method in ("replay", "hybrid") and batch.schedule.kernels != "invariant":
        return forced_replay_logprobs(cfg, params, batch, rows, mesh=mesh)
    sub = batch if rows is None else batch.select(rows)
    sch = sub.schedule
    tokens, pad = np.asarray(sub.tokens_BxS), np.asarray(sub.pad_B)
    exit_loop, kv_depth = np.asarray(sub.exit_loop_BxS), sub.kv_depth_BxS()
    S = sch.seq_len
    if seq_len is None:  # stock: the exact live prefix, as common code pads a batch
        live = live_seq_len(sub, 1) if method == "stock" else S
    else:
        live = seq_len
    if not sch.prompt_len < live <= S:
        raise ValueError(f"seq_len {seq_len}: expected a length in ({sch.prompt_len}, {S}]")
    if live < S:
        tokens, exit_loop, kv_depth = tokens[:, :live], exit_loop[:, :live], kv_depth[:, :live]
    static = dict(cfg=cfg, kv_policy=sch.kv_policy, compute_dtype=sch.compute_dtype,
                  temperature=float(sch.temperature), method=method, top_k=int(sch.top_k),
                  top_p=float(sch.top_p), remat=remat)
    if mesh is not None and mesh.size > 1:
        lp, lpp = row_sharded_call(_jit_logprobs, mesh, (params,),
                                   (tokens, pad, exit_loop, kv_depth), static=static,
                                   row_axes_out=(0, 0))
    else:
        lp, lpp = _jit_logprobs(params, jnp.asarray(tokens), jnp.asarray(pad),
                                jnp.asarray(exit_loop), jnp.asarray(kv_depth), **static)
    lp, lpp = np.asarray(lp), np.asarray(lpp)
    if lp.shape[1] < S:
        padw = ((0, 0), (0, S - lp.shape[1]))
        lp, lpp = np.pad(lp, padw), np.pad(lpp, padw)
    return lp, lpp


def forced_replay_logprobs(cfg: OuroConfig, params, batch, rows=None, mesh=None):
    """`replay_impl="forced"`: replay by re-running the sampler in forced mode on the whole
    recorded batch (its tokens, exit loops, deferred flushes, layout and shapes) at `params`,
    then selecting `rows`. The same program at the same shapes as the sampler, so it reproduces
    the sampler's bits even where the learner's kernels are not invariant; the fallback for
    such cells (`looprl verify` records per cell which implementation it used). Not
    differentiable. Returns numpy (logprob_BxS, processed_BxS) fp32 of the selected rows.

    `mesh`: re-run on a mesh (the sampler's `mesh` argument).
    Raises: ScheduleError if the re-run does not follow the recorded schedule (exit loops)."""
    sch = batch.schedule
    scfg = SamplingConfig.from_schedule(sch)
    out = generate(cfg, params, [[0]], scfg, forced=batch.to_numpy(), mesh=mesh)
    if not np.array_equal(np.asarray(out.exit_loop_BxS), np.asarray(batch.exit_loop_BxS)):
        raise ScheduleError("forced replay did not follow the recorded exit loops")
    lp, lpp = np.asarray(out.logprob_BxS), np.asarray(out.logprob_processed_BxS)
    if rows is not None:
        rows = np.asarray(rows)
        lp, lpp = lp[rows], lpp[rows]
    return lp, lpp


def loop_logprobs(model_cfg: OuroConfig, params, tokens_BxS, pad_B, exit_loop_BxS,
                  kv_depth_BxS, *, kv_policy: str, compute_dtype: str, temperature: float,
                  remat: bool = True):
    """Every loop's log-prob of the emitted token and gate logit, for RLTT loop credit and the
    stage-II gate loss (traceable, differentiable; `dense`-style teacher-forced pass).

    Each loop's `[B, S, V]` logits are built in turn and reduced to the target's log-prob before
    the next loop (never `[T, B, S, V]` at once). Log-probs are `log_softmax(logits_t / temp)` in
    fp32 over the full vocabulary, for every loop t = 1..T at emitting positions (0 elsewhere);
    the caller weights only the loops the schedule computed (t <= exit loop). At a position's
    exit loop the value is the same math as `sequence_logprobs(..., method="dense")` but not
    bit-identical to it (XLA fuses this pass differently): old and new loop-credit log-probs
    must both come from this function.

    The gate logits carry gradient into the gate's parameters only (h(t) is read under
    stop_gradient), so the stage-II gate loss never trains the LM.

    Returns (logprob_TxBxS fp32, gate_logit_TxBxS fp32).
    """
    w = cast_weights(params, compute_dtype)
    B, S = tokens_BxS.shape
    target = next_token_targets(tokens_BxS)
    emit = exit_loop_BxS > 0

    def readout(h, d):
        full, _ = process_logits(lm_logits(w, h).reshape(B * S, -1), temperature, 0, 1.0)
        lp = jnp.take_along_axis(full, target.reshape(B * S, 1), axis=1).reshape(B, S)
        # the gate logit reads h(t) under stop_gradient: the stage-II gate loss trains the gate
        # only (DESIGN.md §1), never the LM that produced h (tests/rl/test_train_gate.py)
        z = gate_logits(w, jax.lax.stop_gradient(h))
        return jnp.where(emit, lp, 0.0), z

    # unrolled (a Python loop over T), the form this pass has always had: the scan form would
    # give other low bits, and so change every loop-credit and gate-training run
    return teacher_forced_loops(model_cfg, w, tokens_BxS, pad_B, readout=readout,
                                kv_depth_BxS=kv_depth_BxS if kv_policy == "copy" else None,
                                remat=remat, unroll=True)
