"""Cost of the invariant kernels on an H100 and a TPU v5e, from compiled programs only (no device):
the invariant form (`pallas-gpu`, `pallas-tpu`) against two baselines, each compiled for each
compile-only target by `looprl.aot` (needs `pip install -e '.[aot]'`): `fair`, what a user would
run (`looprl.aot.fair`: XLA's dots and jax's own Pallas flash attention forward and backward,
jax's Pallas paged attention reading the cache in place at decode, compiled without looprl's GPU
pins), and `stock`, looprl's own negative control (plain XLA attention, the GPU pins).

Two programs at Ouro-1.4B width in bf16 (hidden 2048, 16 heads x 128, MLP 5632, V = 49,152; L =
24 layers, T = 4 loops): a learner step, 256 x 1024 tokens as MICROBATCHES microbatches of
MICRO_ROWS x 1024, each the forward and gradient of one loop's selected-token log-probs
(phase `learner_step`); and a decode step of 256 rows over a 2,048-slot KV cache (phase
`decode`). Each is compiled at 2 and 3 layers (programs that loop over their layers, as the
full stack does; 1 and 2 where a 3-layer program does not fit the device: `layers_measured`); a
layer's cost is the difference and a step is T x (head + L layers) per program run, times the
microbatches. Per step: kernel launches, bytes moved and FLOPs counted from the optimized HLO
(`looprl.aot.traffic`; XLA's own cost analysis, which counts a loop body once, beside as
`xla_cost`), peak memory of one program run, and a time estimate: the kernels one after
another, each max(its FLOPs / peak FLOP/s, its bytes / HBM bandwidth) at the published peaks
(`traffic`'s `serial_s`), plus a fixed cost per launch (`looprl.aot.targets.TARGETS`); the
whole step's max(compute, memory) is kept as `est_overlap_s`. Figures `*_vs_fair_*_est` and
`*_vs_stock_*_est` are invariant / baseline, lower is better (targets: learner <= 1.25, decode
<= 1.2 against fair).

What the estimate leaves out: each kernel's efficiency (the achieved fraction of peak,
occupancy, tile padding beyond the shapes, pipelining), overlap of kernels with each other,
caches (a GPU's L2 re-reads are free here, its HBM re-reads of an operand larger than L2 are
not counted; a TPU's re-reads are counted where `traffic` names them), work decided at run time
(left padding's skipped key blocks; `traffic.looprl_pairs`), the TPU's async copies' overlap,
and host time. A program that does not compile for its target (out of memory) is
`{"error": ...}` with its ratio null. `invariant_interpreted` is true where the form compiled its Pallas kernels interpreted. Run:
`python benchmarks/accel_cost.py`; the last line is a JSON object (`python benchmarks/accel_cost.py h100`: one target).
"""
from __future__ import annotations

import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only targets: nothing runs here

import looprl  # noqa: E402,F401 - sets XLA's flags before jax starts
from looprl.aot import fair as FA  # noqa: E402
from looprl.aot import inspect as I  # noqa: E402
from looprl.aot import programs as PR  # noqa: E402
from looprl.aot import targets as T  # noqa: E402
from looprl.aot import traffic as TR  # noqa: E402
from looprl.determinism import environment  # noqa: E402
from looprl.kernels import forms  # noqa: E402
from looprl.model.config import preset  # noqa: E402

import json  # noqa: E402
import sys  # noqa: E402

DTYPE = "bfloat16"
TOKENS_ROWS, SEQ = 256, 1024
MICRO_ROWS = 8
MICROBATCHES = TOKENS_ROWS // MICRO_ROWS
DECODE_ROWS, CACHE_SLOTS = 256, 2048
FULL = preset("ouro-1.4b")
INVARIANT = {"h100": "pallas-gpu", "v5e": "pallas-tpu"}


def _measure(target: str, form: str, phase, layers: int) -> dict:
    """One program's figures; form `fair` is `looprl.aot.fair`'s program (no GPU pins)."""
    cfg = preset("ouro-1.4b", num_layers=layers)
    t = T.target(target)
    if form == "fair":
        fn, args, donate = FA.build(cfg, DTYPE, phase, t.backend)
        with forms.use_form("stock"):
            c = T.compile_for(target, fn, *args, pinned=False, donate=donate)
    else:
        with forms.use_form(form):  # the sampler's weights as the form holds them
            fn, args = PR.build(cfg, DTYPE, phase, stock=form == "stock")
            c = T.compile_for(target, fn, *args)
    p = I.program(c)
    cost, moved = I.cost(c), TR.traffic(p, t.peak_flops[DTYPE], t.hbm_bytes_per_s)
    return {"launches": I.launches(p)["total"], "flops": moved["flops"],
            "serial_s": moved["serial_s"],
            "bytes": moved["bytes"], "xla_cost_flops": cost["flops"],
            "xla_cost_bytes": cost["bytes_accessed"], "peak_bytes": I.memory(c)["peak_bytes"],
            "interpreted": bool(I.interpreted(p)),
            "by_kind": {k: {"bytes": v["bytes"], "launches": v["launches"]}
                        for k, v in moved["by_kind"].items()}}


