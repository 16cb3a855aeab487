"""Decode throughput of the KV policies `dense`, `deferred` and `copy`, and Flax against the
PyTorch reference. Run: `python benchmarks/rollout.py` (no arguments; a 400 s budget on 2 CPU
cores). Last line: JSON.

- The RL batch (`_rl_batch`): the main job's model, warm-started so the gate is trained, 256
  rows, q = 0.5. `*_vs_dense_*` keys are speedups (dense decode seconds / the policy's; > 1 is
  faster), beside the ideal T / mean exit loop, the share of it reached, each policy's share of
  dense's matmul work (`*_work_share_of_dense_b256`, from `loop_rows`) and what row compaction
  buys (`compaction_speedup_b256`). `*_1p4b_width_b64` (`_wide_layer`): one layer of Ouro-1.4B
  width, 64 rows.
- The sweep: the `tiny` preset at batch 1 and 16, decode and whole-call tokens/s per policy.
- `flax_vs_torch_decode_b{1,16,128}`: the reference's seconds / Flax's, greedy, all loops, each
  side at its better setting (`decode_vs_torch.flax_vs_torch`).

Decode tokens/s = rows x (new tokens - 1) / the decode steps' seconds (`generate(timings=)`;
the prefill, the same under every policy, is timed apart). Compared configurations run
interleaved (`looprl.timing`), so load on a shared machine hits them alike.
"""
from __future__ import annotations

import os

# decode_vs_torch sets one XLA CPU device per core (`--xla_force_host_platform_device_count`)
# for the Flax-vs-torch comparison's row mesh before jax starts, so it is imported first; every
# other measurement runs on device 0
from decode_vs_torch import flax_vs_torch, reference  # noqa: E402  (benchmarks/)

import functools  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from looprl.config import MeshConfig, load_experiment  # noqa: E402
from looprl.distributed.mesh import make_mesh  # noqa: E402
from looprl.model.config import from_model_section, preset  # noqa: E402
from looprl.model.looped import init_params  # noqa: E402
from looprl.sampling.sampler import SamplingConfig, generate  # noqa: E402
from looprl.tasks.arithmetic import ArithmeticTask  # noqa: E402
from looprl.timing import interleaved  # noqa: E402
from looprl.train.setup import build_tasks  # noqa: E402
from looprl.train.warm_start import warm_start  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# new tokens per row (stop ids off: every row decodes them all). At 32 (the sweep, `_b1_new32`)
# the sequence is so short that the work outside the loops dominates; 128 (the `_b1` keys) is
# closer to an RL rollout and shows the policies' steady state.
MAX_NEW = 32
B1_MAX_NEW = 128
BATCHES = (1, 16)  # the tiny preset's sweep (256 rows: the main job's model, `_rl_batch`)
RL_ROWS, RL_Q, RL_GROUP = 256, 0.5, 8  # the RL batch: 32 prompts x G = 8, q = 0.5
WIDE_ROWS, WIDE_NEW, WIDE_GATE_BIAS = 64, 8, -1.0  # one ouro-1.4b-width layer
THRESHOLDS = (0.9,)  # the b1/b16 sweep (q = 0.5: the 256-row RL batch, `_rl_batch`)
B1_Q = 0.9  # mean exit loop <= 2.0 with the trained gate (`b1_mean_exit_at_most_2`)
POLICIES = ("dense", "deferred", "copy")
# the sampler's default pending bound (kv_policies.auto_max_pending): 0 from 16 rows per device,
# dense's execution, as postponing loops costs more than it saves at these sizes on a CPU
MAX_PENDING = None
RL_MAX_PENDING = 4  # an explicit bound of 4, reported at b1 (`deferred_mp4`)
WINDOW = 7  # an explicit pending window at 256 / 64 rows: what postponing itself costs
WINDOW_KEY = f"deferred_window{WINDOW}"
REPEATS = 3
RL_REPEATS = 5  # the RL batch's calls are short (under a second): more rounds for its medians


def _interleaved(fns, repeats=None):
    """Median wall seconds of each callable in `fns` (name -> fn): one warm-up call each, then
    `repeats` (default REPEATS) rounds calling every fn once (`looprl.timing.interleaved`)."""
    return interleaved(fns, repeats or REPEATS, clock=time.perf_counter, warmup=1)


