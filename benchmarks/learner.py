"""One learner step (forward + backward) with `hybrid` log-probs vs a `stock` step.

Shape: the main job's GRPO batch, 16 prompts x 8 samples = 128 rows, max_new_tokens 32, on the
tiny model (preset `tiny`, random init with the gate bias set so that most tokens exit early,
q = 0.6, KV policy `dense`, compute fp32). One rollout is sampled once; every contender then
takes the gradient of the same policy-gradient-style loss (`-mean(adv * exp(lp - old_lp))` over
sampled tokens) on the same batch, jitted, with per-loop rematerialisation (the learner's
default). `hybrid` keeps the recorded cache length S and the invariant kernels; `stock` is the
same math the common way (plain matmuls, attention over the live prefix). Also timed: a
`dense` step (the invariant kernels without the replay term) and the replay forward alone
(`replay`, no gradient). `replay_share` = (hybrid - dense) / hybrid, the cost replay adds
inside the hybrid step; `replay_forward_share` = replay forward / hybrid step, what a separate
replay pass would cost. Median of REPEATS timed calls after a compile/warm-up call,
contenders interleaved in ABBA order.

The ordered backward (`cpu-ordered`'s dX = dY W^T, dW = X^T dY and attention's products by the
ordered kernels, which make a CPU run free of the ISA) against the plain XLA dots
(`kernels.forms.plain_backward`), same forward: `ordered_vs_plain_backward_main` is the
hybrid step above; `ordered_vs_plain_backward_1p4b` one step of value and gradient through an
Ouro-1.4B layer's seven products (hidden 2048, MLP 5632, BW_ROWS rows: q, k, v, o, gate, up,
down, `kernels.matmul`) in fp32. Target: both <= 1.15.

Run: `python benchmarks/learner.py` (no arguments; <= 400 s on 2 CPU cores). Last line: JSON.
"""
from __future__ import annotations

import functools
import json
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from looprl import kernels as kn
from looprl.kernels.forms import plain_backward
from looprl.logprobs import sequence_logprobs
from looprl.model.config import preset
from looprl.model.looped import init_params
from looprl.sampling.sampler import SamplingConfig, generate
from looprl.timing import abba

N_PROMPTS, GROUP, MAX_NEW = 16, 8, 32
REPEATS = 5
BW_ROWS, BW_REPEATS = 256, 3


def _compiled(fn, plain: bool):
    """`fn` jitted, traced (and run once) with the ordered or the plain backward."""
    jitted = jax.jit(fn)

    def call():
        return jitted()

    if plain:
        with plain_backward():
            jax.block_until_ready(call())
    else:
        jax.block_until_ready(call())
    return call


def backward_1p4b() -> dict:
    """Ordered vs plain backward through an Ouro-1.4B layer's products (module doc)."""
    cfg = preset("ouro-1.4b")
    d, f = cfg.hidden_size, cfg.intermediate_size
    rng = np.random.default_rng(1)
    shapes = {"q": (d, d), "k": (d, d), "v": (d, d), "o": (d, d), "gate": (d, f), "up": (d, f),
              "down": (f, d)}
    ws = {k: jnp.asarray(rng.standard_normal(s) * s[0] ** -0.5, jnp.float32)
          for k, s in shapes.items()}
    x = jnp.asarray(rng.standard_normal((BW_ROWS, d)), jnp.float32)

    def loss(w):
        a = kn.matmul(kn.matmul(x, w["q"]) * kn.matmul(x, w["k"]) + kn.matmul(x, w["v"]),
                      w["o"])
        m = kn.matmul(jax.nn.silu(kn.matmul(a, w["gate"])) * kn.matmul(a, w["up"]), w["down"])
        return jnp.sum(jnp.sin(m))

    step = jax.value_and_grad(loss)
    contenders = {name: _compiled(lambda: step(ws), name == "plain")
                  for name in ("ordered", "plain")}
    med = {k: statistics.median(v) for k, v in abba(contenders, BW_REPEATS).items()}
    return {"ordered_vs_plain_backward_1p4b": round(med["ordered"] / med["plain"], 3),
            "ordered_backward_1p4b_s": round(med["ordered"], 4),
            "plain_backward_1p4b_s": round(med["plain"], 4), "rows_1p4b": BW_ROWS}


