"""The device check's speed figures: named (candidate, baseline) pairs, each timed side by side.

A pair builds its two jitted functions and their arguments at the check's sizes; the item
records both medians (ms) and their ratio, and where the pair has a target, whether the ratio
meets it. The `_vs_stock` pairs put looprl's kernel form in force against the stock kernels
(plain XLA dots, attention over the live prefix), looprl's own negative control. The `_vs_fair`
pairs put looprl's learner and decode programs (`looprl.aot.programs`) against what a user
would run (`looprl.aot.fair`: XLA's dots, jax's Pallas flash and paged attention), compiled
with XLA's defaults in place of looprl's GPU pins (`FAIR_GPU_OPTIONS`, per compile; the
process's `NVIDIA_TF32_OVERRIDE` stays, and touches no bf16 dot). jax's Pallas GPU and TPU
kernels do not run on the CPU: there, and in a dry run, a fair pair is `skipped` with its
reason. In a dry run the ratios are recorded, not judged.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from looprl import kernels as kn
from looprl.aot import fair as FA
from looprl.aot import programs as PR
from looprl.logprobs import sequence_logprobs
from looprl.model import init_params
from looprl.model.layers import stack_pass
from looprl.model.looped import cast_weights, lm_logits
from looprl.timing import interleaved

# XLA's defaults for the flags looprl pins on a GPU (`determinism.ACCELERATOR_FLAGS`)
FAIR_GPU_OPTIONS = {"xla_gpu_deterministic_ops": False, "xla_gpu_autotune_level": 4,
                    "xla_gpu_enable_triton_gemm": True,
                    "xla_gpu_enable_while_loop_unrolling": "WHILE_LOOP_UNROLLING_AUTO_UNROLL"}


@dataclasses.dataclass(frozen=True)
class SpeedPair:
    """One timed pair: `build(sz, dtype, rng)` -> (candidate, baseline, args); `target`: the
    largest candidate / baseline ratio that passes (None: informative); `device_only`: it runs
    on a GPU or TPU at the device's sizes only (`unavailable`)."""
    name: str
    build: Callable
    dtypes: tuple = ("bfloat16",)
    target: float | None = None
    budget_s: float = 6
    device_only: bool = False

    def unavailable(self, sz) -> str | None:
        """Why the pair cannot run here at `sz` (one line), or None when it can."""
        if not self.device_only:
            return None
        platform = jax.default_backend()
        if platform not in ("gpu", "tpu"):
            return f"jax's Pallas GPU/TPU kernels (the fair baseline) do not run on the {platform}"
        if sz.per_group is not None:
            return "the dry run's tiny widths do not fit the fair baseline's kernels"
        return None


def _learner(sz, dtype, rng):
    cfg = sz.model
    params = init_params(cfg, 0)
    B, S = sz.learner
    T = cfg.total_ut_steps
    exits = np.where(np.arange(S)[None] < S - 1, rng.integers(1, T + 1, (B, S)), 0)
    args = (params, jnp.asarray(rng.integers(3, cfg.vocab_size, (B, S)), jnp.int32),
            jnp.zeros((B,), jnp.int32), jnp.asarray(exits, jnp.int32),
            jnp.full((B, S), T, jnp.int32))

    def loss(p, tokens, pad, exit_loop, depth, method):
        lp, _ = sequence_logprobs(cfg, p, tokens, pad, exit_loop, depth, kv_policy="dense",
                                  compute_dtype=dtype, temperature=1.0, method=method)
        return jnp.sum(lp)
    f = {m: jax.jit(jax.value_and_grad(functools.partial(loss, method=m)))
         for m in ("hybrid", "stock")}
    return f["hybrid"], f["stock"], args


