"""Flax greedy decode vs the PyTorch reference, at one layer of Ouro-1.4B width.

`rollout.py`'s `flax_vs_torch_decode_b{1,16,128}` compare the two on the tiny preset (4 heads of
32, hidden 128), where a decode step is a few hundred small dots and per-call overhead decides
(`attention_profile.py`). This script asks the same at the width users run: one layer of
`ouro-1.4b` (hidden 2048, 16 heads of 128, MLP 5632, T = 4) with the full 49,152-token
vocabulary, random weights, random prompts of `PROMPT_LEN` tokens, greedy, all T loops per
token (`exit_threshold=1.0`), `MAX_NEW` new tokens, whole calls on both sides (prefill
included), at 16 and 128 rows.

Contenders, timed side by side in interleaved rounds after one warm-up call each (wall seconds,
`looprl.timing.interleaved`): Flax with the invariant kernels with its rows split over a data
mesh of one XLA CPU device per core (`invariant_mesh`; at 16 rows also on one device, `invariant`, and
the two must give the same tokens and log-prob bits or the run fails), Flax with the stock
kernels on one device (`stock`), and the reference (`TorchOuro.generate_greedy`, fp32) at
torch's default intra-op threads (`torch`; at 16 rows also at 1 thread). `flax_vs_torch_*` =
torch's best seconds / Flax's best invariant seconds (higher is better; > 1: Flax faster),
whole calls; `flax_vs_torch_decode_steps_*` the same for the decode steps alone (the
MAX_NEW - 1 steps after the prefill, which emits the first token: `generate(timings=)` and
`TorchOuro.generate_greedy(timings=)`, medians of the timed calls); `flax_stock_*` with the
stock kernels. The cache is short (PROMPT_LEN + MAX_NEW slots), so this is the matmuls' race,
not attention's (`kernels.py`'s `attention_decode_vs_stock_1p4b` covers long caches).

`matmul_vs_stock_threaded`: what the decode's matmuls cost, each fp32 Ouro-1.4B weight shape
alone at the decode's row counts (16, and 64: a mesh device's share of 128), invariant ÷ stock
wall seconds (lower is better), medians of MATMUL_REPEATS interleaved calls, with XLA's default
Eigen threading as in the decode (`benchmarks/kernels.py` pins one thread), and each form's CPU
÷ wall seconds (how many cores it kept busy).

`flax_vs_torch(...)` is the one comparison, shared with `rollout.py`.

Run: `python benchmarks/decode_vs_torch.py` (no arguments; budget 400 s on 2 CPU cores). Last
line: JSON.
"""
from __future__ import annotations

import os

# one XLA CPU device per core for the row mesh; must be set before jax starts (rollout.py
# imports this module first for the same reason)
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_"
                               f"device_count={len(os.sched_getaffinity(0))}").strip()

import functools  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from looprl.config import MeshConfig  # noqa: E402
from looprl.distributed.mesh import make_mesh  # noqa: E402
from looprl.io import hf  # noqa: E402
from looprl import kernels  # noqa: E402
from looprl.model.config import preset  # noqa: E402
from looprl.model.looped import init_params  # noqa: E402
from looprl.reference.torch_ouro import TorchOuro  # noqa: E402
from looprl.sampling.sampler import SamplingConfig, generate  # noqa: E402
from looprl.timing import interleaved  # noqa: E402

FLAX = ("invariant", "invariant_mesh", "stock")
TORCH = ("torch", "torch_1thread")
PROMPT_LEN, MAX_NEW = 8, 8
SETTINGS = {16: FLAX + TORCH, 128: ("invariant_mesh", "stock", "torch")}  # rows -> contenders
REPEATS = 2
MATMUL_ROWS, MATMUL_REPEATS = (16, 64), 7


