"""Where a decode step's attention spends its time: a profile, per XLA op.

`flax_vs_torch_decode_b16` / `_b128` (benchmarks/rollout.py) are missed, and a decode layer of
the tiny preset at 128 rows spends most of its time in attention (docs/LOG.md). This script shows what inside the
attention costs it, from a `jax.profiler` trace rather than by guessing: one decode step's
`kernels.attention` (one query per row, C = 1) at the tiny preset's widths (4 heads of 32) over a
64-slot cache, for `invariant` and `stock` kernels, each jitted in a `fori_loop` of REPEATS
calls and traced once, on one XLA thread. Per XLA op (thunk) of the compiled program it
reports microseconds per call, summed over the trace, largest first (a loop's ops are counted
themselves, the loop container not; an op XLA hoisted out of the loop is still divided by
REPEATS); the op names are XLA's (with the CPU's default ordered kernels: `ffi_call.N`, the
ordered attention kernels, scores and values, reading K/V from the cache in place, and the
softmax's `rowsum`; with `LOOPRL_KERNELS=cpu-xla`: `dot_general.N`, the same dots as XLA's;
`transpose_copy_fusion*`: the rotated K/V block gathers into head-major order;
`bitcast_pad_fusion*`: the query and probability padding and the masked scores). The dots' share
counts every op named `dot*` or `ffi_call*`.

Next to them, the floor of the construction: both dots unbatched at the padded FLOPs (one
`[B H R, K] x [K, 128]` dot and one `[B H R, 128] x [128, K]` dot, R = the row quantum, and the
key axis padded to 128 as the invariant form pads it), what the padded query tiles cost
without a call per (row, head). The three programs' times are medians of ROUNDS interleaved
rounds (`looprl/timing.py`), in wall seconds like the trace's (XLA splits some loop
fusions over both cores, which CPU seconds would count twice). The JSON line
carries, per batch size, `invariant_us`, `stock_us`, their ratio, the dots' share of the
invariant op time and `padded_dots_floor_us`.

Run: `python benchmarks/attention_profile.py` (no arguments; under a minute on 2 CPU cores).
Last line: JSON. Trace times carry the profiler's small cost per op, and the ratios vary
between runs on a shared machine: compare the rows of one run, and run it more than once.
"""
from __future__ import annotations

import os

# one XLA CPU thread (as benchmarks/kernels.py), so an op's trace time is its whole cost; set
# before jax starts
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_cpu_multi_thread_eigen=false").strip()

import collections  # noqa: E402
import functools  # noqa: E402
import gzip  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from looprl import kernels  # noqa: E402  (importing looprl sets its XLA CPU flags)
from looprl.timing import interleaved  # noqa: E402

BATCHES = (16, 128)
SLOTS, LIVE, HEADS, HEAD_DIM = 64, 59, 4, 32  # the tiny preset's heads; a short decode cache
REPEATS = 20  # calls per timed program
ROUNDS = 5  # interleaved rounds of the three programs (invariant, stock, floor) per batch size
# trace events that are not one XLA op: Python frames (`$...`), `end: ...` markers, loop
# containers (a `while` thunk's time is its body's ops, which are counted themselves); runtime
# events have spaces or `::` in their names, XLA's op names never do
_NOT_OPS = ("$", "end:", "while", "Pjit")


def _looped(fn, repeats):
    """`fn(q, *args)` called `repeats` times in one jitted `fori_loop`, each call fed by the
    last one's output (its sum times 0, so every output element is computed and used)."""
    @jax.jit
    def run(q, *args):
        def body(_, c):
            return jnp.sum(fn(q + c, *args)) * 0
        return jax.lax.fori_loop(0, repeats, body, jnp.float32(0))
    return run


def _op_times(run, args, repeats) -> dict[str, float]:
    """Microseconds per call of each XLA op of `run(*args)`'s program, from one trace."""
    run(*args).block_until_ready()  # compile outside the trace
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            run(*args).block_until_ready()
        trace = next(Path(d).rglob("*.trace.json.gz"))
        events = json.load(gzip.open(trace))["traceEvents"]
    total = collections.Counter()
    for e in events:
        name = e.get("name", "")
        if (e.get("ph") != "X" or "dur" not in e or name.startswith(_NOT_OPS) or " " in name
                or "::" in name):
            continue
        total[name] += e["dur"]
    return {name: us / repeats for name, us in total.most_common()}


