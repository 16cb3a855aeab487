"""Cost of the row-invariant matmul (looprl.kernels.matmul) against the stock `x @ W`, at
the Ouro-1.4B widths (hidden 2048, MLP 5632, vocabulary 49152, exit gate [2048, 1]).

For every weight shape, fp32 and bf16 (lm_head with fp32 output, as lm_logits), and M in
{1, 2, 3, 5, 7, 8, 16, 256, 300, 1000, 4096} rows, both jitted functions run interleaved
(invariant, stock, invariant, stock, ... after one warm-up call each up to 16 rows; from 256
rows both are compiled ahead and the first call is timed) in the same process; a
figure is median(invariant CPU seconds) / median(stock CPU seconds) (`time.process_time`, see
`looprl.timing.interleaved`), lower is better. The lm_head is timed up to M = 1000 (at 4096 one
call is ~10 s on one core); its 4096-row memory is still measured. Peak memory = temp + output
bytes of `compile().memory_analysis()`. XLA runs with looprl's flags and one intra-op thread
(`--xla_cpu_multi_thread_eigen=false`, recorded).

Run: `python benchmarks/kernels.py` (no arguments; its run times per host are in docs/LOG.md;
`section_seconds` gives the wall seconds of the matmul, attention, sampler and learner parts). The
last line is a JSON object with `matmul_vs_stock_large_1p4b` (worst ratio at M >= 256),
`matmul_vs_stock_small_1p4b` (worst at M <= 16) and `matmul_peak_mem_vs_stock_1p4b` (worst memory
ratio at M = 4096) over the big weights (q/k/v/o, gate/up, down, lm_head), the same three as
`gate_*` for the exit gate `[2048, 1]` alone (whose stock call is a ~1 ms matrix-vector product
with a near-zero peak, `gate_stock_ms_M1000`, so its ratios say little about a step's cost), plus
every figure.

Attention at decode (`attention_decode_*`): one query per row, ATTN_ROWS = 16 rows, Ouro-1.4B
width (16 heads x 128), a cache of ATTN_CACHE = 768 slots (a GSM8K rollout: a ~256-token prompt
bucket + 512 new tokens) whose first `live` slots are the row's keys (128, 384, 768: early, middle
and last decode step), fp32 and bf16, `kernels.attention` over `kernels.stock_attention` on the
same arguments (the sampler's stock path too attends over the whole masked cache), ATTN_REPEATS
interleaved pairs; `attention_decode_vs_stock_1p4b` is the worst. The invariant form runs only
the 128-key blocks that hold a live key, so its cost follows `live`; stock's follows the cache.

Two whole-program figures, on one layer of Ouro-1.4B width (`preset("ouro-1.4b",
num_layers=1)`: hidden 2048, 16 heads x 128, MLP 5632, the full 49152 vocabulary, T = 4) with
random weights (`init_params(cfg, 0)`, exit-gate bias 0; at q = 0.5 the sampled tokens exit at
loops 1/2/3/4 about 35/47/13/5%, mean exit loop ~1.9), both invariant / stock, lower is better:
- `sampler_vs_stock_1p4b`: one `looprl.sampling.sampler.generate` call with
  `SamplingConfig(kernels="invariant")` over one with `kernels="stock"`: 8 rows, prompts of 64
  random tokens (P = 64), 64 new tokens (stop ids off, so every row generates all 64), KV policy
  `dense`, fp32 compute, q = 0.5, temperature 1, row compaction on (the defaults). Under `dense`
  every live row runs all T loops at every step (the exits only pick the hidden state the
  lm_head reads), so both calls do the same work. Whole calls (prefill + 63 decode steps), one
  warm-up (compile) call each, then SAMPLER_REPEATS = 2 interleaved pairs (a pair is a large
  share of the budget); `sampler_invariant_s`, `sampler_stock_s` are the medians.
  fp32 only: a bf16 pair would not fit the 600 s budget.
- `hybrid_vs_stock_step_1p4b`: one learner step, the jitted `jax.value_and_grad` of the sum of
  the learner's log-probs (`looprl.logprobs.methods.sequence_logprobs`, KV policy `dense`, fp32,
  temperature 1, per-loop rematerialisation as in `looprl.rl.objective`) with `method="hybrid"` (the
  invariant-kernel dense pass: replay's value under stop_gradient, the same pass's gradient) over
  the same with `method="stock"` (plain matmuls and attention): 8 rows x 512 tokens, P = 64
  random prompt tokens + 448 random completion tokens, every completion position emitting, its
  exit loop drawn at random from those the fp32 invariant rollout above recorded (the learner's
  dense pass runs every loop at every position and builds logits at every position, so the
  exits do not change its cost). The batch is built directly, not sampled (448 decode steps would
  cost minutes); all 448 tokens count as generated, so the stock learner's live prefix is the
  whole 512. One step is ~50-100 s on one core, so each is compiled ahead of time
  (`lower().compile()`, not executed) and STEP_REPEATS = 1 interleaved pair runs (a second pair
  took the run past 600 s on a loaded machine); `hybrid_step_invariant_s`, `hybrid_step_stock_s`
  are its two timings. This figure is noisy on a shared machine: under another job's load one
  pair gave 1.46 (hybrid 73 s, stock 50 s) and the median of two pairs 0.90 (91 s, 102 s).
"""
from __future__ import annotations

