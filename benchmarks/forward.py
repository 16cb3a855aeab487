"""Forward throughput: the jitted Flax full forward vs the PyTorch reference, same model and batch.

Both run the inspection forward (every loop's logits `[T, B, S, V]` and gate `[T, B, S]`) in
fp32 on the main job's tiny model (preset `tiny`: D=128, L=2, T=4, V=64) for a batch of
16 x 128 tokens, from one random HF checkpoint written to a temp directory, so both load the
same weights. Each side is warmed up (the Flax side compiled), then timed over several calls;
the contenders run in blocks, in order and then in reverse (ABBA, so a noisy shared machine
slows all of them alike), and the median over both blocks is reported. XLA runs with its
default threading (XLA_FLAGS recorded); torch runs both at its default intra-op thread count and
at 1 thread (on a loaded machine OpenMP threads can lose badly), and the headline ratio is taken
against the *faster* torch setting, so that it never flatters Flax.

Run: `python benchmarks/forward.py` (no arguments; well under 400 s on 2 CPU cores). The last
line is a JSON object with `flax_vs_torch_forward` = Flax tokens/s / torch tokens/s.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch

from looprl.io import hf
from looprl.model import looped
from looprl.model.config import preset
from looprl.model.looped import all_loop_outputs, cast_weights
from looprl.reference.torch_ouro import TorchOuro
from looprl.timing import abba

B, S = 16, 128
WARMUP, REPEATS = 2, 7


def main() -> dict:
    cfg = preset("tiny")
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: (rng.standard_normal(s.shape) * 0.05).astype(np.float32),
                          looped.expected_param_shapes(cfg))
    tokens = rng.integers(0, cfg.vocab_size, (B, S)).astype(np.int32)
    with tempfile.TemporaryDirectory() as d:
        path = hf.save_hf(params, cfg, Path(d) / "hf", "float32")
        model = hf.load_hf(path)
        ref = TorchOuro.from_hf(path)

    weights = cast_weights(model.weights(), model.compute_dtype)
    forward = jax.jit(lambda w, t: all_loop_outputs(cfg, w, t))
    tokens_j = jnp.asarray(tokens)
    t0 = time.perf_counter()
    jax.block_until_ready(forward(weights, tokens_j))
    compile_s = time.perf_counter() - t0
    default_threads = torch.get_num_threads()
    times = abba({"flax": lambda: forward(weights, tokens_j),
                  "torch": lambda: ref.forward(tokens),
                  "torch_1thread": lambda: ref.forward(tokens)},
                 REPEATS, warmup=WARMUP,
                 setups={"torch": lambda: torch.set_num_threads(default_threads),
                         "torch_1thread": lambda: torch.set_num_threads(1)})
    torch.set_num_threads(default_threads)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    flax_s = med["flax"]
    torch_best = min(("torch", "torch_1thread"), key=med.get)
    torch_s = med[torch_best]

    out = forward(weights, tokens_j)
    ref_logits, _ = ref.forward(tokens)
    max_diff = float(np.abs(np.asarray(out.logits) - ref_logits.numpy()).max())
    n_tok = B * S
    result = {
        "benchmark": "forward",
        "flax_vs_torch_forward": round((n_tok / flax_s) / (n_tok / torch_s), 3),
        "flax_tokens_per_s": round(n_tok / flax_s, 1),
        "torch_tokens_per_s": round(n_tok / torch_s, 1),
        "torch_setting_used": torch_best,
        "torch_default_threads_tokens_per_s": round(n_tok / med["torch"], 1),
        "torch_1thread_tokens_per_s": round(n_tok / med["torch_1thread"], 1),
        "median_s": {k: round(v, 5) for k, v in med.items()},
        "flax_compile_s": round(compile_s, 2),
        "repeats": 2 * REPEATS,
        "batch": [B, S],
        "model": {"preset": "tiny", "hidden_size": cfg.hidden_size, "num_layers": cfg.num_layers,
                  "total_ut_steps": cfg.total_ut_steps, "vocab_size": cfg.vocab_size},
        "dtype": "float32",
        "max_abs_logit_diff": max_diff,
        "torch_num_threads": default_threads,
        "os_cpu_count": os.cpu_count(),
        "load_avg_1min_at_end": round(os.getloadavg()[0], 2),  # >> cpu count: a shared machine
        "affinity_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "jax_backend": jax.default_backend(),
        "jax_version": jax.__version__,
        "torch_version": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
    }
    for name, ts in times.items():
        print(f"{name:14s} {n_tok / med[name]:10.0f} tok/s  (calls: {[round(t, 4) for t in ts]})",
              file=sys.stderr)
    return result


if __name__ == "__main__":
    print(json.dumps(main()))
