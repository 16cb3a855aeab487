"""The GRPO learner's optimizer: AdamW with global-norm clipping and a learning-rate schedule, the
exit gate frozen unless trained, and the jitted update and gradient sum that donate their inputs.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from looprl.config import ExperimentConfig
from looprl.kernels import global_norm


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """`optax.clip_by_global_norm` (same arithmetic: leaves scaled by `max_norm / norm` when the
    norm reaches `max_norm`) with the norm from `looprl.kernels.global_norm`, ordered on
    `cpu-ordered` so that the clipped update does not depend on the ISA."""
    def update_fn(updates, state, params=None):
        del params
        g_norm = global_norm(updates)
        trigger = jnp.squeeze(g_norm < max_norm)
        return jax.tree.map(lambda t: jax.lax.select(
            trigger, t, (t / g_norm.astype(t.dtype)) * max_norm), updates), state
    return optax.GradientTransformation(optax.init_empty_state, update_fn)


def make_optimizer(exp_cfg: ExperimentConfig, params) -> optax.GradientTransformation:
    """AdamW + global-norm clipping + learning-rate schedule over `params`' tree. The exit
    gate's update is zeroed (exit decisions are replayed, never re-decided: docs/DESIGN.md §3)
    unless `learner.train_gate`, or the learner is `expected`, whose log-probs train the gate
    through the exit distribution (as HF Ouro's forward with labels does)."""
    o = exp_cfg.optim
    total = max(1, exp_cfg.run.grpo_steps * exp_cfg.learner.ppo_epochs
                * exp_cfg.learner.minibatches)
    if o.lr_schedule == "constant":
        lr = optax.constant_schedule(o.learning_rate)
    elif o.lr_schedule == "cosine":
        lr = optax.cosine_decay_schedule(o.learning_rate, max(1, total - o.warmup_steps))
    else:
        lr = optax.linear_schedule(o.learning_rate, 0.0, max(1, total - o.warmup_steps))
    if o.warmup_steps:
        lr = optax.join_schedules([optax.linear_schedule(0.0, o.learning_rate, o.warmup_steps),
                                   lr], [o.warmup_steps])
    parts = []
    if o.max_grad_norm > 0:
        parts.append(clip_by_global_norm(o.max_grad_norm))
    parts.append(optax.adamw(lr, b1=o.adam_b1, b2=o.adam_b2, eps=o.adam_eps,
                             weight_decay=o.weight_decay))
    train = optax.chain(*parts)
    gate_trains = exp_cfg.learner.train_gate or exp_cfg.learner.logprob_method == "expected"
    labels = {k: jax.tree.map(lambda _: "frozen" if (k == "early_exit_gate"
                                                      and not gate_trains)
                              else "train", v) for k, v in params.items()}
    return optax.multi_transform({"train": train, "frozen": optax.set_to_zero()}, labels)


@functools.partial(jax.jit, static_argnames=("opt",),
                   donate_argnames=("params", "opt_state"))
def apply_update(params, opt_state, grads, *, opt):
    """(params, opt_state, global gradient norm) after one optax update, in place: the old
    parameters and moments are donated, so an update needs no second copy of the train state."""
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, global_norm(grads)


@functools.partial(jax.jit, donate_argnames=("total",))
def accumulate_grads(total, grads):
    """`total + grads` leaf by leaf, written into `total`'s buffers (donated)."""
    return jax.tree.map(jnp.add, total, grads)


def nonfinite_leaves(tree) -> list[str]:
    """Paths of the leaves of `tree` holding a NaN or inf."""
    bad = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not bool(jnp.all(jnp.isfinite(leaf))):
            bad.append(jax.tree_util.keystr(path))
    return bad