def main() -> dict:
    t_start = time.time()
    cfg = preset("tiny")
    params = init_params(cfg, 0)
    params["early_exit_gate"]["bias"] = jnp.array([-0.3])
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, cfg.vocab_size, size=int(n)))
               for n in rng.integers(8, 24, size=N_PROMPTS)]
    scfg = SamplingConfig(max_new_tokens=MAX_NEW, temperature=1.0, exit_threshold=0.6,
                          kv_policy="dense")
    rb = generate(cfg, params, prompts, scfg, group_size=GROUP, seed=0)
    emit = rb.exit_loop_BxS > 0
    S = rb.schedule.seq_len
    live = int(rb.schedule.prompt_len + rb.completion_len_B.max())
    adv = jnp.asarray(rng.standard_normal(rb.schedule.batch_size), jnp.float32)

    def arrays(n):
        return (jnp.asarray(rb.tokens_BxS[:, :n]), jnp.asarray(rb.pad_B),
                jnp.asarray(rb.exit_loop_BxS[:, :n]), jnp.asarray(rb.kv_depth_BxS()[:, :n]),
                jnp.asarray(rb.logprob_BxS[:, :n]))

    full, trimmed = arrays(S), arrays(live)

    def loss(p, tokens, pad, exit_loop, kv_depth, old, method):
        lp, _ = sequence_logprobs(cfg, p, tokens, pad, exit_loop, kv_depth, kv_policy="dense",
                                  compute_dtype="float32", temperature=1.0, method=method)
        mask = (exit_loop > 0).astype(jnp.float32)
        ratio = jnp.exp(jnp.where(mask > 0, lp - old, 0.0))
        return -jnp.sum(adv[:, None] * ratio * mask) / jnp.maximum(jnp.sum(mask), 1.0)

    steps = {m: jax.jit(jax.value_and_grad(functools.partial(loss, method=m)))
             for m in ("hybrid", "dense", "stock")}
    replay_fwd = jax.jit(lambda p, *a: sequence_logprobs(
        cfg, p, *a[:4], kv_policy="dense", compute_dtype="float32", temperature=1.0,
        method="replay")[0])
    contenders = {
        "hybrid": lambda: steps["hybrid"](params, *full),
        "stock": lambda: steps["stock"](params, *trimmed),
        "dense": lambda: steps["dense"](params, *full),
        "replay_forward": lambda: replay_fwd(params, *full),
    }
    plain_step = jax.jit(jax.value_and_grad(functools.partial(loss, method="hybrid")))
    with plain_backward():  # traced here: the plain dots in the backward
        jax.block_until_ready(plain_step(params, *full))
    contenders["hybrid_plain_backward"] = lambda: plain_step(params, *full)
    compile_s = {}
    for name, fn in contenders.items():
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        compile_s[name] = round(time.perf_counter() - t0, 2)
    times = abba(contenders, REPEATS)
    med = {k: statistics.median(v) for k, v in times.items()}
    # the hybrid value is the sampler's bits (a sanity check, not a timing)
    hyb_lp = np.asarray(jax.jit(lambda p: sequence_logprobs(
        cfg, p, *full[:4], kv_policy="dense", compute_dtype="float32", temperature=1.0,
        method="hybrid")[0])(params))
    exact = float((hyb_lp.view(np.uint32) == rb.logprob_BxS.view(np.uint32))[emit].mean())
    return {
        "benchmark": "learner",
        "hybrid_vs_stock_step": round(med["hybrid"] / med["stock"], 3),
        "replay_share": round((med["hybrid"] - med["dense"]) / med["hybrid"], 3),
        "replay_forward_share": round(med["replay_forward"] / med["hybrid"], 3),
        "hybrid_step_s": round(med["hybrid"], 4), "stock_step_s": round(med["stock"], 4),
        "dense_step_s": round(med["dense"], 4), "replay_forward_s": round(med["replay_forward"], 4),
        "dense_vs_stock_step": round(med["dense"] / med["stock"], 3),
        "ordered_vs_plain_backward_main": round(med["hybrid"] / med["hybrid_plain_backward"], 3),
        "hybrid_plain_backward_step_s": round(med["hybrid_plain_backward"], 4),
        **backward_1p4b(),
        "hybrid_value_exact_fraction": exact,
        "compile_s": compile_s,
        "batch": {"rows": rb.schedule.batch_size, "prompts": N_PROMPTS, "group_size": GROUP,
                  "max_new_tokens": MAX_NEW, "seq_len_hybrid": S, "seq_len_stock": live,
                  "sampled_tokens": int(emit.sum()),
                  "mean_exit_loop": round(float(rb.exit_loop_BxS[emit].mean()), 3)},
        "model": {"preset": "tiny", "num_params": cfg.num_params},
        "threads": {"cpu_count": os.cpu_count(), "xla_flags": os.environ.get("XLA_FLAGS", "")},
        "cpu": platform.processor() or platform.machine(), "jax": jax.__version__,
        "wall_s": round(time.time() - t_start, 1),
    }


if __name__ == "__main__":
    print(json.dumps(main()))
