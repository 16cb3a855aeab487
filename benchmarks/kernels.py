"""Cost of the row-invariant matmul (looprl.model.kernels.matmul) against the stock `x @ W`, at
the Ouro-1.4B widths (hidden 2048, MLP 5632, vocabulary 49152, exit gate [2048, 1]).

For every weight shape, fp32 and bf16 (lm_head with fp32 output, as lm_logits), and M in
{1, 2, 3, 5, 7, 8, 16, 256, 300, 1000, 4096} rows, both jitted functions run interleaved
(invariant, stock, invariant, stock, ... after one warm-up call each) in the same process; a
figure is median(invariant seconds) / median(stock seconds), lower is better. The lm_head is
timed up to M = 1000 (at 4096 one call is ~10 s on one core); its 4096-row memory is still
measured. Peak memory = temp + output bytes of `compile().memory_analysis()`. XLA runs with
looprl's flags and one intra-op thread (`--xla_cpu_multi_thread_eigen=false`, recorded).

Run: `python benchmarks/kernels.py` (no arguments; about 2-5 minutes on 2 shared CPU cores). The
last line is a JSON object with `matmul_vs_stock_large_1p4b` (worst ratio at M >= 256),
`matmul_vs_stock_small_1p4b` (worst at M <= 16) and `matmul_peak_mem_vs_stock_1p4b` (worst
memory ratio at M = 4096) over the big weights (q/k/v/o, gate/up, down, lm_head), the same three
as `gate_*` for the exit gate `[2048, 1]` alone (whose stock call is a ~1 ms matrix-vector
product with a near-zero peak, `gate_stock_ms_M1000`, so its ratios say little about a step's
cost), plus every figure.
"""
from __future__ import annotations

import os
import sys

# `python benchmarks/kernels.py` puts benchmarks/ first on sys.path, so an installed looprl (an
# editable install of another checkout) would win over this tree's: put this tree first.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_cpu_multi_thread_eigen=false").strip()

import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from looprl.determinism import environment  # noqa: E402
from looprl.model import kernels as kn  # noqa: E402

D, F, V = 2048, 5632, 49152
WEIGHTS = {"qkvo": (D, D), "gate_up": (D, F), "down": (F, D), "lm_head": (D, V),
           "exit_gate": (D, 1)}
ROWS = (1, 2, 3, 5, 7, 8, 16, 256, 300, 1000, 4096)
TIMED_MAX_ROWS = {"lm_head": 1000}


def _repeats(m: int) -> int:
    return 5 if m <= 16 else 3 if m <= 300 else 1


def _peak_bytes(fn, *args) -> int:
    mem = jax.jit(fn).lower(*args).compile().memory_analysis()
    return int(mem.temp_size_in_bytes + mem.output_size_in_bytes)


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
                times = {"inv": [], "stock": []}
                for f in (inv, stock):
                    jax.block_until_ready(f(x, w))
                for _ in range(_repeats(m)):
                    for key, f in (("inv", inv), ("stock", stock)):
                        t0 = time.perf_counter()
                        jax.block_until_ready(f(x, w))
                        times[key].append(time.perf_counter() - t0)
                ratio = statistics.median(times["inv"]) / statistics.median(times["stock"])
                if name == "exit_gate" and m == 1000:
                    gate_ms[dtype] = round(statistics.median(times["stock"]) * 1e3, 3)
                figures[tag] = round(ratio, 3)
                print(f"{tag:28s} invariant/stock {ratio:5.2f}  (stock "
                      f"{statistics.median(times['stock']) * 1e3:8.2f} ms)", flush=True)
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
    env = environment()
    return {
        **out,
        "gate_stock_ms_M1000": gate_ms.get("float32"),
        "figures": figures, "peak_mem_vs_stock_M4096": {k: round(v, 3) for k, v in mem.items()},
        "kernels_file": kn.__file__, "threads": 1, "xla_flags": env["xla_flags"], "cpu_model": env["cpu_model"],
        "jax": env["jax"], "git_commit": env["git_commit"],
        "seconds": round(time.perf_counter() - t_start, 1),
    }


if __name__ == "__main__":
    print(json.dumps(main()))