import os
import sys

# `python benchmarks/kernels.py` puts benchmarks/ first on sys.path, so an installed looprl (an
# editable install of another checkout) would win over this tree's: put this tree first.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_cpu_multi_thread_eigen=false").strip()

import functools  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from looprl.determinism import environment  # noqa: E402
from looprl.logprobs import sequence_logprobs  # noqa: E402
from looprl import kernels as kn  # noqa: E402
from looprl.model.config import preset  # noqa: E402
from looprl.model.looped import init_params  # noqa: E402
from looprl.sampling.sampler import SamplingConfig, generate  # noqa: E402
from looprl.timing import default_clock, interleaved  # noqa: E402

D, F, V = 2048, 5632, 49152
WEIGHTS = {"qkvo": (D, D), "gate_up": (D, F), "down": (F, D), "lm_head": (D, V),
           "exit_gate": (D, 1)}
ROWS = (1, 2, 3, 5, 7, 8, 16, 256, 300, 1000, 4096)
TIMED_MAX_ROWS = {"lm_head": 1000}
MODEL = preset("ouro-1.4b", num_layers=1)  # the whole-program figures' model (module doc)
EXIT_Q = 0.5
SAMPLER_ROWS, SAMPLER_PROMPT, SAMPLER_NEW, SAMPLER_REPEATS = 8, 64, 64, 2
ATTN_ROWS, ATTN_CACHE, ATTN_LIVE, ATTN_REPEATS = 16, 768, (128, 384, 768), 5
STEP_ROWS, STEP_LEN, STEP_REPEATS = 8, 512, 1


def _repeats(name: str, m: int) -> int:
    """Interleaved pairs per figure: 15 for the millisecond calls (up to 16 rows, weights other
    than the lm_head: with 5, q/k/v/o fp32 at 2 rows read 0.83-0.92 in three runs and 1.87 in a
    fourth whose stock median was 1.4 ms against 2.3-4.0), 5 for the lm_head's, 3 up to 300
    rows and 5 above (1 for the lm_head at 1000 rows, a ~5 s pair). The large-M figure is the
    worst of 30 ratios, so one noisy median decides it: more pairs there keep one noisy run from
    deciding it (docs/LOG.md)."""
    if m <= 16:
        return 5 if name == "lm_head" else 15
    if name == "lm_head" and m > 300:
        return 1
    return 3 if m <= 300 else 5


def _peak_bytes(fn, *args) -> int:
    mem = jax.jit(fn).lower(*args).compile().memory_analysis()
    return int(mem.temp_size_in_bytes + mem.output_size_in_bytes)


def _sampler(params) -> tuple[dict, np.ndarray]:
    """`sampler_*` figures (module doc) and the exit loops the invariant rollout recorded."""
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(3, MODEL.vocab_size, SAMPLER_PROMPT)]
               for _ in range(SAMPLER_ROWS)]
    rollouts = {}

    def call(kernels):
        scfg = SamplingConfig(max_new_tokens=SAMPLER_NEW, temperature=1.0,
                              exit_threshold=EXIT_Q, kv_policy="dense", stop_ids=(),
                              compute_dtype="float32", kernels=kernels)
        rollouts[kernels] = generate(MODEL, params, prompts, scfg, seed=0)
        return rollouts[kernels].tokens_BxS

    fns = {k: functools.partial(call, k) for k in ("invariant", "stock")}
    for fn in fns.values():
        fn()
    for k, rb in rollouts.items():
        if not np.all(rb.completion_len_B == SAMPLER_NEW):
            raise RuntimeError(f"{k} sampler stopped early: {rb.completion_len_B}")
    med = interleaved(fns, SAMPLER_REPEATS)
    rb = rollouts["invariant"]
    exits = rb.exit_loop_BxS[rb.exit_loop_BxS > 0]
    print(f"sampler {SAMPLER_ROWS}x({SAMPLER_PROMPT}+{SAMPLER_NEW}) invariant/stock "
          f"{med['invariant'] / med['stock']:5.2f}  (stock {med['stock']:7.2f} s, mean exit "
          f"{exits.mean():.2f})", flush=True)
    return {"sampler_vs_stock_1p4b": round(med["invariant"] / med["stock"], 3),
            "sampler_invariant_s": round(med["invariant"], 3),
            "sampler_stock_s": round(med["stock"], 3),
            "sampler_mean_exit_loop": round(float(exits.mean()), 3)}, exits


