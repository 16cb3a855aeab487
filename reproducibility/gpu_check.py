"""Replay-vs-sampler bit check on an accelerator (GPU/TPU): one prepared script.

Runs rollouts with the tiny model and a wider one (random weights, gate biased so that most
tokens exit early) for fp32/bf16 x dense/deferred/copy, and compares `replay` log-probs (the
invariant teacher-forced pass) with the sampler's on raw bits, for the rollout batch as sampled
and for a permuted subset of rows; `stock` gives the negative control. Prints and writes JSON.

Usage: XLA_FLAGS=--xla_gpu_deterministic_ops=true python reproducibility/gpu_check.py [OUT.json]
"""
import json
import os
import sys
import time

import looprl  # noqa: F401  (sets looprl's XLA flags)
import jax
import jax.numpy as jnp
import numpy as np

from looprl.determinism import environment
from looprl.learner.logprobs import batch_logprobs
from looprl.model import init_params, preset
from looprl.sampling.sampler import SamplingConfig, generate


def bits(a):
    a = np.asarray(a)
    return a.view(np.uint32) if a.dtype == np.float32 else a


def main(out_path=None):
    t0 = time.time()
    cells = []
    models = {"tiny": preset("tiny"),
              "wide": preset("tiny", hidden_size=1024, num_heads=8, num_kv_heads=8,
                             head_dim=128, intermediate_size=2816, num_layers=4, vocab_size=4096)}
    rng = np.random.default_rng(0)
    for mname, cfg in models.items():
        params = init_params(cfg, 0)
        params["early_exit_gate"]["bias"] = jnp.array([-0.3])
        prompts = [list(rng.integers(3, cfg.vocab_size, size=n)) for n in (5, 3, 9, 7, 12, 4, 8, 6)]
        for dt in ("float32", "bfloat16"):
            for pol in ("dense", "deferred", "copy"):
                scfg = SamplingConfig(max_new_tokens=48, temperature=1.0, kv_policy=pol,
                                      exit_threshold=0.6, compute_dtype=dt,
                                      deferred_max_pending=4, stop_ids=(2,))
                rb = generate(cfg, params, prompts, scfg, group_size=4, seed=1)
                em = rb.exit_loop_BxS > 0
                rec = rb.logprob_BxS
                row = {"model": mname, "dtype": dt, "kv_policy": pol, "tokens": int(em.sum()),
                       "early_exit_fraction": float((rb.exit_loop_BxS[em] < cfg.T).mean())}
                lp, _ = batch_logprobs(cfg, params, rb, "replay")
                row["replay_exact"] = float((bits(lp) == bits(rec))[em].mean())
                row["replay_max_abs"] = float(np.abs(lp - rec)[em].max())
                perm = rng.permutation(rb.schedule.batch_size)[:11]
                lp2, _ = batch_logprobs(cfg, params, rb, "replay", rows=perm)
                row["replay_exact_perm"] = float((bits(lp2) == bits(rec[perm]))[em[perm]].mean())
                ls, _ = batch_logprobs(cfg, params, rb, "stock")
                row["stock_exact"] = float((bits(ls) == bits(rec))[em].mean())
                row["stock_max_abs"] = float(np.abs(ls - rec)[em].max())
                cells.append(row)
                print(json.dumps(row), flush=True)
    report = {"env": environment(), "cells": cells, "wall_s": time.time() - t0}
    if out_path:
        with open(out_path, "w") as f:
            json.dump(report, f, indent=1)
    print(json.dumps({"benchmark": "gpu_check", "all_replay_exact": all(
        c["replay_exact"] == 1.0 and c["replay_exact_perm"] == 1.0 for c in cells),
        "wall_s": round(time.time() - t0, 1)}))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
