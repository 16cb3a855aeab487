"""The looped language model (Ouro): shared stack applied T times, exit gate, exit distribution.

docs/DESIGN.md §1. h0 = Emb(ids); for t = 1..T: h(t) = N_final(stack(h(t-1))); logits_t =
W_lm h(t); lambda_t = sigmoid(w . h(t) + b). Exit distribution p_t = lambda_t prod_{j<t}(1 -
lambda_j) for t < T, p_T the remainder; Q-exit: exit at min{t : CDF(t) >= q} with CDF the
running sum of p_t in fp32 (Ouro's reference code); q = 1.0 means loop T unconditionally.

Parameters live in an NNX module (`LoopedLM`) in fp32 (master weights). The forward functions
are pure functions of a weights dict cast to the compute dtype (`cast_weights`), so that the
sampler, the learner and the tests share one implementation.
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from looprl.errors import CheckpointError
from looprl import kernels as kn
from looprl.model.config import OuroConfig
from looprl.model.layers import LAYER_KEYS, stack_pass


class LayerStack(nnx.Module):
    """The L shared decoder layers, stacked: each Linear kernel `[L, in, out]`, norms `[L, D]`."""

    def __init__(self, cfg: OuroConfig, rngs: nnx.Rngs):
        L, D, F = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        shapes = {"q_proj": (D, q), "k_proj": (D, kv), "v_proj": (D, kv), "o_proj": (q, D),
                  "gate_proj": (D, F), "up_proj": (D, F), "down_proj": (F, D)}
        init = nnx.initializers.normal(0.02)
        for name, (i, o) in shapes.items():
            setattr(self, name, nnx.Param(init(rngs.params(), (L, i, o), jnp.float32)))
        for name in LAYER_KEYS[7:]:
            setattr(self, name, nnx.Param(jnp.ones((L, D), jnp.float32)))


class ExitGate(nnx.Module):
    """`lambda_t = sigmoid(h(t) @ kernel + bias)`; kernel `[D, 1]`, bias `[1]`, fp32."""

    def __init__(self, cfg: OuroConfig, rngs: nnx.Rngs):
        self.kernel = nnx.Param(nnx.initializers.normal(0.02)(
            rngs.params(), (cfg.hidden_size, 1), jnp.float32))
        self.bias = nnx.Param(jnp.zeros((1,), jnp.float32))


class ModelOutput(NamedTuple):
    """Inspection output: `logits` `[T, B, S, V]` fp32 and `exit_lambda` `[T, B, S]` fp32."""
    logits: jax.Array
    exit_lambda: jax.Array


class LoopedLM(nnx.Module):
    """Ouro-style looped decoder with fp32 master parameters.

    Calling the module, `model(tokens_BxS)` with int32 `[B, S]` (no padding), returns a
    `ModelOutput` with every loop's logits `[T, B, S, V]` (an inspection API; training never
    builds all loops' logits). `compute_dtype` (float32 or bfloat16) is the dtype the forward
    runs in; parameters stay fp32.
    """

    def __init__(self, cfg: OuroConfig, *, rngs: nnx.Rngs, compute_dtype=jnp.float32):
        self.cfg = cfg
        self.compute_dtype = jnp.dtype(compute_dtype)
        self.embed_tokens = nnx.Param(nnx.initializers.normal(0.02)(
            rngs.params(), (cfg.vocab_size, cfg.hidden_size), jnp.float32))
        self.layers = LayerStack(cfg, rngs)
        self.norm = nnx.Param(jnp.ones((cfg.hidden_size,), jnp.float32))
        self.early_exit_gate = ExitGate(cfg, rngs)
        self.lm_head = nnx.Param(nnx.initializers.normal(0.02)(
            rngs.params(), (cfg.hidden_size, cfg.vocab_size), jnp.float32))

    def weights(self) -> dict:
        """The parameters as a plain nested dict of fp32 arrays (see `param_dict`)."""
        return param_dict(self)

    def __call__(self, tokens_BxS: jax.Array) -> ModelOutput:
        return _inspect_forward(self.cfg, self.compute_dtype.name, self.weights(),
                                jnp.asarray(tokens_BxS, jnp.int32))


def _inspect_forward_impl(cfg: OuroConfig, dtype: str, weights: dict, tokens_BxS):
    return all_loop_outputs(cfg, cast_weights(weights, dtype), tokens_BxS)


# `LoopedLM.__call__` as one compiled program per (config, dtype, token shape): a second call at
# the same shape reuses it (op by op, the `load_hf` model is no faster the second time)
_inspect_forward = jax.jit(_inspect_forward_impl, static_argnums=(0, 1))


def device_params(params: dict) -> dict:
    """Put a nested parameter dict on the default device, leaf by leaf and **in place**: each
    numpy leaf is replaced by its `jax.Array` as soon as it is copied, so the host copy can be
    freed before the next leaf moves (peak: the tree plus one leaf, not two trees). jax-array
    leaves are kept. Returns `params` (the same dict). Callers that sample or evaluate many
    times do this once, so no compiled call receives numpy parameters (a host-to-device copy
    per call off the CPU, and a fingerprint pass per call: numpy trees are not cached)."""
    for k in list(params):  # keys only: a list of the items would keep every host leaf alive
        if isinstance(params[k], dict):
            device_params(params[k])
        elif not isinstance(params[k], jax.Array):
            # device_put is asynchronous and the pending copy keeps the host leaf alive: wait
            # for it, so that it is freed before the next leaf moves
            params[k] = jax.block_until_ready(jax.device_put(params[k]))
    return params


def param_dict(model: LoopedLM) -> dict:
    """`{embed_tokens, layers: {q_proj, ...}, norm, early_exit_gate: {kernel, bias}, lm_head}`."""
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def init_params(cfg: OuroConfig, seed: int = 0) -> dict:
    """Freshly initialised fp32 parameter dict for `cfg` (normal(0.02) kernels, unit norms)."""
    return param_dict(LoopedLM(cfg, rngs=nnx.Rngs(seed)))


def cast_weights(params: dict, dtype, layers: bool = False) -> dict:
    """Compute-dtype view of the fp32 master weights; the exit gate stays fp32 (docs/DESIGN.md
    §2).

    The layer stacks (`w["layers"]`) are passed on as stored: `layers.stack_pass` casts each
    layer to the compute dtype (that of `w["norm"]`) inside its loop, the same values. A cast
    stack would be a second copy of every layer (2 B per parameter in bf16), which XLA CPU also
    widens to fp32 (4 B) before slicing it, and in a gradient pass a third, the bf16 gradient
    of the stack. With `layers` the stacks are cast here, once: the accelerator sampler's
    choice, where a layer pass would otherwise read 4 B and write 2 B per parameter of its
    layer every loop of every decode step. The values are the same either way."""
    dtype = jnp.dtype(dtype)
    out = jax.tree.map(lambda a: a.astype(dtype), {k: v for k, v in params.items()
                                                   if k not in ("early_exit_gate", "layers")})
    out["layers"] = (jax.tree.map(lambda a: a.astype(dtype), params["layers"]) if layers
                     else params["layers"])
    out["early_exit_gate"] = jax.tree.map(lambda a: a.astype(jnp.float32),
                                          params["early_exit_gate"])
    return out


def stacks_cast_once() -> bool:
    """Whether the sampler casts the layer stacks to the compute dtype once per call (a form
    on an accelerator: no cast per layer pass), not per layer pass (the CPU forms:
    `cast_weights`). The same values either way."""
    return not kn.current_form().cpu


def embed(w: dict, tokens):
    """The rows of `w["embed_tokens"]` `[V, D]` at `tokens` (int `[...]`): `[..., D]`."""
    return _take_rows(w["embed_tokens"], tokens)


@jax.custom_jvp
def _take_rows(table_VxD, tokens):
    """`table_VxD[tokens]`, a 2-byte float table gathered as its uint16 bits: XLA CPU's float
    normalization gathers a bf16 table in fp32, widening the whole table first, and that copy,
    loop-invariant, is hoisted out of the decode loop (0.4 GB at Ouro-1.4B's vocabulary). A
    gather moves bits, so the rows are the same bits either way. Differentiable: the
    tangent is the plain gather of the table's tangent."""
    if table_VxD.dtype.itemsize != 2:
        return jnp.take(table_VxD, tokens, axis=0)
    bits = jax.lax.bitcast_convert_type(table_VxD, jnp.uint16)
    return jax.lax.bitcast_convert_type(jnp.take(bits, tokens, axis=0), table_VxD.dtype)


@_take_rows.defjvp
def _take_rows_jvp(primals, tangents):
    table_VxD, tokens = primals
    return _take_rows(table_VxD, tokens), jnp.take(tangents[0], tokens, axis=0)


def exit_lambda(w: dict, h_BxCxD, stock: bool = False):
    """Gate `lambda = sigmoid(h . w + b)` in fp32, `[B, C]`."""
    mm = kn.stock_matmul if stock else kn.matmul
    g = w["early_exit_gate"]
    z = kn.add_last(mm(h_BxCxD.astype(jnp.float32), g["kernel"]), g["bias"])[..., 0]
    return jax.nn.sigmoid(z)


def lm_logits(w: dict, h_BxCxD, stock: bool = False):
    """`W_lm h` with fp32 accumulation and output, `[B, C, V]`."""
    mm = kn.stock_matmul if stock else kn.matmul
    return mm(h_BxCxD, w["lm_head"], out_dtype=jnp.float32)


def exit_distribution(lambda_TxBxS):
    """p_t = lambda_t prod_{j<t}(1 - lambda_j) for t < T; p_T = prod_{j<T}(1 - lambda_j).
    Returns `[T, B, S]` fp32 summing to 1 over T (up to rounding)."""
    lam = lambda_TxBxS.astype(jnp.float32)
    T = lam.shape[0]
    surv = jnp.ones_like(lam[0])
    ps = []
    for t in range(T):
        if t == T - 1:
            ps.append(surv)
        else:
            ps.append(lam[t] * surv)
            surv = surv * (1.0 - lam[t])
    return jnp.stack(ps)


class ExitState(NamedTuple):
    """Running Q-exit state per row: CDF so far and survival prod(1 - lambda_j), fp32."""
    cdf: jax.Array
    survival: jax.Array


def exit_state_init(shape) -> ExitState:
    return ExitState(jnp.zeros(shape, jnp.float32), jnp.ones(shape, jnp.float32))


def exit_state_update(state: ExitState, lam, t: int | jax.Array, T: int):
    """Fold loop t's (1-based) gate value in; returns (state, p_t). p_T is the remainder."""
    last = jnp.asarray(t) >= T
    p = jnp.where(last, state.survival, lam * state.survival)
    return ExitState(state.cdf + p, state.survival * (1.0 - lam)), p


def q_exit_decision(cdf, t, T: int, q: float):
    """True where the Q-exit rule exits at loop t (1-based): CDF(t) >= q, or t == T.
    q = 1.0 never exits before T (a saturated gate would otherwise make CDF round to 1)."""
    t = jnp.asarray(t)
    if q >= 1.0:
        return jnp.broadcast_to(t >= T, jnp.shape(cdf))
    return (cdf >= jnp.float32(q)) | (t >= T)


def q_exit_loops(lambda_TxBxS, q: float):
    """Exit loop (1..T, int32) of every position by the Q-exit rule: min{t : CDF(t) >= q}."""
    T = lambda_TxBxS.shape[0]
    state = exit_state_init(lambda_TxBxS.shape[1:])
    exit_loop = jnp.zeros(lambda_TxBxS.shape[1:], jnp.int32)
    for t in range(1, T + 1):
        state, _ = exit_state_update(state, lambda_TxBxS[t - 1].astype(jnp.float32), t, T)
        hit = q_exit_decision(state.cdf, t, T, q) & (exit_loop == 0)
        exit_loop = jnp.where(hit, t, exit_loop)
    return exit_loop


@dataclasses.dataclass(frozen=True)
class Layout:
    """Left-padded token layout of a batch: row b's tokens occupy [pad_b, S)."""
    pad_B: jax.Array

    def positions(self, S: int):
        """RoPE positions `[B, S]`: layout index minus padding, 0 on padding."""
        return jnp.maximum(jnp.arange(S)[None, :] - self.pad_B[:, None], 0)


def next_token_targets(tokens_BxS):
    """The token each position emits, `[B, S]`: tokens[:, i + 1] at position i and 0 at the last
    position (docs/DESIGN.md §3 alignment: position i emits token i + 1)."""
    B = tokens_BxS.shape[0]
    return jnp.concatenate([tokens_BxS[:, 1:], jnp.zeros((B, 1), tokens_BxS.dtype)], axis=1)


def gate_logits(w: dict, h_BxSxD):
    """Exit-gate logit `h . w + b` `[B, S]` fp32, as one einsum: the training losses' form (the
    stage-I/II losses take log-sigmoids of the logit, exact where lambda saturates). Not the
    sampler's: `exit_lambda` computes the gate with the invariant `matmul`, whose bits the Q-exit
    rule depends on; the two differ in low bits."""
    g = w["early_exit_gate"]
    if kn.current_form().name == "cpu-ordered":  # an ordered chain: free of the ISA
        z = kn.matmul(h_BxSxD.astype(jnp.float32), g["kernel"].astype(jnp.float32))
        return kn.add_last(z, g["bias"].astype(jnp.float32))[..., 0]
    return jnp.einsum("bsd,d->bs", h_BxSxD.astype(jnp.float32), g["kernel"][:, 0]) + g["bias"][0]


def teacher_forced_loops(model_cfg: OuroConfig, w: dict, tokens_BxS, pad_B=None, *,
                         readout=None, fold=None, init=None, kv_depth_BxS=None,
                         stock: bool = False, remat: bool = False, unroll: bool = False):
    """The T loops of a teacher-forced pass over a whole (left-padded) sequence: the one loop
    every learner pass, the warm start and the inspection forward run.

    h(0) = Emb(tokens); for d = 1..T: h(d) = `stack_pass(h(d-1))` as one chunk of S positions,
    then `y_d = readout(h(d), d)` and, with `fold`, `carry = fold(carry, h(d), y_d, d)` from
    `carry = init(h(0))`. `d` is 1-based: an int32 scalar under the scan, a Python int unrolled.

    Args:
      w: compute-dtype weights (`cast_weights`); tokens_BxS int32; pad_B int32 `[B]` left
        padding (default 0).
      kv_depth_BxS: the KV policy's `learner_kv_depth` (`looprl.sampling.kv_policies`): None,
        every loop's own K/V; given, at loop d position j's K/V are those of loop
        min(d, kv_depth_j).
      stock: the `stock` kernels in the stack.
      remat: `jax.checkpoint` each loop's stack pass and readout (the backward recomputes them:
        memory O(1 loop) instead of O(T)); `fold` stays outside the rematerialised region.
      unroll: False: a `lax.scan` over the loops (an XLA while loop), each loop's input h read
        from memory as in the sampler's loop-by-loop while loop; the learner's form (see
        `looprl.logprobs.methods.exit_hidden` for why: the unrolled form rounds differently at
        L = 1). True: a Python loop (T copies of the loop in the program).
    Returns: fold's final carry if `fold` is given, else the readouts stacked on a leading T axis
      (a pytree like readout's; None without a readout). The two forms (scan, unrolled) compute
      the same math but are different programs: their bits may differ.
    """
    B, S = tokens_BxS.shape
    T = model_cfg.total_ut_steps
    pad_B = jnp.zeros((B,), jnp.int32) if pad_B is None else pad_B
    positions = Layout(pad_B).positions(S)
    layout = jnp.arange(S)
    kv_shape = (model_cfg.num_layers, B, S, model_cfg.num_kv_heads, model_cfg.head_dim)
    dt = w["embed_tokens"].dtype
    copy_kv = kv_depth_BxS is not None

    def one_loop(h, k_prev, v_prev, d):
        write = (d <= kv_depth_BxS) if copy_kv else jnp.ones((B, S), bool)
        k_in = k_prev if copy_kv else jnp.zeros(kv_shape, dt)
        v_in = v_prev if copy_kv else jnp.zeros(kv_shape, dt)
        h, k_new, v_new = stack_pass(model_cfg, w, h, positions, layout, pad_B, k_in, v_in,
                                     write, 0, stock)
        return h, k_new, v_new, None if readout is None else readout(h, d)

    if remat:
        one_loop = jax.checkpoint(one_loop, static_argnums=(3,) if unroll else ())

    def step(state, d):
        h, carry, k, v = state
        h, k_new, v_new, y = one_loop(h, k, v, d)
        if copy_kv:
            k, v = k_new, v_new
        if fold is not None:
            carry, y = fold(carry, h, y, d), None
        return (h, carry, k, v), y

    h = embed(w, tokens_BxS)
    if unroll:
        kv0 = jnp.zeros(kv_shape, dt) if copy_kv else None
    else:  # the scan's carry needs arrays
        kv0 = jnp.zeros(kv_shape, dt) if copy_kv else jnp.zeros((), dt)
    state = (h, None if init is None else init(h), kv0, kv0)
    if unroll:
        ys = []
        for d in range(1, T + 1):
            state, y = step(state, d)
            ys.append(y)
        ys = None if fold is not None or readout is None else jax.tree.map(
            lambda *a: jnp.stack(a), *ys)
    else:
        state, ys = jax.lax.scan(step, state, jnp.arange(1, T + 1, dtype=jnp.int32))
    return state[1] if fold is not None else ys


def all_loop_outputs(model_cfg: OuroConfig, w: dict, tokens_BxS, pad_B=None) -> ModelOutput:
    """Every loop's logits `[T, B, S, V]` fp32 and gate `[T, B, S]` (inspection only; unrolled
    `teacher_forced_loops` with the invariant kernels)."""
    logits, lams = teacher_forced_loops(
        model_cfg, w, tokens_BxS, pad_B, unroll=True,
        readout=lambda h, d: (lm_logits(w, h), exit_lambda(w, h)))
    return ModelOutput(logits, lams)


# The key path of every parameter leaf, whatever the config (the `param_dict` layout)
PARAM_PATHS = (("early_exit_gate", "bias"), ("early_exit_gate", "kernel"), ("embed_tokens",),
               *(("layers", k) for k in sorted(LAYER_KEYS)), ("lm_head",), ("norm",))


def expected_param_shapes(cfg: OuroConfig) -> dict[str, Any]:
    """The parameter dict layout of `cfg` as a nested dict of `jax.ShapeDtypeStruct` (fp32),
    from an abstract `LoopedLM` (no arrays are allocated)."""
    abstract = nnx.eval_shape(lambda: LoopedLM(cfg, rngs=nnx.Rngs(0)))
    return nnx.to_pure_dict(nnx.state(abstract, nnx.Param))


def check_param_tree(params: dict[str, Any], cfg: OuroConfig, source: str = "parameters"):
    """Raise CheckpointError naming the leaf if `params` does not have `cfg`'s layout
    (a missing or unexpected leaf, or a shape other than expected)."""
    template = expected_param_shapes(cfg)
    flat_t = dict(jax.tree_util.tree_flatten_with_path(template)[0])
    flat_p = dict(jax.tree_util.tree_flatten_with_path(params)[0])
    for path, leaf in flat_t.items():
        name = jax.tree_util.keystr(path)
        if path not in flat_p:
            raise CheckpointError(f"{source}: parameter {name} missing (expected shape "
                                  f"{list(leaf.shape)})")
        if tuple(np.shape(flat_p[path])) != tuple(leaf.shape):
            raise CheckpointError(f"{source}: parameter {name} has shape "
                                  f"{list(np.shape(flat_p[path]))}, expected {list(leaf.shape)}")
    extra = sorted(jax.tree_util.keystr(p) for p in flat_p if p not in flat_t)
    if extra:
        raise CheckpointError(f"{source}: unexpected parameter {extra[0]}")


def model_from_params(params: dict[str, Any], cfg: OuroConfig, dtype="float32"):
    """A `LoopedLM` holding `params` cast to `dtype`, with `compute_dtype = dtype`.

    The module is built abstractly (`nnx.eval_shape`, no random init) and every Param is then
    filled from `params`; a missing or misshapen leaf is a CheckpointError.
    """
    check_param_tree(params, cfg)
    dt = jnp.dtype(dtype)
    abstract = nnx.eval_shape(lambda: LoopedLM(cfg, rngs=nnx.Rngs(0), compute_dtype=dt))
    graphdef, state = nnx.split(abstract)
    filled = jax.tree.map(lambda t, p: jnp.asarray(np.asarray(p), dtype=dt),
                          nnx.to_pure_dict(state), params)
    nnx.replace_by_pure_dict(state, filled)
    return nnx.merge(graphdef, state)