def matmul_ratios(cfg, rows=MATMUL_ROWS, repeats=MATMUL_REPEATS) -> dict:
    """`{f"{weight}_m{M}": {"vs_stock", "invariant_ms", "stock_ms", "invariant_cores",
    "stock_cores"}}` for each fp32 weight shape of `cfg` at M rows (module doc)."""
    D, F, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    shapes = {"qkvo": (D, D), "gate_up": (D, F), "down": (F, D), "lm_head": (D, V)}
    rng = np.random.default_rng(0)
    out = {}
    for M in rows:
        for name, (i, o) in shapes.items():
            x = jnp.asarray(rng.standard_normal((M, i)), jnp.float32)
            w = jnp.asarray(rng.standard_normal((i, o)) * 0.02, jnp.float32)
            fns = {k: functools.partial(jax.jit(f), x, w)
                   for k, f in (("invariant", kernels.matmul), ("stock", kernels.stock_matmul))}
            wall = interleaved(fns, repeats, clock=time.perf_counter, warmup=1)
            cpu = interleaved(fns, repeats, clock=time.process_time)
            out[f"{name}_m{M}"] = {"vs_stock": wall["invariant"] / wall["stock"],
                                   **{f"{k}_ms": 1e3 * wall[k] for k in fns},
                                   **{f"{k}_cores": cpu[k] / wall[k] for k in fns}}
            print(f"matmul {name} M={M}: invariant / stock {out[f'{name}_m{M}']['vs_stock']:.2f}"
                  f" ({1e3 * wall['invariant']:.1f} vs {1e3 * wall['stock']:.1f} ms)",
                  file=sys.stderr)
    return out


def reference(cfg, params) -> TorchOuro:
    """The PyTorch reference holding the same weights as `params` (fp32)."""
    state = hf.hf_state_from_params(params, cfg)
    return TorchOuro(cfg, {k: torch.from_numpy(np.asarray(v)) for k, v in state.items()})


def flax_vs_torch(cfg, params, ref: TorchOuro, prompts, max_new: int, repeats: int, mesh,
                  settings=FLAX + TORCH) -> dict:
    """Greedy decode of `prompts` (equal-length token lists: the reference takes no padding),
    all loops, `max_new` new tokens, by each contender in `settings` (module doc), interleaved
    (`repeats` rounds after one warm-up call each; wall seconds). Returns tokens/s per contender
    and `flax_vs_torch` (torch's best seconds / Flax's best invariant seconds; higher is
    better), `flax_mesh_vs_torch`, `flax_1device_vs_torch`, `flax_stock_vs_torch` for those
    timed. Raises SystemExit when the mesh's and one device's tokens or log-prob bits differ."""
    B = len(prompts)
    arr = np.asarray(prompts)
    default_threads = torch.get_num_threads()
    out, decode_s = {}, {k: [] for k in settings}

    def flax_run(name, kernels, mesh=None):
        timings = {}
        out[name] = generate(cfg, params, prompts, SamplingConfig(
            max_new_tokens=max_new, temperature=0.0, exit_threshold=1.0, kv_policy="dense",
            stop_ids=(), kernels=kernels), mesh=mesh, timings=timings)
        decode_s[name].append(timings["decode_s"])

    def torch_run(name, threads):
        timings = {}
        torch.set_num_threads(threads)
        ref.generate_greedy(arr, max_new, timings=timings)
        decode_s[name].append(timings["decode_s"])

    every = {"invariant": functools.partial(flax_run, "invariant", "invariant"),
             "invariant_mesh": functools.partial(flax_run, "invariant_mesh", "invariant", mesh),
             "stock": functools.partial(flax_run, "stock", "stock"),
             "torch": functools.partial(torch_run, "torch", default_threads),
             "torch_1thread": functools.partial(torch_run, "torch_1thread", 1)}
    secs = interleaved({k: every[k] for k in settings}, repeats, clock=time.perf_counter,
                       warmup=1)
    torch.set_num_threads(default_threads)
    dec = {k: statistics.median(v[1:]) for k, v in decode_s.items()}  # [0]: the warm-up
    if "invariant" in out and "invariant_mesh" in out:
        one, many = out["invariant"], out["invariant_mesh"]
        if not (np.array_equal(np.asarray(one.tokens_BxS), np.asarray(many.tokens_BxS))
                and np.array_equal(np.asarray(one.logprob_BxS).view(np.uint32),
                                   np.asarray(many.logprob_BxS).view(np.uint32))):
            raise SystemExit(f"B={B}: the {mesh.size}-device rollout's tokens or log-prob bits "
                             "differ from one device's (row invariance broken)")
    torch_best = min((k for k in TORCH if k in secs), key=secs.get)
    flax_best = min((k for k in ("invariant_mesh", "invariant") if k in secs), key=secs.get)
    rec = {f"{k}_tokens_per_s": B * max_new / s for k, s in secs.items()}
    rec.update({"torch_setting": torch_best, "flax_setting": flax_best,
                "flax_devices": mesh.size if flax_best == "invariant_mesh" else 1,
                "flax_tokens_per_s": B * max_new / secs[flax_best],
                "torch_best_tokens_per_s": B * max_new / secs[torch_best],
                "flax_vs_torch": secs[torch_best] / secs[flax_best]})
    names = {"invariant_mesh": "flax_mesh", "invariant": "flax_1device", "stock": "flax_stock"}
    rec.update({f"{names[k]}_vs_torch": secs[torch_best] / secs[k] for k in names if k in secs})
    rec.update({f"{names[k]}_vs_torch_decode_only": dec[torch_best] / dec[k]
                for k in names if k in secs})
    rec["flax_vs_torch_decode_only"] = dec[torch_best] / dec[flax_best]
    print(f"B={B} greedy dense: " + ", ".join(f"{k} {B * max_new / s:.1f} tok/s"
                                              for k, s in secs.items())
          + f"; flax's best: {flax_best}, torch's: {torch_best}", file=sys.stderr)
    return rec


