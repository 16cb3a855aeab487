"""A CPU run's bits do not depend on the instruction set (docs/NUMERICS.md, "The whole CPU run").

A shortened smoke job runs twice, in two processes: under the machine's own ISA and under
AVX2 emulation (`--xla_cpu_max_isa=AVX2`, oneDNN held to AVX2). The warm start's parameters,
every GRPO step's rollout (`rollout_sha256`: tokens, exit loops and log-prob bits) and
parameters (`params_fingerprint`), and the final `params_sha256` must be equal. Needs a CPU
with AVX-512, so that the emulation runs other code than the native run.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from looprl.determinism import AVX512_CORE, cpu_flags

ROOT = Path(__file__).resolve().parents[2]
SHORT = ("warm_start.max_steps=24", "warm_start.gate_steps=4", "run.grpo_steps=2",
         "optim.max_grad_norm=0.05", "eval.eval_problems=8", "eval.eval_batch_size=8",
         "task.eval_size=8", "run.tensorboard=False", "run.progress_bar=False")


def _run(out: Path, avx2: bool) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    env.pop("ONEDNN_MAX_CPU_ISA", None)
    if avx2:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_cpu_max_isa=AVX2".strip()
        env["ONEDNN_MAX_CPU_ISA"] = "AVX2"
    return subprocess.Popen([sys.executable, "-m", "looprl.cli", "train",
                             str(ROOT / "experiments" / "tiny_arith_smoke.py"),
                             f"run.out_dir={out}", *SHORT], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _digests(out: Path) -> dict:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"warm_start": json.loads((out / "warm_start" / "looprl_meta.json").read_text())
            ["params_sha256"],
            "rollouts": [r["rollout_sha256"] for r in rows],
            "step_params": [r["params_fingerprint"] for r in rows],
            "grad_norms": [r["grad_norm"] for r in rows],
            "final": json.loads((out / "summary.json").read_text())["params_sha256"]}


@pytest.fixture(scope="module")
def both_runs(tmp_path_factory):
    """The shortened smoke job's digests under the native ISA and under AVX2 emulation."""
    if not set(AVX512_CORE) <= cpu_flags():
        pytest.skip("this CPU has no AVX-512: the test compares a native run with one under "
                    "AVX2 emulation, and on an AVX2 CPU both are the same run (the committed "
                    "main job's digests check this CPU: reproducibility/main_job.py)")
    tmp = tmp_path_factory.mktemp("isa")
    procs = {name: _run(tmp / name, name == "avx2") for name in ("native", "avx2")}
    for name, proc in procs.items():
        log, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{name} run failed:\n{log[-3000:]}"
    return tuple(_digests(tmp / name) for name in procs)


def test_warm_start_and_first_rollout_equal_under_avx2_emulation(both_runs):
    native, avx2 = both_runs
    assert len(native["rollouts"]) == 2 and all(native["step_params"])
    # the global-norm clip scales every update (its norm is an ordered sum: docs/NUMERICS.md)
    assert min(native["grad_norms"]) > 0.05
    assert native["warm_start"] == avx2["warm_start"]
    assert native["rollouts"][0] == avx2["rollouts"][0]


def test_every_step_equal_under_avx2_emulation(both_runs):
    native, avx2 = both_runs
    assert native == avx2