def _attention_decode() -> dict:
    """`attention_decode_*` figures (module doc): one decode query per row over a cache of
    ATTN_CACHE slots at Ouro-1.4B width, the row's live keys the first `live` slots."""
    H, K = MODEL.num_heads, MODEL.head_dim
    rng = np.random.default_rng(3)
    q = rng.standard_normal((ATTN_ROWS, 1, H, K)).astype(np.float32)
    kv = rng.standard_normal((2, ATTN_ROWS, ATTN_CACHE, H, K)).astype(np.float32)
    inv = jax.jit(lambda q, k, v, m: kn.attention(q, k, v, m, K ** -0.5))
    stock = jax.jit(lambda q, k, v, m: kn.stock_attention(q, k, v, m, K ** -0.5))
    figures = {}
    for dtype in ("float32", "bfloat16"):
        args = [jnp.asarray(a, dtype) for a in (q, kv[0], kv[1])]
        for live in ATTN_LIVE:
            mask = jnp.asarray(np.broadcast_to(np.arange(ATTN_CACHE) < live,
                                               (ATTN_ROWS, 1, ATTN_CACHE)))
            fns = {"inv": functools.partial(inv, *args, mask),
                   "stock": functools.partial(stock, *args, mask)}
            for fn in fns.values():
                jax.block_until_ready(fn())
            med = interleaved(fns, ATTN_REPEATS)
            tag = f"attention_decode_{dtype}_live{live}"
            figures[tag] = round(med["inv"] / med["stock"], 3)
            print(f"{tag:34s} invariant/stock {figures[tag]:5.2f}  (invariant "
                  f"{med['inv'] * 1e3:7.2f} ms, stock {med['stock'] * 1e3:7.2f} ms)", flush=True)
    worst = max(figures, key=figures.get)
    return {"attention_decode_vs_stock_1p4b": figures[worst],
            "attention_decode_vs_stock_worst": worst, "attention_decode": figures}


def _learner_step(params, exits) -> dict:
    """`hybrid_step_*` figures (module doc): exit loops drawn from `exits`."""
    rng = np.random.default_rng(2)
    B, S, P, T = STEP_ROWS, STEP_LEN, SAMPLER_PROMPT, MODEL.total_ut_steps
    pos_BxS = np.broadcast_to(np.arange(S)[None], (B, S))
    exits_BxS = np.where((pos_BxS >= P - 1) & (pos_BxS < S - 1), rng.choice(exits, (B, S)),
                         0).astype(np.int32)
    depth_BxS = np.where(pos_BxS < P, T, np.maximum(exits_BxS, 1)).astype(np.int32)
    args = (params, jnp.asarray(rng.integers(3, MODEL.vocab_size, (B, S)), jnp.int32),
            jnp.zeros((B,), jnp.int32), jnp.asarray(exits_BxS), jnp.asarray(depth_BxS))

    def loss(p, tokens_BxS, pad_B, exit_loop_BxS, kv_depth_BxS, method):
        lp_BxS, _ = sequence_logprobs(MODEL, p, tokens_BxS, pad_B, exit_loop_BxS, kv_depth_BxS,
                                      kv_policy="dense", compute_dtype="float32",
                                      temperature=1.0, method=method)
        return jnp.sum(lp_BxS)

    steps = {m: jax.jit(jax.value_and_grad(functools.partial(loss, method=m)))
             .lower(*args).compile() for m in ("hybrid", "stock")}
    med = interleaved({m: functools.partial(f, *args) for m, f in steps.items()}, STEP_REPEATS)
    print(f"learner step {B}x{S} hybrid/stock {med['hybrid'] / med['stock']:5.2f}  (stock "
          f"{med['stock']:7.2f} s)", flush=True)
    return {"hybrid_vs_stock_step_1p4b": round(med["hybrid"] / med["stock"], 3),
            "hybrid_step_invariant_s": round(med["hybrid"], 3),
            "hybrid_step_stock_s": round(med["stock"], 3)}


