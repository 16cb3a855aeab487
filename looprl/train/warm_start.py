"""Supervised warm start of a tiny looped model on task solutions (docs/DESIGN.md §1).

Stage I trains the LM and the exit gate with Ouro's loss `sum_t p_t CE_t - beta H(p)`
(`looprl.rl.grpo.exit_stage1_loss`) on prompt + solution sequences, the loss counting the
solution tokens and the end-of-turn id 2 (docs/DESIGN.md §3 alignment: position i predicts token
i + 1). Stage II freezes the LM and trains only `params["early_exit_gate"]` with the stage-II
gate loss (`looprl.rl.grpo.gate_stage2_loss`). Both use optax AdamW and one jitted step each.

Per-loop logits are built for all T loops at once (`[T, B, S, V]`), fine for the tiny model
this is meant for (vocab 64), in fp32. On the ordered CPU form every product, forward and
backward, is an ordered kernel, so the trained weights do not depend on the ISA
(docs/NUMERICS.md, "The whole CPU run"); elsewhere the forward uses the `stock` kernels.

With `eval_fn` and `eval_every`, stage I also records held-out accuracy and stops once it has
plateaued (`plateaued`: the last fifth of the curve gains less than `plateau_min_gain` over the
best before it, judged from `plateau_min_evals` points).
"""
from __future__ import annotations

import functools
import math
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from looprl import kernels as kn
from looprl.model.config import OuroConfig
from looprl.model.looped import (cast_weights, exit_distribution, gate_logits, next_token_targets,
                                 teacher_forced_loops)
from looprl.rl.grpo import exit_stage1_loss, gate_stage2_loss
from looprl.tokenizer import END_OF_TURN_ID, PAD_ID

_SEQ_BUCKET = 16


def loop_outputs(model_cfg: OuroConfig, w: dict, tokens_BxS, pad_B=None,
                 stock: bool | None = None):
    """Every loop's logits `[T, B, S, V]` fp32 and gate logits `[T, B, S]` fp32 (not lambda:
    the stage-II loss takes log-sigmoids of the logit, exact where lambda saturates), from the
    unrolled `teacher_forced_loops` (the form this warm start always had: the main job's
    parameters depend on its bits). `stock` default: not on the ordered CPU form."""
    if stock is None:
        stock = kn.current_form().name != "cpu-ordered"

    def readout(h, d):
        if not stock:
            return kn.matmul(h, w["lm_head"], jnp.float32), gate_logits(w, h)
        return (jnp.einsum("bsd,dv->bsv", h, w["lm_head"], preferred_element_type=jnp.float32),
                gate_logits(w, h))

    return teacher_forced_loops(model_cfg, w, tokens_BxS, pad_B, readout=readout, stock=stock,
                                unroll=True)


def per_loop_ce(logits_TxBxSxV, tokens_BxS):
    """Cross-entropy `[T, B, S]` fp32 of tokens[:, i + 1] at position i (0 at the last one)."""
    target = next_token_targets(tokens_BxS)
    logp = jax.nn.log_softmax(logits_TxBxSxV.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, target[None, :, :, None], axis=-1)[..., 0]


def supervised_batch(task, tokenizer, problems, seq_len: int | None = None):
    """Right-padded `[B, S]` int32 prompt + solution + end-of-turn sequences and the loss mask
    `[B, S]` fp32 (1 at positions whose next token is a solution token or the end of turn).
    S is the longest sequence rounded up to a multiple of 16 unless `seq_len` is given
    (longer sequences are cut)."""
    seqs, starts = [], []
    for p in problems:
        prompt = tokenizer.encode(task.format_prompt(p))
        sol = tokenizer.encode(task.solution_text(p)) + [END_OF_TURN_ID]
        seqs.append(prompt + sol)
        starts.append(len(prompt))
    S = seq_len or _SEQ_BUCKET * math.ceil(max(len(s) for s in seqs) / _SEQ_BUCKET)
    tokens = np.full((len(seqs), S), PAD_ID, np.int32)
    mask = np.zeros((len(seqs), S), np.float32)
    for b, (s, p0) in enumerate(zip(seqs, starts)):
        s = s[:S]
        tokens[b, :len(s)] = s
        mask[b, p0 - 1:len(s) - 1] = 1.0   # position i predicts token i + 1
    return tokens, mask