def _measure_group(cfg, params, prompts, configs, T, max_new=MAX_NEW, keep=None,
                   repeats=None):
    """Tokens/s of several sampler configs on the same prompts, interleaved: after one
    compile/warm-up call each, REPEATS rounds run every config once, and each config's median
    counts, so a change in machine load hits all of them alike. `configs`: name -> kwargs of
    `SamplingConfig` on top of the common ones. Returns name -> row dict with
    `decode_tokens_per_s` (the max_new - 1 tokens of the decode steps over their wall time, from
    `generate(timings=)`; what the KV policies change) and `tokens_per_s` (all max_new tokens
    over the whole call, prefill and the parameter digest included)."""
    B = len(prompts)
    out, decode_s = {}, {name: [] for name in configs}

    def run(name, scfg):
        timings = {}
        out[name] = generate(cfg, params, prompts, scfg, seed=0, timings=timings)
        decode_s[name].append(timings["decode_s"])

    secs = _interleaved({name: functools.partial(run, name, SamplingConfig(
        max_new_tokens=max_new, temperature=1.0, stop_ids=(), **kw))
        for name, kw in configs.items()}, repeats)
    if keep is not None:
        keep.update(out)
    rows = {}
    for name in configs:
        rb = out[name]
        mean_exit = float(rb.exit_loop_BxS[rb.exit_loop_BxS > 0].mean())
        tps = B * max_new / secs[name]
        dec = B * (max_new - 1) / statistics.median(decode_s[name][1:])  # [0]: the warm-up
        rows[name] = {"decode_tokens_per_s": dec, "tokens_per_s": tps,
                      "mean_exit_loop": mean_exit, "ideal_speedup": T / mean_exit,
                      "max_pending": rb.schedule.deferred_max_pending}
        print(f"B={B:3d} new={max_new:3d} {name:14s} {configs[name]} "
              f"(max_pending {rb.schedule.deferred_max_pending}) decode {dec:9.1f} tok/s "
              f"(whole call {tps:9.1f}) mean exit {mean_exit:.2f}", file=sys.stderr)
    return rows


def _work_share(rb, dense_rb):
    """Rows x positions the loops of `rb`'s decode steps ran (from its recorded `loop_rows`;
    a pass counts its width, `Schedule.window_widths`, in positions per row) over the same for
    `dense_rb`: the share of dense's matmul FLOPs the policy spent (attention aside)."""
    lr, ld = np.asarray(rb.loop_rows), np.asarray(dense_rb.loop_rows)
    work = np.asarray(rb.schedule.window_widths) @ lr.sum(axis=(0, 1, 2))
    return float(work / ld[..., 0].sum())


def _speedups(got, rbs, T):
    """Per-policy figures against dense: decode speedup (dense decode s / policy decode s),
    ideal T / mean exit, share of the ideal, and the share of dense's work."""
    out = {}
    for name, r in got.items():
        vs = r["decode_tokens_per_s"] / got["dense"]["decode_tokens_per_s"]
        out[name] = {**r, "vs_dense": vs, "fraction_of_ideal": vs / r["ideal_speedup"],
                     "work_share_of_dense": _work_share(rbs[name], rbs["dense"])}
    return out