def _decode_program(cfg, stock: bool):
    """One decode step's loop at B rows: the L layers reading the cache in place
    (`layers.stack_pass`, the sampler's form), the final norm, the head and its log-softmax."""
    def step(w, x_BxCxD, k_cache, v_cache, pad_B, w0):
        B, C, _ = x_BxCxD.shape
        layout = w0 + jnp.arange(C)
        positions = jnp.broadcast_to(layout[None] - pad_B[:, None], (B, C))
        h, _, _ = stack_pass(cfg, w, x_BxCxD, positions, layout, pad_B, k_cache, v_cache,
                             layout[None] >= pad_B[:, None], w0, stock, bits=True,
                             loop=jnp.int32(0))
        logits = lm_logits(w, h, stock)
        return jax.nn.log_softmax(logits, axis=-1) if stock else kn.log_softmax(logits)
    return jax.jit(step)


def _decode(sz, dtype, rng):
    cfg = sz.model
    B, S, live = sz.decode
    w = cast_weights(init_params(cfg, 0), dtype)
    shape = (1, cfg.num_layers, B, S, cfg.num_kv_heads, cfg.head_dim)
    cache = jnp.asarray(rng.standard_normal(shape), dtype)
    args = (w, jnp.asarray(rng.standard_normal((B, 1, cfg.hidden_size)), dtype), cache, cache,
            jnp.zeros((B,), jnp.int32), jnp.int32(live))
    return _decode_program(cfg, False), _decode_program(cfg, True), args


def _attention(kind):
    def build(sz, dtype, rng):
        cfg = sz.model
        H, J, K = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        if kind == "decode":
            B, S, live = sz.decode
            C, mask = 1, np.broadcast_to(np.arange(S) < live, (B, 1, S))
        else:
            (B, S), C = sz.prefill, sz.prefill[1]
            mask = np.broadcast_to(np.tril(np.ones((S, S), bool)), (B, S, S))
        q, k, v = (jnp.asarray(rng.standard_normal(s), dtype)
                   for s in ((B, C, H, K), (B, S, J, K), (B, S, J, K)))
        f = {s: jax.jit(lambda q, k, v, m, s=s: (kn.stock_attention if s else kn.attention)(
            q, k, v, m, K ** -0.5)) for s in (False, True)}
        return f[False], f[True], (q, k, v, jnp.asarray(mask))
    return build


def _matmul(weight, m):
    def build(sz, dtype, rng):
        i, o = sz.weights.get(weight, (sz.model.hidden_size, sz.model.hidden_size))
        out = jnp.float32 if weight == "lm_head" else None
        x = jnp.asarray(rng.standard_normal((m, i)), dtype)
        w = jnp.asarray(rng.standard_normal((i, o)) * i ** -0.5, dtype)
        return (jax.jit(lambda x, w: kn.matmul(x, w, out)),
                jax.jit(lambda x, w: kn.stock_matmul(x, w, out)), (x, w))
    return build


def _arrays(cfg, weights, abstract, rng, live: int):
    """`abstract` (a program's ShapeDtypeStruct args, the weights first) as arrays: `weights`
    in each leaf's dtype; then floats standard normal, the rows' padding `[B]` 0, the window
    start (a scalar) `live`, the targets `[B, C]` uniform in the vocabulary (from `rng`)."""
    w = jax.tree.map(lambda a, s: a.astype(s.dtype), weights, abstract[0])

    def one(s):
        if jnp.issubdtype(s.dtype, jnp.floating):
            return jnp.asarray(rng.standard_normal(s.shape), s.dtype)
        if s.ndim == 0:
            return jnp.asarray(live, s.dtype)
        if s.ndim == 1:
            return jnp.zeros(s.shape, s.dtype)
        return jnp.asarray(rng.integers(0, cfg.vocab_size, s.shape), s.dtype)
    return (w, *[one(s) for s in abstract[1:]])


def _threaded(compiled, args, donated: dict):
    """A zero-argument call of `compiled(*args)` that feeds each call's outputs into the next:
    `donated` maps an argument index to the output index that replaces it (a donated cache)."""
    state = list(args)

    def call():
        out = compiled(*state)
        for i, j in donated.items():
            state[i] = out[j]
        return out
    return call