def _losses(cfg, params, tokens):
    """(per-loop CE `[T, B, S]`, gate logits `[T, B, S]`), fp32."""
    w = cast_weights(params, jnp.float32)
    logits, gate_z = loop_outputs(cfg, w, tokens)
    return per_loop_ce(logits, tokens), gate_z


@functools.partial(jax.jit, static_argnames=("cfg", "opt", "entropy_beta"))
def _stage1_step(params, opt_state, tokens, mask, *, cfg, opt, entropy_beta):
    def loss_fn(p):
        ce, gate_z = _losses(cfg, p, tokens)
        probs = exit_distribution(jax.nn.sigmoid(gate_z))
        return exit_stage1_loss(ce, probs, mask, entropy_beta=entropy_beta), ce

    (loss, ce), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    n = jnp.maximum(jnp.sum(mask), 1.0)
    ce_last = jnp.sum(ce[-1] * mask) / n
    return params, opt_state, loss, ce_last


@functools.partial(jax.jit, static_argnames=("cfg", "opt"))
def _stage2_step(gate, opt_state, frozen, tokens, mask, *, cfg, opt):
    def loss_fn(g):
        ce, gate_z = _losses(cfg, {**frozen, "early_exit_gate": g}, tokens)
        return gate_stage2_loss(ce, mask, gate_logits_TxBxS=gate_z)

    loss, grads = jax.value_and_grad(loss_fn)(gate)
    updates, opt_state = opt.update(grads, opt_state, gate)
    return optax.apply_updates(gate, updates), opt_state, loss


def plateaued(curve: list[dict], last_fraction: float = 0.2, min_gain: float = 0.02,
              min_points: int = 5) -> bool:
    """True when the best accuracy of the last `last_fraction` of the curve (by step) beats the
    best before it by less than `min_gain`; False with fewer than `min_points` points."""
    pts = [(c["step"], c["accuracy"]) for c in curve if c.get("accuracy") is not None]
    if len(pts) < min_points:
        return False
    last_step = pts[-1][0]
    cut = last_step * (1.0 - last_fraction)
    before = [a for s, a in pts if s < cut]
    after = [a for s, a in pts if s >= cut]
    if not before or not after:
        return False
    return max(after) - max(before) < min_gain