def main_job_model():
    """The main job's model (experiments/tiny_arith.py: hidden 64, 1 layer, T = 4), briefly
    warm-started as in benchmarks/grpo_step.py (300 stage-I + 50 gate steps, so the gate is
    trained): (config, device params, the RL batch's 32 prompts x G = 8 = 256 token lists)."""
    cfg = load_experiment(ROOT / "experiments" / "tiny_arith.py")
    warm_task, rl_task = build_tasks(cfg)
    tok = warm_task.tokenizer()
    mcfg = from_model_section(cfg.model)
    ws = cfg.warm_start
    params, _ = warm_start(mcfg, init_params(mcfg, 0), warm_task, tok, steps=300,
                           batch_size=ws.batch_size, learning_rate=ws.learning_rate, seed=0,
                           gate_steps=50, entropy_beta=ws.entropy_beta)
    params = jax.device_put(jax.tree.map(np.asarray, params))
    prompts = [tok.encode(rl_task.format_prompt(p))
               for p in rl_task.train_problems(RL_ROWS // RL_GROUP, 0)]
    return mcfg, params, [p for p in prompts for _ in range(RL_GROUP)]


def wide_model():
    """One layer of ouro-1.4b width (hidden 2048, 16 heads, MLP 5632, T = 4; the arithmetic
    tokenizer's vocabulary), random weights with the gate bias at WIDE_GATE_BIAS (early exits):
    (config, device params, WIDE_ROWS prompts)."""
    task = ArithmeticTask(seed=0)
    tok = task.tokenizer()
    cfg = preset("ouro-1.4b", num_layers=1, vocab_size=tok.vocab_size)
    p = init_params(cfg, 0)
    p["early_exit_gate"]["bias"] = jnp.array([WIDE_GATE_BIAS])
    params = jax.device_put(jax.tree.map(np.asarray, p))
    return cfg, params, [tok.encode(task.format_prompt(q))
                         for q in task.train_problems(WIDE_ROWS, 7)]


def tiny_model():
    """The `tiny` preset (arithmetic task's tokenizer), warm-started with
    `looprl.train.warm_start` (stage I + stage II, so the exit gate is trained): (config,
    device params, the warm start's record, the task, its tokenizer)."""
    task = ArithmeticTask(seed=0)
    tok = task.tokenizer()
    cfg = preset("tiny", vocab_size=tok.vocab_size)
    params, ws = warm_start(cfg, init_params(cfg, 0), task, tok, steps=60, batch_size=32,
                            learning_rate=3e-3, seed=0, gate_steps=30)
    params = jax.device_put(jax.tree.map(np.asarray, params))  # on the device, as in training
    return cfg, params, ws, task, tok


def _rl_batch(max_new=MAX_NEW):
    """`main_job_model` at 256 rows, q = 0.5, stop ids off."""
    mcfg, params, prompts = main_job_model()
    configs = {p: dict(kv_policy=p, exit_threshold=RL_Q) for p in POLICIES}
    configs.update({f"{p}_uncompacted": dict(kv_policy=p, exit_threshold=RL_Q,
                                             row_compaction=False) for p in POLICIES})
    configs[WINDOW_KEY] = dict(kv_policy="deferred", exit_threshold=RL_Q,
                               deferred_max_pending=WINDOW)
    rbs = {}
    got = _measure_group(mcfg, params, prompts, configs, mcfg.total_ut_steps, max_new=max_new,
                         keep=rbs, repeats=RL_REPEATS)
    for p in POLICIES:  # what row compaction buys: the same policy without it, same run
        rbs[f"{p}_uncompacted"] = rbs[p]  # (its loop_rows are None; the work share is p's)
    return _speedups(got, rbs, mcfg.total_ut_steps)


def _wide_layer():
    """`wide_model` at 64 rows, q = 0.5, WIDE_NEW new tokens."""
    cfg, params, prompts = wide_model()
    configs = {p: dict(kv_policy=p, exit_threshold=RL_Q) for p in POLICIES}
    configs[WINDOW_KEY] = dict(kv_policy="deferred", exit_threshold=RL_Q,
                               deferred_max_pending=WINDOW)
    rbs = {}
    got = _measure_group(cfg, params, prompts, configs, cfg.total_ut_steps, max_new=WIDE_NEW,
                         keep=rbs, repeats=2)
    return _speedups(got, rbs, cfg.total_ut_steps)


def main() -> dict:
    t_start = time.time()
    # Not the main job's 1-layer, hidden-64 model: at that size one loop costs less than the
    # per-token work outside the loops (sampling, cache bookkeeping), so no KV policy can show
    # its saving; `tiny` is the smallest preset whose loops dominate a decode step on a CPU.
    cfg, params, ws, task, tok = tiny_model()
    T = cfg.total_ut_steps
    print(f"warm start: {ws['stage1_steps']} + {ws['stage2_steps']} steps, stage-I loss "
          f"{ws['stage1_final_loss']:.3f}, {ws['wall_s']:.0f}s", file=sys.stderr)
    problems = task.train_problems(128, 50_000)
    prompts_all = [tok.encode(task.format_prompt(p)) for p in problems]

    rows = {}  # (config, q, batch, new tokens) -> row
    for B in BATCHES:
        for q in THRESHOLDS:
            configs = {p: dict(kv_policy=p, exit_threshold=q, deferred_max_pending=MAX_PENDING)
                       for p in POLICIES}
            got = _measure_group(cfg, params, prompts_all[:B], configs, T)
            rows.update({(name, q, B, MAX_NEW): r for name, r in got.items()})
    configs = {p: dict(kv_policy=p, exit_threshold=B1_Q, deferred_max_pending=MAX_PENDING)
               for p in POLICIES}
    configs["deferred_mp4"] = dict(kv_policy="deferred", exit_threshold=B1_Q,
                                   deferred_max_pending=RL_MAX_PENDING)
    got = _measure_group(cfg, params, prompts_all[:1], configs, T, max_new=B1_MAX_NEW)
    rows.update({(name, B1_Q, 1, B1_MAX_NEW): r for name, r in got.items()})
    for (policy, q, B, n), r in rows.items():
        dense = rows[("dense", q, B, n)]
        r["vs_dense"] = r["decode_tokens_per_s"] / dense["decode_tokens_per_s"]
        r["fraction_of_ideal"] = r["vs_dense"] / r["ideal_speedup"]
        r["vs_dense_whole_call"] = r["tokens_per_s"] / dense["tokens_per_s"]

    # Flax vs the PyTorch reference decode (greedy, all T loops per token, same weights).
    ref = reference(cfg, params)
    # torch at the faster of its default threads and 1; Flax at the faster of one device and
    # its rows over one XLA CPU device per core, which gives every row one device's bits (the
    # two Flax runs' tokens and log-prob bits must be equal, or the run fails); at one row the
    # mesh has nothing to split and only adds overhead. `torch_decode` records the choices.
    mesh = make_mesh(MeshConfig(data=-1))
    torch_vs = {}
    for B in (1, 16, 128):
        P = min(len(p) for p in prompts_all[:B])  # the reference takes equal-length prompts
        torch_vs[B] = flax_vs_torch(cfg, params, ref, [p[:P] for p in prompts_all[:B]],
                                    MAX_NEW, 3 if B > 16 else REPEATS, mesh)

    rl = _rl_batch()
    wide = _wide_layer()
    table = {f"{p}_q{q}_b{B}_new{n}": {k: round(v, 3) for k, v in r.items()}
             for (p, q, B, n), r in rows.items()}
    r3 = lambda x: round(x, 3)  # noqa: E731
    b256 = {
        "copy_vs_dense_b256": r3(rl["copy"]["vs_dense"]),
        "deferred_vs_dense_b256": r3(rl["deferred"]["vs_dense"]),
        "ideal_speedup_copy_b256": r3(rl["copy"]["ideal_speedup"]),
        "fraction_of_ideal_copy_b256": r3(rl["copy"]["fraction_of_ideal"]),
        "mean_exit_loop_copy_b256": r3(rl["copy"]["mean_exit_loop"]),
        "mean_exit_loop_deferred_b256": r3(rl["deferred"]["mean_exit_loop"]),
        "deferred_work_share_of_dense_b256": r3(rl["deferred"]["work_share_of_dense"]),
        "deferred_max_pending_b256": rl["deferred"]["max_pending"],
        f"{WINDOW_KEY}_vs_dense_b256": r3(rl[WINDOW_KEY]["vs_dense"]),
        f"{WINDOW_KEY}_work_share_of_dense_b256": r3(rl[WINDOW_KEY]["work_share_of_dense"]),
        "copy_work_share_of_dense_b256": r3(rl["copy"]["work_share_of_dense"]),
        "decode_tokens_per_s_b256": {p: round(rl[p]["decode_tokens_per_s"], 1)
                                     for p in (*POLICIES, WINDOW_KEY)},
        "uncompacted_vs_dense_b256": {p: r3(rl[f"{p}_uncompacted"]["vs_dense"])
                                      for p in POLICIES},
        "compaction_speedup_b256": {p: r3(rl[p]["decode_tokens_per_s"]
                                          / rl[f"{p}_uncompacted"]["decode_tokens_per_s"])
                                    for p in POLICIES},
        "copy_vs_dense_1p4b_width_b64": r3(wide["copy"]["vs_dense"]),
        "deferred_vs_dense_1p4b_width_b64": r3(wide["deferred"]["vs_dense"]),
        "ideal_speedup_copy_1p4b_width_b64": r3(wide["copy"]["ideal_speedup"]),
        "mean_exit_loop_1p4b_width_b64": r3(wide["copy"]["mean_exit_loop"]),
        "deferred_work_share_of_dense_1p4b_width_b64": r3(
            wide["deferred"]["work_share_of_dense"]),
        f"{WINDOW_KEY}_vs_dense_1p4b_width_b64": r3(wide[WINDOW_KEY]["vs_dense"]),
        "decode_tokens_per_s_1p4b_width_b64": {p: round(wide[p]["decode_tokens_per_s"], 2)
                                               for p in POLICIES},
        "flax_vs_torch_decode_b128": r3(torch_vs[128]["flax_vs_torch"]),
        "flax_mesh_vs_torch_decode_b128": r3(torch_vs[128]["flax_mesh_vs_torch"]),
        "flax_1device_vs_torch_decode_b128": r3(torch_vs[128]["flax_1device_vs_torch"]),
    }
    b1 = {p: rows[(p, B1_Q, 1, B1_MAX_NEW)] for p in POLICIES}
    short = {p: rows[(p, B1_Q, 1, MAX_NEW)] for p in POLICIES}
    result = {
        "benchmark": "rollout",
        **b256,
        "deferred_vs_dense_b1": round(b1["deferred"]["vs_dense"], 3),
        "copy_vs_dense_b1": round(b1["copy"]["vs_dense"], 3),
        "mean_exit_loop_deferred": round(b1["deferred"]["mean_exit_loop"], 3),
        "mean_exit_loop_copy": round(b1["copy"]["mean_exit_loop"], 3),
        "ideal_speedup_deferred": round(b1["deferred"]["ideal_speedup"], 3),
        "ideal_speedup_copy": round(b1["copy"]["ideal_speedup"], 3),
        "fraction_of_ideal_deferred_b1": round(b1["deferred"]["fraction_of_ideal"], 3),
        "fraction_of_ideal_copy_b1": round(b1["copy"]["fraction_of_ideal"], 3),
        "b1_exit_threshold": B1_Q,
        "b1_max_new_tokens": B1_MAX_NEW,
        "b1_mean_exit_at_most_2": all(b1[p]["mean_exit_loop"] <= 2.0 for p in POLICIES),
        f"deferred_vs_dense_b1_new{MAX_NEW}": round(short["deferred"]["vs_dense"], 3),
        f"copy_vs_dense_b1_new{MAX_NEW}": round(short["copy"]["vs_dense"], 3),
        f"fraction_of_ideal_deferred_b1_new{MAX_NEW}": round(short["deferred"]["fraction_of_ideal"],
                                                             3),
        f"fraction_of_ideal_copy_b1_new{MAX_NEW}": round(short["copy"]["fraction_of_ideal"], 3),
        "flax_vs_torch_decode": round(torch_vs[1]["flax_vs_torch"], 3),
        "flax_vs_torch_decode_b16": round(torch_vs[16]["flax_vs_torch"], 3),
        "flax_mesh_vs_torch_decode": round(torch_vs[1]["flax_mesh_vs_torch"], 3),
        "flax_mesh_vs_torch_decode_b16": round(torch_vs[16]["flax_mesh_vs_torch"], 3),
        "flax_1device_vs_torch_decode": round(torch_vs[1]["flax_1device_vs_torch"], 3),
        "flax_1device_vs_torch_decode_b16": round(torch_vs[16]["flax_1device_vs_torch"], 3),
        "flax_stock_vs_torch_decode": round(torch_vs[1]["flax_stock_vs_torch"], 3),
        "flax_stock_vs_torch_decode_b16": round(torch_vs[16]["flax_stock_vs_torch"], 3),
        "deferred_vs_dense_b1_max_pending_4": round(
            rows[("deferred_mp4", B1_Q, 1, B1_MAX_NEW)]["vs_dense"], 3),
        "deferred_max_pending_b1": b1["deferred"]["max_pending"],
        f"vs_dense_by_batch_new{MAX_NEW}": {
            f"{p}_b{B}": round(rows[(p, B1_Q, B, MAX_NEW)]["vs_dense"], 3)
            for p in ("deferred", "copy") for B in BATCHES},
        "table": table,
        "torch_decode": {f"b{B}": {k: (round(v, 3) if isinstance(v, float) else v)
                                   for k, v in r.items()} for B, r in torch_vs.items()},
        "model": {"preset": "tiny", "num_params": cfg.num_params, "hidden_size": cfg.hidden_size,
                  "num_layers": cfg.num_layers, "total_ut_steps": T,
                  "vocab_size": cfg.vocab_size},
        "warm_start": {"stage1_steps": ws["stage1_steps"], "stage2_steps": ws["stage2_steps"],
                       "stage1_final_loss": round(ws["stage1_final_loss"], 4)},
        "max_new_tokens": MAX_NEW, "max_new_tokens_b1": B1_MAX_NEW,
        "threads": {"cpu_count": os.cpu_count(), "xla_flags": os.environ.get("XLA_FLAGS", ""),
                    "torch_default_threads": torch.get_num_threads()},
        "cpu": platform.processor() or platform.machine(), "jax": jax.__version__,
        "wall_s": round(time.time() - t_start, 1),
    }
    return result


if __name__ == "__main__":
    print(json.dumps(main()))
