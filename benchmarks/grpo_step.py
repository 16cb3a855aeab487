"""Seconds per GRPO step, split into rollout and learner, for `dense`, `deferred` and `copy`.

Main job shapes (`experiments/tiny_arith.py`: hidden 64, 1 layer, T = 4, 32 prompts x G = 8,
answer-only chain sums, its q and learner settings). The model is first warm-started briefly
(stage I then stage II, a few hundred steps) so completions and exit depths look like a trained
model's rather than a random one's. Then, for each KV policy, a fresh `GRPOLearner` from those
parameters runs one untimed step (compilation) and `STEPS` timed steps (`rollout_s`,
`learner_s` as the trainer reports them; the learner part includes the replay/stock
measurements). The policies run in ABBA blocks (dense, deferred, deferred, dense) so drift of a
shared machine hits both alike; medians over both blocks are reported.

Issue 18's keys are speedups (dense step seconds / the policy's step seconds; higher is
better), at 256 rows (the main job's 32 prompts x 8) with `rollout.max_new_tokens=128`:
`deferred_vs_dense_step_b256`, `copy_vs_dense_step_b256`, and `amdahl_bound_step_b256` = dense
step seconds / dense learner seconds, the speedup a free rollout would give. The older
`deferred_vs_dense_step` / `deferred_vs_dense_rollout` keys stay time ratios (policy / dense,
below 1: faster), as they were first reported.

Every configuration above measures the stock negative control each step, as the main job does
(`learner.measure_stock`, default on: `stock_max_abs_diff`). Until 2026-12-04 that pass ran on
the exact live prefix (P + the longest completion, unbucketed), so a step whose longest
completion was a new length compiled it again (0.7-0.9 s on a 2-core host) and the median of a
few timed steps carried those compiles unevenly (copy's learner 1.83 s against dense's 1.15 s
with the control, 1.05 s against 1.09 s without); it now runs on the learner's bucketed live
prefix like every other learner pass. `dense_no_stock` and `copy_no_stock` run without it:
`copy_vs_dense_step_b256_no_stock_control` and `amdahl_bound_step_b256_no_stock_control` are
the same two figures on those, and `stock_control_learner_s` the control's learner seconds per
step (learner seconds with it minus without).

The learner runs on each batch's live prefix (`learner.seq_bucket`, default 64: P + the longest
completion rounded up to 64 positions, instead of P + 128; the same bits). A fourth
configuration, `dense_whole_layout` (dense with `learner.seq_bucket=0`, the learner on all
P + 128 positions), runs in the same blocks: `live_prefix_learner_speedup_b256` = its learner
seconds / dense's, `live_prefix_step_speedup_b256` the same for the whole step (higher is
better), and `*_learner_seq_len` the positions each learner ran on.

Run: `python benchmarks/grpo_step.py` (no arguments; well under 400 s on 2 CPU cores). The last
line is one JSON object.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

from looprl.config import apply_overrides, load_experiment
from looprl.rl.learner import GRPOLearner
from looprl.model.looped import init_params
from looprl.train.setup import build_tasks
from looprl.model.config import from_model_section
from looprl.train.warm_start import warm_start

ROOT = Path(__file__).resolve().parents[1]
WARM_STEPS, GATE_STEPS, STEPS = 300, 50, 2
POLICIES = ("dense", "deferred", "copy")
CONFIGS = {p: [f"rollout.kv_policy={p}"] for p in POLICIES}
CONFIGS["dense_whole_layout"] = ["rollout.kv_policy=dense", "learner.seq_bucket=0"]
# without the stock negative control (`learner.measure_stock`, on by default): what the control
# costs a step (module doc; until 2026-12-04 mostly its per-length recompiles)
CONFIGS.update({f"{p}_no_stock": [f"rollout.kv_policy={p}", "learner.measure_stock=false"]
                for p in ("dense", "copy")})
MAX_NEW = 128  # rollout.max_new_tokens: the rollout a real share of the step (issue 18)


def main() -> dict:
    t_start = time.time()
    cfg = load_experiment(ROOT / "experiments" / "tiny_arith.py")
    warm_task, rl_task = build_tasks(cfg)
    tok = warm_task.tokenizer()
    mcfg = from_model_section(cfg.model)
    ws = cfg.warm_start
    params, _ = warm_start(mcfg, init_params(mcfg, cfg.run.seed), warm_task, tok,
                           steps=WARM_STEPS, batch_size=ws.batch_size,
                           learning_rate=ws.learning_rate, seed=cfg.run.seed,
                           gate_steps=GATE_STEPS, entropy_beta=ws.entropy_beta)
    params = jax.tree.map(np.asarray, params)
    warm_s = time.time() - t_start

    rows: dict[str, list[dict]] = {p: [] for p in CONFIGS}
    compile_s: dict[str, float] = {}
    for policy in [*CONFIGS, *list(CONFIGS)[::-1]]:  # ABCD DCBA blocks
        pcfg = apply_overrides(cfg, CONFIGS[policy] + [f"rollout.max_new_tokens={MAX_NEW}"])
        learner = GRPOLearner(pcfg, mcfg, params, rl_task, tok)
        t0 = time.perf_counter()
        learner.step(0)                       # compile (first block) / warm caches
        compile_s.setdefault(policy, time.perf_counter() - t0)
        for i in range(1, STEPS + 1):
            m = learner.step(i)
            rows[policy].append({k: m[k] for k in ("rollout_s", "learner_s", "mean_exit_loop",
                                                   "response_length", "learner_seq_len")})

    def med(policy, key):
        return statistics.median(r[key] for r in rows[policy])

    out: dict = {"benchmark": "grpo_step"}
    for p in CONFIGS:
        out[f"{p}_response_length"] = round(med(p, "response_length"), 2)
        out[f"{p}_learner_seq_len"] = max(r["learner_seq_len"] for r in rows[p])
    for p in CONFIGS:
        out[f"{p}_rollout_s"] = round(med(p, "rollout_s"), 4)
        out[f"{p}_learner_s"] = round(med(p, "learner_s"), 4)
        out[f"{p}_step_s"] = round(statistics.median(r["rollout_s"] + r["learner_s"]
                                                     for r in rows[p]), 4)
        out[f"{p}_first_step_s"] = round(compile_s[p], 2)
        out[f"{p}_mean_exit_loop"] = round(statistics.mean(r["mean_exit_loop"]
                                                           for r in rows[p]), 3)
    out.update({
        "sequences_per_step": cfg.rollout.sequences_per_step,
        "max_new_tokens": MAX_NEW,
        "exit_threshold": cfg.rollout.exit_threshold,
        "model": {"hidden_size": mcfg.hidden_size, "num_layers": mcfg.num_layers,
                  "total_ut_steps": mcfg.total_ut_steps},
        "timed_steps_per_policy": 2 * STEPS, "warm_start_s": round(warm_s, 1),
        "threads": {"cpu_count": os.cpu_count(),
                    "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                    else None,
                    "xla_flags": os.environ.get("XLA_FLAGS", ""),
                    "jax_devices": len(jax.devices())},
        "load_avg": os.getloadavg(), "python": sys.version.split()[0],
        "platform": platform.platform(), "jax": jax.__version__,
        "deferred_vs_dense_rollout": round(out["deferred_rollout_s"] / out["dense_rollout_s"], 3),
        "deferred_vs_dense_step": round(out["deferred_step_s"] / out["dense_step_s"], 3),
        "deferred_vs_dense_step_b256": round(out["dense_step_s"] / out["deferred_step_s"], 3),
        "copy_vs_dense_step_b256": round(out["dense_step_s"] / out["copy_step_s"], 3),
        "amdahl_bound_step_b256": round(out["dense_step_s"] / out["dense_learner_s"], 3),
        "rollout_share_of_dense_step": round(out["dense_rollout_s"] / out["dense_step_s"], 3),
        "copy_vs_dense_step_b256_no_stock_control": round(out["dense_no_stock_step_s"]
                                                          / out["copy_no_stock_step_s"], 3),
        "amdahl_bound_step_b256_no_stock_control": round(out["dense_no_stock_step_s"]
                                                         / out["dense_no_stock_learner_s"], 3),
        "stock_control_learner_s": {
            p: round(out[f"{p}_learner_s"] - out[f"{p}_no_stock_learner_s"], 4)
            for p in ("dense", "copy")},
        "live_prefix_learner_speedup_b256": round(out["dense_whole_layout_learner_s"]
                                                  / out["dense_learner_s"], 3),
        "live_prefix_step_speedup_b256": round(out["dense_whole_layout_step_s"]
                                               / out["dense_step_s"], 3),
        "wall_s": round(time.time() - t_start, 1),
    })
    return out


if __name__ == "__main__":
    print(json.dumps(main()))