def _case(B: int, rng) -> dict:
    def arr(*shape):
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * 0.1)

    q, k, v = arr(B, 1, HEADS, HEAD_DIM), arr(B, SLOTS, HEADS, HEAD_DIM), arr(B, SLOTS, HEADS,
                                                                             HEAD_DIM)
    pad = rng.integers(0, SLOTS - LIVE + 1, B)
    s = np.arange(SLOTS)
    mask = jnp.asarray((s[None, :] >= pad[:, None]) & (s[None, :] < pad[:, None] + LIVE))[:, None]
    scale = HEAD_DIM ** -0.5
    out, fns = {}, {}
    for name, attend in (("invariant", kernels.attention), ("stock", kernels.stock_attention)):
        run = _looped(lambda q, k, v, m, f=attend: f(q, k, v, m, scale), REPEATS)
        out[name] = {"ops_us": _op_times(run, (q, k, v, mask), REPEATS)}  # compiles, warms
        fns[name] = functools.partial(run, q, k, v, mask)
    R = kernels.row_tile()
    x = arr(B * HEADS * R, HEAD_DIM)
    w_s, w_v = arr(HEAD_DIM, kernels.K_BLOCK), arr(kernels.K_BLOCK, HEAD_DIM)

    @jax.jit
    def floor(x, w_s, w_v):  # both dots, unbatched; each call's output feeds the next call
        return jax.lax.fori_loop(0, REPEATS, lambda _, c: jnp.dot(jnp.dot(x + c * 0, w_s), w_v),
                                 jnp.zeros_like(x))
    fns["floor"] = functools.partial(floor, x, w_s, w_v)
    fns["floor"]().block_until_ready()  # compile
    med = interleaved(fns, ROUNDS, clock=time.perf_counter)  # wall, as the trace's times
    for name in ("invariant", "stock"):
        out[name]["us"] = med[name] / REPEATS * 1e6
    out["padded_dots_floor_us"] = med["floor"] / REPEATS * 1e6
    ops = out["invariant"]["ops_us"]
    dots = sum(us for name, us in ops.items() if name.startswith(("dot", "ffi_call")))
    if dots == 0:
        raise SystemExit(f"no dot among the traced ops ({sorted(ops)[:12]}): XLA's op names "
                         "changed; update the dot share's match")
    out["dot_share_of_invariant_ops"] = dots / sum(ops.values())
    return out


def main() -> dict:
    rng = np.random.default_rng(0)
    result = {"benchmark": "attention_profile", "row_quantum": kernels.row_tile(),
              "kernel_version": kernels.kernel_version(), "slots": SLOTS, "live_keys": LIVE,
              "heads": HEADS, "head_dim": HEAD_DIM}
    for B in BATCHES:
        c = _case(B, rng)
        inv, st = c["invariant"], c["stock"]
        print(f"B={B}: invariant {inv['us']:.0f} us, stock {st['us']:.0f} us per "
              f"call; both dots unbatched at the padded FLOPs {c['padded_dots_floor_us']:.0f}"
              " us", file=sys.stderr)
        for name, us in list(inv["ops_us"].items())[:8]:
            print(f"  {us:9.1f} us  {name}", file=sys.stderr)
        result[f"b{B}"] = {
            "invariant_us": round(inv["us"], 1), "stock_us": round(st["us"], 1),
            "invariant_vs_stock": round(inv["us"] / st["us"], 2),
            "dot_share_of_invariant_ops": round(c["dot_share_of_invariant_ops"], 3),
            "padded_dots_floor_us": round(c["padded_dots_floor_us"], 1),
            "invariant_ops_us": {k: round(v, 1) for k, v in list(inv["ops_us"].items())[:8]},
            "stock_ops_us": {k: round(v, 1) for k, v in list(st["ops_us"].items())[:6]}}
    return result


if __name__ == "__main__":
    print(json.dumps(main()))