def warm_start(model_cfg: OuroConfig, params: dict, task, tokenizer, *, steps: int,
               batch_size: int, learning_rate: float, seed: int, gate_steps: int,
               gate_learning_rate: float = 1e-3, entropy_beta: float = 0.0, eval_fn=None,
               eval_every: int = 0, log: Callable[[dict], Any] | None = None,
               plateau_last_fraction: float = 0.2, plateau_min_gain: float = 0.02,
               plateau_min_evals: int = 5, warmup_steps: int = 0, first_problem: int = 0,
               progress: Callable[[int], Any] | None = None,
               stage1_done: Callable[[int], Any] | None = None) -> tuple[dict, dict]:
    """Stage I (LM + gate, Ouro loss) for up to `steps` AdamW steps, then stage II (gate only)
    for `gate_steps`. Train problems are taken in order from `task.train_problem(first_problem)`
    on, `batch_size` per step (stage II continues the stream). `seed` seeds nothing random yet
    (the data order is the stream's) but is recorded.

    Args:
      eval_fn: optional `eval_fn(params) -> accuracy` (a fraction), called every `eval_every`
        stage-I steps and at the end of stage I; stage I stops early once `plateaued`.
      log: optional callable receiving one dict per logged event.
      progress: optional `progress(n)`, called after every stage-I and stage-II step with 1.
      stage1_done: optional `stage1_done(n)`, called once when stage I ends, with the n steps it
        ran (fewer than `steps` when it plateaued).

    Returns:
      (new fp32 params, report) with `stage1_steps`, `stage1_final_loss`, `stage2_steps`,
      `stage2_final_loss`, `curve` (list of {step, loss, [accuracy]}), `gate_curve`,
      `plateaued` (bool), `wall_s`.
    """
    t0 = time.time()
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
    if warmup_steps > 0:
        lr = optax.linear_schedule(0.0, learning_rate, warmup_steps)
    else:
        lr = learning_rate
    opt = optax.adamw(lr, weight_decay=0.0)
    opt_state = opt.init(params)
    position = first_problem
    curve: list[dict] = []
    loss = float("nan")
    did_plateau = False
    step = 0
    window: list[float] = []
    for step in range(1, steps + 1):
        problems = task.train_problems(batch_size, position)
        position += batch_size
        tokens, mask = supervised_batch(task, tokenizer, problems)
        params, opt_state, loss_a, ce_last = _stage1_step(
            params, opt_state, jnp.asarray(tokens), jnp.asarray(mask), cfg=model_cfg, opt=opt,
            entropy_beta=float(entropy_beta))
        window.append(float(loss_a))
        if progress is not None:
            progress(1)
        do_eval = eval_fn is not None and eval_every > 0 and (step % eval_every == 0
                                                              or step == steps)
        if do_eval or step == steps or step % 50 == 0:
            loss = float(np.mean(window))
            if not math.isfinite(loss):
                raise FloatingPointError(f"warm start stage I: loss is {loss} at step {step}")
            point = {"step": step, "loss": loss, "ce_last_loop": float(ce_last)}
            window = []
            if do_eval:
                point["accuracy"] = float(eval_fn(params))
            curve.append(point)
            if log is not None:
                log({"stage": 1, **point})
            if do_eval and plateaued(curve, plateau_last_fraction, plateau_min_gain,
                                     plateau_min_evals):
                did_plateau = True
                break
    stage1_steps = step
    if stage1_done is not None:
        stage1_done(stage1_steps)

    frozen = {k: v for k, v in params.items() if k != "early_exit_gate"}
    gate = params["early_exit_gate"]
    gopt = optax.adamw(gate_learning_rate, weight_decay=0.0)
    gstate = gopt.init(gate)
    gate_curve: list[dict] = []
    gloss = float("nan")
    for gstep in range(1, gate_steps + 1):
        problems = task.train_problems(batch_size, position)
        position += batch_size
        tokens, mask = supervised_batch(task, tokenizer, problems)
        gate, gstate, gl = _stage2_step(gate, gstate, frozen, jnp.asarray(tokens),
                                        jnp.asarray(mask), cfg=model_cfg, opt=gopt)
        if progress is not None:
            progress(1)
        if gstep % 25 == 0 or gstep == gate_steps:
            gloss = float(gl)
            if not math.isfinite(gloss):
                raise FloatingPointError(f"warm start stage II: loss is {gloss} at step {gstep}")
            gate_curve.append({"step": gstep, "loss": gloss})
            if log is not None:
                log({"stage": 2, "step": gstep, "loss": gloss})
    params = {**frozen, "early_exit_gate": gate}
    report = {"stage1_steps": stage1_steps, "stage1_final_loss": loss,
              "stage2_steps": gate_steps, "stage2_final_loss": gloss, "curve": curve,
              "gate_curve": gate_curve, "plateaued": did_plateau, "batch_size": batch_size,
              "learning_rate": learning_rate, "gate_learning_rate": gate_learning_rate,
              "entropy_beta": entropy_beta, "seed": seed, "problems_used": position - first_problem,
              "wall_s": time.time() - t0}
    return params, report
