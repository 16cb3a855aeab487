"""Seconds per GRPO step, split into rollout and learner, for `dense`, `deferred` and `copy`.
Run: `python benchmarks/grpo_step.py` (no arguments; under 400 s on 2 CPU cores). Last line:
JSON.

The main job's shapes (`experiments/tiny_arith.py`: 32 prompts x G = 8, its q and learner
settings), the model briefly warm-started so completions and exit depths look trained. Each
configuration gets a fresh `GRPOLearner`, one untimed step (compilation) and `STEPS` timed
ones (`rollout_s`, `learner_s` as the trainer reports them); configurations run in order and
then in reverse, so drift of a shared machine hits them alike, and report medians over both.

Speedups (dense step seconds / the policy's; higher is better) at 256 rows:
`deferred_vs_dense_step_b256`, `copy_vs_dense_step_b256`, and `amdahl_bound_step_b256` (dense
step / dense learner seconds: what a free rollout would give). `deferred_vs_dense_step` and
`deferred_vs_dense_rollout` are time ratios (policy / dense; below 1 is faster). `*_no_stock*`:
the same without the stock negative control (`stock_control_learner_s`: what it costs);
`live_prefix_*_speedup_b256`: dense on the live prefix against `dense_whole_layout`.
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
# the learner on all P + MAX_NEW positions instead of its live prefix (P + the longest completion
# rounded up to `learner.seq_bucket`); `*_learner_seq_len` reports the positions each ran on
CONFIGS["dense_whole_layout"] = ["rollout.kv_policy=dense", "learner.seq_bucket=0"]
# without the stock negative control (`learner.measure_stock`, on by default, as in the main
# job): what the control costs a step
CONFIGS.update({f"{p}_no_stock": [f"rollout.kv_policy={p}", "learner.measure_stock=false"]
                for p in ("dense", "copy")})
MAX_NEW = 128  # rollout.max_new_tokens: the rollout a real share of the step


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
