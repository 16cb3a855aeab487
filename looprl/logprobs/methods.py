"""Learner log-probs of a recorded rollout's sampled tokens (docs/DESIGN.md §4).

Every method takes the rollout's layout (tokens, left padding), exit loops and KV policy, and
returns `logprob_BxS` fp32: at each emitting position i (exit_loop_BxS[:, i] > 0) the
temperature-scaled, full-vocabulary log-prob of tokens[:, i + 1] at loop exit_loop[:, i]; 0
elsewhere. Logits are built at each position's exit loop only (`[B, S, V]`, never `[T, B, S, V]`).
- `dense`: a teacher-forced, differentiable pass on the batch-invariant kernels, with the K/V
  the rollout's KV policy reads (`looprl.sampling.kv_policies`): the sampler's bits.
- `replay`: the recorded schedule under stop_gradient: the dense pass (`replay_impl` invariant)
  or the sampler re-run in forced mode (`forced_replay_logprobs`, where the kernels are not).
- `hybrid = stop_gradient(replay) + (dense - stop_gradient(dense))`: replay's value, dense's
  gradient.
- `stock`: the same math written the common way (plain `x @ W`, attention over the live prefix,
  scores in the compute dtype): the baseline and negative control.
- `full_depth` and `expected` ignore the schedule (`SCHEDULE_UNAWARE`, the baselines of
  `experiments/mismatch_study.py`): loop T everywhere, and HF Ouro's mixture over exit loops.
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
from looprl.sampling.kv_policies import policy_named
from looprl.sampling.processing import process_logits
from looprl.sampling.sampler import SamplingConfig, generate

METHODS = typing.get_args(LogprobMethod)  # the config's choices: hybrid, replay, dense, stock, ...
SCHEDULE_UNAWARE = ("full_depth", "expected")  # learners that ignore the recorded schedule


def exit_hidden(model_cfg: OuroConfig, w, tokens_BxS, pad_B, exit_loop_BxS, kv_depth_BxS=None,
                *, stock: bool = False, remat: bool = True):
    """Teacher-forced loops (`teacher_forced_loops`); returns h at each position's exit loop
    `[B, S, D]` (zeros where exit_loop is 0).

    kv_depth_BxS: the KV policy's `learner_kv_depth`: None, every loop reads its own K/V; else
      at loop d position j reads the K/V of loop min(d, kv_depth_BxS[:, j]) (`copy`).
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
                                kv_depth_BxS=kv_depth_BxS, stock=stock, remat=remat,
                                unroll=False)


def expected_hidden(model_cfg: OuroConfig, w, tokens_BxS, pad_B, *, remat: bool = True):
    """`sum_t p_t h(t)` `[B, S, D]` fp32 over the T loops of a dense teacher-forced pass, with
    p_t the exit distribution of the gate (HF Ouro's `stacked_exit_pdf`: `p_t = lambda_t *
    remaining` for t < T, `p_T = remaining`). Differentiable in the gate and the stack, so the
    gate trains, as in HF. The lm_head is linear and bias-free (`sum_t p_t W h_t = W sum_t p_t
    h_t`), so `expected`'s mixture of logits is this mixture projected once."""
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
    kv_policy a name of `kv_policies.POLICIES`; method one of `METHODS`.
    Returns (logprob_BxS, logprob_processed_BxS) fp32.
    Raises: SamplingError for an unknown kv_policy, ValueError for an unknown method.
    """
    w = cast_weights(params, compute_dtype)
    kv_depth = policy_named(kv_policy).learner_kv_depth(kv_depth_BxS)
    stock = method == "stock"
    if method == "expected":  # the mixed hidden state and the lm_head in fp32
        h = expected_hidden(model_cfg, w, tokens_BxS, pad_B, remat=remat)
        w = {**w, "lm_head": w["lm_head"].astype(jnp.float32)}
    else:
        exits = exit_loop_BxS
        if method == "full_depth":  # loop T everywhere, dense KV: an ordinary forward
            exits = jnp.where(exit_loop_BxS > 0, model_cfg.total_ut_steps, 0)
            kv_depth = None
        h = exit_hidden(model_cfg, w, tokens_BxS, pad_B, exits, kv_depth, stock=stock,
                        remat=remat)
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
    """The live prefix S' of a `RolloutBatch` the learner's passes run on (the learner's
    `learner.seq_bucket`): P + the longest completion (stop token included) rounded up to a
    multiple of `bucket`, at most the layout's length S; S when `bucket` is 0 (off). Every
    emitting position and the token it emits lie inside it; bucketing bounds the compiled
    shapes to max_new_tokens / bucket + 1 lengths.

    The bits at every emitting position are those of the whole length: every pass is causal
    (position i reads positions <= i < S' only); the matmuls are row-invariant, so fewer rows
    change no row; in attention a query's live keys sit in the same slots of the same 128-key
    blocks at any key-axis length, and the cut changes masked slots only (each adds `0 * v` and
    0, which leave a running sum unchanged), with no dot's shape depending on the key-axis
    length (`looprl.kernels`; tests/logprobs/test_live_prefix.py checks the bits). The loss
    and gradient sum over S' positions, so they equal the whole length's to fp32 rounding only
    (a resumed run keeps its own `seq_bucket`)."""
    S, P = batch.schedule.seq_len, batch.schedule.prompt_len
    if bucket <= 0:
        return S
    longest = int(np.max(np.asarray(batch.completion_len_B), initial=1))
    return min(S, P + -(-max(longest, 1) // bucket) * bucket)


def batch_logprobs(cfg: OuroConfig, params, batch, method: str = "replay", rows=None,
                   remat: bool = False, mesh=None, seq_len: int | None = None):
    """Learner log-probs for rows `rows` of a `RolloutBatch` (all rows by default), as numpy.

    `seq_len`: run on the first `seq_len` positions (`live_seq_len`: the same bits at every
    emitting position) and pad the result back to S with zeros; default S, except for `stock`,
    whose default is the exact live prefix (P + the longest completion, as common code pads a
    batch). The learner passes its bucketed live prefix to every method, `stock` included, so a
    GRPO step compiles at most max_new_tokens / seq_bucket + 1 lengths of each pass (unbucketed,
    the stock control compiles again for each new longest completion). A stock pass's bits may
    depend on the key-axis length; it is the baseline, not a replay. A rollout sampled with
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
        # only (docs/DESIGN.md §1), never the LM that produced h (tests/rl/test_train_gate.py)
        z = gate_logits(w, jax.lax.stop_gradient(h))
        return jnp.where(emit, lp, 0.0), z

    # unrolled (a Python loop over T), the form this pass has always had: the scan form would
    # give other low bits, and so change every loop-credit and gate-training run
    return teacher_forced_loops(model_cfg, w, tokens_BxS, pad_B, readout=readout,
                                kv_depth_BxS=policy_named(kv_policy).learner_kv_depth(
                                    kv_depth_BxS), remat=remat, unroll=True)
