"""The sampler's and the learner's layer programs at a model's widths, as abstract shapes, for
compile-only targets (`targets.compile_for`).

A `Phase` is one program: the sampler's prefill (a chunk of P positions), a decode step (a
chunk of 1 position at some rows), a deferred window (a chunk of W positions), all reading the
KV cache in place at loop 1 (`layers.stack_pass`'s sampler form, weights sliced as bits); or
the learner's forward (one loop over S positions, `stack_pass`'s learner form) and its step
(forward and gradient of the selected-token log-prob sum). Each runs `cfg.num_layers` layers
(the caller sets it, e.g. 1), then the final norm, the exit gate and the LM head `[B, C, V]`
(the head's output and its selected-token log-prob, whose values the sampler and the learner
share). Parameters and inputs are ShapeDtypeStructs: nothing is allocated.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from looprl import kernels as kn
from looprl.model.config import OuroConfig
from looprl.model.layers import stack_pass
from looprl.model.looped import (cast_weights, exit_lambda, init_params, lm_logits,
                                 stacks_cast_once)


@dataclasses.dataclass(frozen=True)
class Phase:
    """One program's shapes: `kind` (`prefill`, `decode`, `window`, `learner_forward`,
    `learner_step`), B rows, a chunk of C positions over S cache slots."""
    kind: str
    B: int
    C: int
    S: int

    @property
    def label(self) -> str:
        return f"{self.kind}-B{self.B}-C{self.C}-S{self.S}"


def prefill(B: int, P: int) -> Phase:
    return Phase("prefill", B, P, P)


def decode(B: int, S: int) -> Phase:
    return Phase("decode", B, 1, S)


def window(B: int, W: int, S: int) -> Phase:
    return Phase("window", B, W, S)


def learner_forward(B: int, S: int) -> Phase:
    return Phase("learner_forward", B, S, S)


def learner_step(B: int, S: int) -> Phase:
    return Phase("learner_step", B, S, S)


@functools.cache
def abstract_weights(cfg: OuroConfig, dtype: str, layers: bool = False):
    """The compute-dtype weights `cast_weights` gives (with `layers`: the stacks cast too), as
    ShapeDtypeStructs."""
    return jax.eval_shape(lambda: cast_weights(init_params(cfg), jnp.dtype(dtype), layers))


def head(w, h_BxCxD, targets_BxC, stock: bool):
    """The LM head `[B, C, V]` fp32, its selected-token log-prob `[B, C]` and the exit gate's
    lambda `[B, C]` (the stock kernels with `stock`)."""
    logits = lm_logits(w, h_BxCxD, stock)
    logp = (jax.nn.log_softmax(logits, axis=-1) if stock else kn.log_softmax(logits))
    sel = jnp.take_along_axis(logp, targets_BxC[..., None], axis=-1)[..., 0]
    return logits, sel, exit_lambda(w, h_BxCxD, stock)


def _sampler(cfg, stock, w, x_BxCxD, k_cache, v_cache, pad_B, w0, targets_BxC):
    B, C, _ = x_BxCxD.shape
    layout = w0 + jnp.arange(C)
    positions = jnp.broadcast_to(layout[None] - pad_B[:, None], (B, C))
    write = layout[None] >= pad_B[:, None]
    h, k_w, v_w = stack_pass(cfg, w, x_BxCxD, positions, layout, pad_B, k_cache, v_cache,
                             write, w0, stock, bits=True, loop=jnp.int32(0))
    return head(w, h, targets_BxC, stock), k_w, v_w


def _learner(cfg, stock, w, x_BxSxD, pad_B, targets_BxS):
    B, S, _ = x_BxSxD.shape
    layout = jnp.arange(S)
    positions = jnp.broadcast_to(layout[None] - pad_B[:, None], (B, S))
    shape = (cfg.num_layers, B, S, cfg.num_kv_heads, cfg.head_dim)
    zeros = jnp.zeros(shape, x_BxSxD.dtype)
    h, _, _ = stack_pass(cfg, w, x_BxSxD, positions, layout, pad_B, zeros, zeros,
                         jnp.ones((B, S), bool), 0, stock)
    return head(w, h, targets_BxS, stock)


def _learner_step(cfg, stock, w, x_BxSxD, pad_B, targets_BxS):
    def loss(w):
        return jnp.sum(_learner(cfg, stock, w, x_BxSxD, pad_B, targets_BxS)[1])
    return jax.value_and_grad(loss)(w)


def build(cfg: OuroConfig, dtype: str, phase: Phase, stock: bool = False):
    """(fn, args): the program of `phase` at `cfg`'s widths and layer count in `dtype`
    (`float32` or `bfloat16`; the stock kernels with `stock`), with ShapeDtypeStruct args for
    `targets.compile_for`. The sampler phases take the weights as the sampler holds them under
    the form in force (`looped.stacks_cast_once`): build under the form it compiles for.
    Raises ValueError for an unknown phase kind."""
    sampler = phase.kind in ("prefill", "decode", "window")
    w = abstract_weights(cfg, dtype, sampler and stacks_cast_once())
    dt = jnp.dtype(dtype)
    sds = jax.ShapeDtypeStruct
    B, C, S = phase.B, phase.C, phase.S
    x = sds((B, C, cfg.hidden_size), dt)
    pad = sds((B,), jnp.int32)
    targets = sds((B, C), jnp.int32)
    if sampler:
        cache = sds((1, cfg.num_layers, B, S, cfg.num_kv_heads, cfg.head_dim), dt)
        w0 = sds((), jnp.int32)
        fn = functools.partial(_sampler, cfg, stock)
        return fn, (w, x, cache, cache, pad, w0, targets)
    if phase.kind == "learner_forward":
        return functools.partial(_learner, cfg, stock), (w, x, pad, targets)
    if phase.kind == "learner_step":
        return functools.partial(_learner_step, cfg, stock), (w, x, pad, targets)
    raise ValueError(f"unknown phase kind {phase.kind!r}")