def main() -> dict:
    t_start = time.perf_counter()
    rng = np.random.default_rng(0)
    figures, mem, gate_ms = {}, {}, {}
    for name, (i, o) in WEIGHTS.items():
        for dtype in ("float32", "bfloat16"):
            out_dtype = jnp.float32 if name == "lm_head" else None
            w = jnp.asarray(rng.standard_normal((i, o)) / np.sqrt(i), dtype)
            inv = jax.jit(lambda x, w: kn.matmul(x, w, out_dtype))
            stock = jax.jit(lambda x, w: kn.stock_matmul(x, w, out_dtype))
            for m in ROWS:
                tag = f"{name}_{dtype}_M{m}"
                if m == 4096:
                    spec = (jax.ShapeDtypeStruct((m, i), dtype), jax.ShapeDtypeStruct((i, o), dtype))
                    inv_b, stock_b = _peak_bytes(inv, *spec), _peak_bytes(stock, *spec)
                    mem[tag] = inv_b / stock_b
                    print(f"{tag:28s} peak MB invariant {inv_b / 2**20:9.2f} stock "
                          f"{stock_b / 2**20:9.2f}", flush=True)
                if m > TIMED_MAX_ROWS.get(name, 1 << 30):
                    continue
                x = jnp.asarray(rng.standard_normal((m, i)), dtype)
                if m >= 256:  # compiled ahead, no warm-up call (a warm-up pair is ~90 s here)
                    fns = {k: functools.partial(f.lower(x, w).compile(), x, w)
                           for k, f in (("inv", inv), ("stock", stock))}
                else:
                    fns = {"inv": functools.partial(inv, x, w),
                           "stock": functools.partial(stock, x, w)}
                    for fn in fns.values():
                        jax.block_until_ready(fn())
                med = interleaved(fns, _repeats(name, m))
                ratio = med["inv"] / med["stock"]
                if name == "exit_gate" and m == 1000:
                    gate_ms[dtype] = round(med["stock"] * 1e3, 3)
                figures[tag] = round(ratio, 3)
                print(f"{tag:28s} invariant/stock {ratio:5.2f}  (stock "
                      f"{med['stock'] * 1e3:8.2f} ms)", flush=True)
    def worst(d, rows, gate):
        d = {k: v for k, v in d.items() if rows(int(k.rsplit("M", 1)[1]))
             and k.startswith("exit_gate") == gate}
        return max(d.values()), max(d, key=d.get)

    large, small = (lambda m: m >= 256), (lambda m: m <= 16)
    out = {}
    for key, d, rows in (("vs_stock_large", figures, large), ("vs_stock_small", figures, small),
                         ("peak_mem_vs_stock", mem, large)):
        for prefix, gate in (("matmul", False), ("gate", True)):
            v, k = worst(d, rows, gate)
            out[f"{prefix}_{key}_1p4b"], out[f"{prefix}_{key}_worst"] = round(v, 3), k
    p = init_params(MODEL, 0)
    p["early_exit_gate"]["bias"] = jnp.zeros_like(p["early_exit_gate"]["bias"])
    params = jax.device_put(jax.tree.map(np.asarray, p))
    sections = {"matmul": time.perf_counter() - t_start}
    t = time.perf_counter()
    attn = _attention_decode()
    sections["attention"], t = time.perf_counter() - t, time.perf_counter()
    sampler, exits = _sampler(params)
    sections["sampler"], t = time.perf_counter() - t, time.perf_counter()
    step = _learner_step(params, exits)
    sections["learner"] = time.perf_counter() - t
    env = environment()
    return {
        **out, **attn, **sampler, **step,
        "gate_stock_ms_M1000": gate_ms.get("float32"),
        "figures": figures, "peak_mem_vs_stock_M4096": {k: round(v, 3) for k, v in mem.items()},
        "kernels_file": kn.__file__, "threads": 1, "xla_flags": env["xla_flags"], "cpu_model": env["cpu_model"],
        "jax": env["jax"], "git_commit": env["git_commit"],
        "clock": default_clock().__name__, "seconds": round(time.perf_counter() - t_start, 1),
        "section_seconds": {k: round(v, 1) for k, v in sections.items()},
    }


if __name__ == "__main__":
    print(json.dumps(main()))