def _vs_fair(kind: str):
    """The pair of `kind` (`learner_step`, `decode`): looprl's program (the form in force, the
    process's pins) against the fair one (`FA.build`, traced in the stock form, compiled with
    `FAIR_GPU_OPTIONS` on a GPU), at the check's learner or decode sizes."""
    def build(sz, dtype, rng):
        cfg = sz.model
        if kind == "learner_step":
            phase, live = PR.learner_step(*sz.learner), 0
        else:
            phase, live = PR.decode(sz.decode[0], sz.decode[1]), sz.decode[2]
        weights = cast_weights(init_params(cfg, 0), jnp.dtype(dtype))
        fn, abstract = PR.build(cfg, dtype, phase)
        args = _arrays(cfg, weights, abstract, rng, live)
        cand = jax.jit(fn).lower(*args).compile()
        backend = jax.default_backend()
        f_fn, f_abstract, donate = FA.build(cfg, dtype, phase, backend)
        f_args = _arrays(cfg, weights, f_abstract, rng, live)
        with kn.use_form("stock"):
            base = jax.jit(f_fn, donate_argnums=donate).lower(*f_args).compile(
                compiler_options=FAIR_GPU_OPTIONS if backend == "gpu" else None)
        # the decode returns (head, K pages, V pages): each call's pages feed the next
        donated = {i: k + 1 for k, i in enumerate(donate)}
        return (_threaded(cand, args, {}), _threaded(base, f_args, donated), ())
    return build


PAIRS = (
    SpeedPair("learner_step_vs_stock", _learner, target=1.3, budget_s=12),
    SpeedPair("decode_step_vs_stock", _decode, target=1.5, budget_s=10),
    SpeedPair("attention_decode_vs_stock", _attention("decode"), budget_s=5),
    SpeedPair("attention_prefill_vs_stock", _attention("prefill"), budget_s=5),
    SpeedPair("matmul_vs_stock", lambda sz, d, rng: _matmul(*sz.speed_matmul[0])(sz, d, rng),
              dtypes=("bfloat16", "float32"), budget_s=4),
    SpeedPair("learner_step_vs_fair", _vs_fair("learner_step"), target=1.25, budget_s=14,
              device_only=True),
    SpeedPair("decode_step_vs_fair", _vs_fair("decode"), target=1.2, budget_s=11,
              device_only=True),
)


def pair(name: str) -> SpeedPair:
    """The pair named `name`. Raises KeyError naming the pairs."""
    found = [p for p in PAIRS if p.name == name]
    if not found:
        raise KeyError(f"unknown speed pair {name!r}; known: {[p.name for p in PAIRS]}")
    return found[0]


def timed_pair(sz, name: str, dtype: str, judged: bool = True) -> dict:
    """Pair `name` in `dtype` at sizes `sz`: both compiled and warmed, then `sz.repeats`
    interleaved rounds; medians in ms, the ratio, and (`judged` and a target) pass or fail;
    else `recorded`. A pair that cannot run here is `skipped` with its reason
    (`SpeedPair.unavailable`)."""
    p = pair(name)
    why = p.unavailable(sz)
    if why:
        return {"status": "skipped", "why": why}
    if kn.current_form().name == "stock":
        raise ValueError("the form in force is stock: its ratio to stock says nothing")
    cand, base, args = p.build(sz, dtype, np.random.default_rng(4))
    for f in (cand, base):
        jax.block_until_ready(f(*args))  # compile, warm
    med = interleaved({"cand": lambda: cand(*args), "base": lambda: base(*args)}, sz.repeats)
    r = med["cand"] / med["base"]
    rec = {"candidate_ms": round(med["cand"] * 1e3, 3), "baseline_ms": round(med["base"] * 1e3, 3),
           "ratio": round(r, 3), "target": p.target}
    if judged and p.target is not None:
        rec["status"] = "pass" if r <= p.target else "fail"
    else:
        rec["status"] = "recorded"
    return rec