def main() -> dict:
    t_start = time.time()
    cfg = preset("ouro-1.4b", num_layers=1)
    params = jax.device_put(jax.tree.map(np.asarray, init_params(cfg, 0)))
    ref = reference(cfg, params)
    mm = matmul_ratios(cfg)
    mesh = make_mesh(MeshConfig(data=-1))
    rng = np.random.default_rng(0)
    got = {}
    for B, settings in SETTINGS.items():
        prompts = rng.integers(0, cfg.vocab_size, (B, PROMPT_LEN)).tolist()
        got[B] = flax_vs_torch(cfg, params, ref, prompts, MAX_NEW, REPEATS, mesh, settings)
    r3 = lambda x: round(x, 3) if isinstance(x, float) else x  # noqa: E731
    result = {"benchmark": "decode_vs_torch"}
    for B, rec in got.items():
        result[f"flax_vs_torch_decode_1p4b_width_b{B}"] = r3(rec["flax_vs_torch"])
        result[f"flax_stock_vs_torch_decode_1p4b_width_b{B}"] = r3(rec["flax_stock_vs_torch"])
        result[f"flax_vs_torch_decode_steps_1p4b_width_b{B}"] = r3(
            rec["flax_vs_torch_decode_only"])
        result[f"flax_stock_vs_torch_decode_steps_1p4b_width_b{B}"] = r3(
            rec["flax_stock_vs_torch_decode_only"])
    result["matmul_vs_stock_threaded"] = {k: r3(v["vs_stock"]) for k, v in mm.items()}
    result.update({
        "matmuls": {k: {n: r3(x) for n, x in v.items()} for k, v in mm.items()},
        "per_batch": {f"b{B}": {k: r3(v) for k, v in rec.items()} for B, rec in got.items()},
        "model": {"preset": "ouro-1.4b", "num_layers": 1, "hidden_size": cfg.hidden_size,
                  "num_heads": cfg.num_heads, "vocab_size": cfg.vocab_size,
                  "total_ut_steps": cfg.total_ut_steps},
        "prompt_len": PROMPT_LEN, "max_new_tokens": MAX_NEW, "repeats": REPEATS,
        "threads": {"cpu_count": os.cpu_count(), "xla_flags": os.environ.get("XLA_FLAGS", ""),
                    "torch_default": torch.get_num_threads()},
        "cpu": platform.machine(), "jax": jax.__version__,
        "wall_s": round(time.time() - t_start, 1)})
    return result


if __name__ == "__main__":
    print(json.dumps(main()))
