"""Decode throughput of the rollout engine: KV policies `dense`, `deferred`, `copy` (issue 3).

Model: the main job's tiny model (preset `tiny`, vocab of the arithmetic task's char tokenizer),
warm-started with `looprl.train.warm_start` (stage I + stage II, so the exit gate is trained),
the same weights, prompts (arithmetic task prompts) and seed for every configuration, in one
run. Each configuration samples at temperature 1 with stop ids off, so every row decodes
`MAX_NEW` tokens; tokens/s = rows x MAX_NEW / wall seconds of the whole `generate` call
(prefill included; the prompts are short), median of REPEATS calls after a compile/warm-up call.

Reported per policy, threshold q and batch size: tokens/s, mean exit loop, ratio to `dense` at
the same q and batch, and the ideal speed-up T / mean_exit_loop. The `_b1` keys are at batch 1
and the q of `B1_Q` (mean exit loop <= 2.0 for the trained gate, checked). Flax vs the PyTorch
reference (`TorchOuro.generate_greedy`, its own KV cache of one slot per (loop, layer), every
loop for every token): greedy decoding, all T loops, same weights, batch 1 and 16; torch at its
default thread count and at 1 thread, the faster one counts.

Run: `python benchmarks/rollout.py` (no arguments; <= 400 s on 2 CPU cores). Last line: JSON.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time

import jax
import numpy as np
import torch

from looprl.model import hf
from looprl.model.config import preset
from looprl.model.looped import init_params
from looprl.reference.torch_ouro import TorchOuro
from looprl.sampling.sampler import SamplingConfig, generate
from looprl.tasks.arithmetic import ArithmeticTask
from looprl.train.warm_start import warm_start

MAX_NEW = 32
BATCHES = (1, 16, 128)
THRESHOLDS = (0.5, 0.9)
B1_Q = 0.9
POLICIES = ("dense", "deferred", "copy")
REPEATS = 3


def _median_seconds(fn, repeats=REPEATS):
    fn()  # compile + warm-up
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main() -> dict:
    t_start = time.time()
    task = ArithmeticTask(seed=0)
    tok = task.tokenizer()
    cfg = preset("tiny", vocab_size=tok.vocab_size)
    T = cfg.total_ut_steps
    params, ws = warm_start(cfg, init_params(cfg, 0), task, tok, steps=60, batch_size=32,
                            learning_rate=3e-3, seed=0, gate_steps=30)
    params = jax.tree.map(np.asarray, params)
    print(f"warm start: {ws['stage1_steps']} + {ws['stage2_steps']} steps, stage-I loss "
          f"{ws['stage1_final_loss']:.3f}, {ws['wall_s']:.0f}s", file=sys.stderr)
    problems = task.train_problems(max(BATCHES), 50_000)
    prompts_all = [tok.encode(task.format_prompt(p)) for p in problems]

    rows = {}
    for B in BATCHES:
        prompts = prompts_all[:B]
        for q in THRESHOLDS:
            for policy in POLICIES:
                scfg = SamplingConfig(max_new_tokens=MAX_NEW, temperature=1.0, exit_threshold=q,
                                      kv_policy=policy, stop_ids=(), deferred_max_pending=4)
                out = {}

                def run():
                    out["rb"] = generate(cfg, params, prompts, scfg, seed=0)

                s = _median_seconds(run)
                rb = out["rb"]
                emit = rb.exit_loop_BxS > 0
                mean_exit = float(rb.exit_loop_BxS[emit].mean())
                rows[(policy, q, B)] = {"tokens_per_s": B * MAX_NEW / s,
                                        "mean_exit_loop": mean_exit,
                                        "ideal_speedup": T / mean_exit}
                print(f"B={B:3d} q={q} {policy:8s} {B * MAX_NEW / s:9.1f} tok/s "
                      f"mean exit {mean_exit:.2f}", file=sys.stderr)
    for (policy, q, B), r in rows.items():
        r["vs_dense"] = r["tokens_per_s"] / rows[("dense", q, B)]["tokens_per_s"]
        r["fraction_of_ideal"] = r["vs_dense"] / r["ideal_speedup"]

    # Flax vs the PyTorch reference decode (greedy, all T loops per token, same weights).
    state = hf.hf_state_from_params(params, cfg)
    ref = TorchOuro(cfg, {k: torch.from_numpy(np.asarray(v)) for k, v in state.items()})
    default_threads = torch.get_num_threads()
    torch_vs = {}
    for B in (1, 16):
        P = min(len(p) for p in prompts_all[:B])
        prompts = [p[:P] for p in prompts_all[:B]]  # the reference takes equal-length prompts
        scfg = SamplingConfig(max_new_tokens=MAX_NEW, temperature=0.0, exit_threshold=1.0,
                              kv_policy="dense", stop_ids=())
        flax_s = _median_seconds(lambda: generate(cfg, params, prompts, scfg))
        arr = np.asarray(prompts)
        torch_s = {}
        for name, threads in (("torch", default_threads), ("torch_1thread", 1)):
            torch.set_num_threads(threads)
            torch_s[name] = _median_seconds(lambda: ref.generate_greedy(arr, MAX_NEW))
        torch.set_num_threads(default_threads)
        best = min(torch_s, key=torch_s.get)
        torch_vs[B] = {"flax_tokens_per_s": B * MAX_NEW / flax_s,
                       "torch_tokens_per_s": B * MAX_NEW / torch_s[best], "torch_setting": best,
                       "flax_vs_torch": torch_s[best] / flax_s}
        print(f"B={B} greedy dense: flax {B * MAX_NEW / flax_s:.1f} tok/s, torch "
              f"{B * MAX_NEW / torch_s[best]:.1f} tok/s ({best})", file=sys.stderr)

    table = {f"{p}_q{q}_b{B}": {k: round(v, 3) for k, v in r.items()}
             for (p, q, B), r in rows.items()}
    b1 = {p: rows[(p, B1_Q, 1)] for p in POLICIES}
    result = {
        "benchmark": "rollout",
        "deferred_vs_dense_b1": round(b1["deferred"]["vs_dense"], 3),
        "copy_vs_dense_b1": round(b1["copy"]["vs_dense"], 3),
        "mean_exit_loop_deferred": round(b1["deferred"]["mean_exit_loop"], 3),
        "mean_exit_loop_copy": round(b1["copy"]["mean_exit_loop"], 3),
        "ideal_speedup_deferred": round(b1["deferred"]["ideal_speedup"], 3),
        "ideal_speedup_copy": round(b1["copy"]["ideal_speedup"], 3),
        "fraction_of_ideal_deferred_b1": round(b1["deferred"]["fraction_of_ideal"], 3),
        "fraction_of_ideal_copy_b1": round(b1["copy"]["fraction_of_ideal"], 3),
        "b1_exit_threshold": B1_Q,
        "b1_mean_exit_at_most_2": all(b1[p]["mean_exit_loop"] <= 2.0 for p in POLICIES),
        "flax_vs_torch_decode": round(torch_vs[1]["flax_vs_torch"], 3),
        "flax_vs_torch_decode_b16": round(torch_vs[16]["flax_vs_torch"], 3),
        "vs_dense_by_batch": {f"{p}_b{B}": round(rows[(p, B1_Q, B)]["vs_dense"], 3)
                              for p in ("deferred", "copy") for B in BATCHES},
        "table": table,
        "torch_decode": {f"b{B}": {k: (round(v, 3) if isinstance(v, float) else v)
                                   for k, v in r.items()} for B, r in torch_vs.items()},
        "model": {"preset": "tiny", "num_params": cfg.num_params, "hidden_size": cfg.hidden_size,
                  "num_layers": cfg.num_layers, "total_ut_steps": T,
                  "vocab_size": cfg.vocab_size},
        "warm_start": {"stage1_steps": ws["stage1_steps"], "stage2_steps": ws["stage2_steps"],
                       "stage1_final_loss": round(ws["stage1_final_loss"], 4)},
        "max_new_tokens": MAX_NEW,
        "threads": {"cpu_count": os.cpu_count(), "xla_flags": os.environ.get("XLA_FLAGS", ""),
                    "torch_default_threads": default_threads},
        "cpu": platform.processor() or platform.machine(), "jax": jax.__version__,
        "wall_s": round(time.time() - t_start, 1),
    }
    return result


if __name__ == "__main__":
    print(json.dumps(main()))
