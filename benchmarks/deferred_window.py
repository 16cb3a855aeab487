"""Where postponing loops pays: `deferred` over `dense` by rows per device.

The measurement behind `looprl.sampling.kv_policies.auto_max_pending`'s rule (a pending window of 0,
dense's execution, from AUTO_DENSE_ROWS = 16 rows per device on). For each model and row count,
in one process, side by side (`rollout._measure_group`: one warm-up call each, then REPEATS
interleaved rounds, medians of the decode seconds): `dense`, `deferred` with a postponing
window (the rule's window below 16 rows: 64 // rows - 1 clamped to [7, 63], at every size), and
`deferred` with the automatic bound.
Each key is a speedup, dense decode seconds / the configuration's (higher is better; > 1:
faster than dense): `postpone_vs_dense_{model}_b{rows}` and `auto_vs_dense_{model}_b{rows}`.

Models (`rollout.py`'s): `1p4b`: one layer of Ouro-1.4B width, random weights, gate bias -1,
q = 0.5, 16 new tokens; `main`: the main job's model (experiments/tiny_arith.py, hidden 64, one
layer), warm-started so the gate is trained, q = 0.5, 32 new tokens, prompts repeated 8 times as
in GRPO; `tiny`: the `tiny` preset (hidden 128, two layers), warm-started, q = 0.9, 32 new
tokens. Temperature 1, stop ids off, one XLA CPU device.

Run: `python benchmarks/deferred_window.py` (no arguments; budget 400 s on 2 CPU cores). Last
line: JSON.
"""
from __future__ import annotations

import json
import sys
import time

import rollout as R  # benchmarks/ (sets the XLA device count before jax starts)

from looprl.sampling import kv_policies  # noqa: E402

ROWS = {"1p4b": (4, 16), "main": (8, 16, 64, 256), "tiny": (16, 128)}
REPEATS = 3


def postponing_window(rows: int) -> int:
    """The automatic bound's window below AUTO_DENSE_ROWS, at any row count."""
    return int(min(63, max(7, 64 // max(rows, 1) - 1)))


def _model(name):
    """(config, device params, prompts, q, new tokens) of one of the module doc's models
    (`rollout.py`'s builders)."""
    if name == "main":
        return (*R.main_job_model(), 0.5, 32)
    if name == "1p4b":
        return (*R.wide_model(), 0.5, 16)
    cfg, params, _, task, tok = R.tiny_model()
    prompts = [tok.encode(task.format_prompt(p)) for p in task.train_problems(256, 50_000)]
    return cfg, params, prompts, 0.9, 32


def main() -> dict:
    t0 = time.time()
    out = {"benchmark": "deferred_window", "auto_dense_rows": kv_policies.AUTO_DENSE_ROWS}
    for name, rows in ROWS.items():
        mcfg, params, prompts, q, new = _model(name)
        for B in rows:
            configs = {"dense": dict(kv_policy="dense", exit_threshold=q),
                       "postpone": dict(kv_policy="deferred", exit_threshold=q,
                                        deferred_max_pending=postponing_window(B)),
                       "auto": dict(kv_policy="deferred", exit_threshold=q)}
            got = R._measure_group(mcfg, params, prompts[:B], configs, mcfg.total_ut_steps,
                                   max_new=new, repeats=2 if name == "1p4b" else REPEATS)
            dense = got["dense"]["decode_tokens_per_s"]
            for k in ("postpone", "auto"):
                out[f"{k}_vs_dense_{name}_b{B}"] = round(got[k]["decode_tokens_per_s"] / dense, 3)
            out[f"windows_{name}_b{B}"] = {k: got[k]["max_pending"] for k in ("postpone", "auto")}
            print(name, B, {k: out[f"{k}_vs_dense_{name}_b{B}"] for k in ("postpone", "auto")},
                  file=sys.stderr)
    out["wall_s"] = round(time.time() - t0, 1)
    return out


if __name__ == "__main__":
    print(json.dumps(main()))