def _step(target: str, form: str, phase, runs: int, lo: int) -> dict:
    """A step's figures: `runs` program runs of T x (head + L layers), a layer the difference
    of the programs at lo + 1 and lo layers."""
    one, two = _measure(target, form, phase, lo), _measure(target, form, phase, lo + 1)
    t = T.target(target)
    out = {"layers_measured": [lo, lo + 1]}
    for k in ("launches", "flops", "bytes", "serial_s", "xla_cost_flops", "xla_cost_bytes"):
        layer = two[k] - one[k]
        out[k] = runs * FULL.total_ut_steps * (one[k] + (FULL.num_layers - lo) * layer)
    out["peak_bytes_one_run_2_layers"] = (one if lo == 2 else two)["peak_bytes"]
    out["layer_bytes_by_kind"] = {k: v["bytes"] - one["by_kind"].get(k, {}).get("bytes", 0.0)
                                  for k, v in two["by_kind"].items()}
    out["interpreted"] = one["interpreted"] or two["interpreted"]
    compute = out["flops"] / t.peak_flops[DTYPE]
    memory = out["bytes"] / t.hbm_bytes_per_s
    out["est_s"] = out["serial_s"] + out["launches"] * t.launch_s
    out["est_overlap_s"] = max(compute, memory) + out["launches"] * t.launch_s
    out["est_parts_s"] = {"compute": compute, "memory": memory, "kernels": out["serial_s"],
                          "launches": out["launches"] * t.launch_s}
    return out


def _step_or_error(target: str, form: str, phase, runs: int, lo: int) -> dict:
    """`_step`, or {"error": XLA's first line} where the program does not compile for the
    target (RESOURCE_EXHAUSTED: it does not fit the device's memory)."""
    try:
        return _step(target, form, phase, runs, lo)
    except Exception as e:  # jax.errors.JaxRuntimeError
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        return {"error": str(e).strip().splitlines()[0]}


def _ratio(a: dict, b: dict) -> float | None:
    return None if "error" in a or "error" in b else round(a["est_s"] / b["est_s"], 3)


def main(targets=("h100", "v5e")) -> dict:
    t0 = time.perf_counter()
    res: dict = {}
    for target in targets:
        reason = T.missing(target)
        if reason:
            res[f"skipped_{target}"] = reason
            continue
        for name, short, phase, runs in (
                ("learner_step", "learner", PR.learner_step(MICRO_ROWS, SEQ), MICROBATCHES),
                ("decode_step", "decode", PR.decode(DECODE_ROWS, CACHE_SLOTS), 1)):
            got = {}
            for form in (INVARIANT[target], "fair", "stock"):
                for lo in (2, 1):  # 3 layers where the program fits, else 2 (module doc)
                    got[form] = _step_or_error(target, form, phase, runs, lo)
                    if "error" not in got[form]:
                        break
            inv, fair, stock = got[INVARIANT[target]], got["fair"], got["stock"]
            res[f"{name}_{target}"] = {"invariant": inv, "fair": fair, "stock": stock}
            res[f"{short}_vs_fair_{target}_est"] = _ratio(inv, fair)
            res[f"{short}_vs_stock_{target}_est"] = _ratio(inv, stock)
            res[f"fair_bytes_{short}_{target}"] = fair.get("bytes")
            res[f"invariant_bytes_{short}_{target}"] = inv.get("bytes")
            if "error" not in inv:
                res[f"launches_per_{name}_{target}"] = inv["launches"]
                res["invariant_interpreted"] = res.get("invariant_interpreted", False) \
                    or inv["interpreted"]
    env = environment()
    res.update({"dtype": DTYPE, "microbatch": [MICRO_ROWS, SEQ], "microbatches": MICROBATCHES,
                "decode": [DECODE_ROWS, CACHE_SLOTS],
                "peaks": {n: {"flops": t.peak_flops[DTYPE], "hbm_bytes_per_s": t.hbm_bytes_per_s,
                              "launch_s": t.launch_s} for n, t in T.TARGETS.items()},
                "jax": env["jax"], "git_commit": env["git_commit"],
                "seconds": round(time.perf_counter() - t0, 1)})
    return res


if __name__ == "__main__":
    print(json.dumps(main(tuple(sys.argv[1:]) or ("h100", "v5e"))))
