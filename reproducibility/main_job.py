"""Re-run the README's main job on this CPU and compare it with the documented run, bit for bit.

    python reproducibility/main_job.py                 # re-run, then compare (README: 2-13 min)
    python reproducibility/main_job.py --run-dir DIR   # compare a finished run, no re-run
    python reproducibility/main_job.py --record DIR    # write the documented digests from DIR

Prints `reproduced` (exit 0) when the warm start's parameters, every GRPO step's parameters
(`params_fingerprint` in metrics.jsonl) and the final `params_sha256` equal the documented ones
(`reproducibility/cpu/main_job.json`), else the first stage whose parameters differ (exit 1).
The recorded run is the AVX-512 host's native one; AVX2 emulation on that host
(`XLA_FLAGS=--xla_cpu_max_isa=AVX2 ONEDNN_MAX_CPU_ISA=AVX2`) gives the same digests at every
step, so any x86-64 CPU with AVX2 and FMA should print `reproduced` (docs/NUMERICS.md, "The
whole CPU run").
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXPECTED = ROOT / "reproducibility" / "cpu" / "main_job.json"
CONFIG = "experiments/tiny_arith.py"


class RunDirError(Exception):
    """A --run-dir that is no finished run of the main job: the message says what is missing."""


def _read(path: Path, run_dir: Path):
    if not run_dir.is_dir():
        raise RunDirError(f"--run-dir {run_dir}: no such directory")
    if not path.is_file():
        raise RunDirError(f"--run-dir {run_dir}: no {path.relative_to(run_dir)} (not a finished "
                          f"run of {CONFIG}; run `looprl train {CONFIG} out_dir={run_dir}` first, "
                          f"or leave out --run-dir to run it here)")
    return path.read_text()


def config_differences(run_dir: Path) -> list[str]:
    """The config keys (outside those a resume may change) whose values in the run's
    `config.json` differ from the main job's, as `key (main job -> run)`; [] without the file."""
    from looprl.config import load_experiment, load_json, to_dict
    from looprl.train.resume import RESUMABLE_KEYS, _flat

    path = run_dir / "config.json"
    if not path.is_file():
        return []
    a, b = _flat(to_dict(load_experiment(ROOT / CONFIG))), _flat(to_dict(load_json(path)))
    return [f"{k} ({a.get(k)!r} -> {b.get(k)!r})" for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k) and k not in RESUMABLE_KEYS]


def digests(run_dir: Path) -> dict:
    """The run's parameter digests: warm start, per GRPO step, final; and its accuracies.
    Raises RunDirError naming the first file a finished run has and `run_dir` lacks."""
    meta = json.loads(_read(run_dir / "warm_start" / "looprl_meta.json", run_dir))
    metrics = _read(run_dir / "metrics.jsonl", run_dir)
    summary = json.loads(_read(run_dir / "summary.json", run_dir))
    steps = [json.loads(line) for line in metrics.splitlines() if line.strip()]
    return {"config": CONFIG, "warm_start_params_sha256": meta["params_sha256"],
            "step_params_fingerprint": [s.get("params_fingerprint") for s in steps],
            "params_sha256": summary["params_sha256"],
            "eval_accuracy_before": summary["eval_accuracy_before"],
            "eval_accuracy_after": summary["eval_accuracy_after"]}


def first_difference(mine: dict, theirs: dict) -> str | None:
    """None when every digest is equal, else a sentence naming the first stage that differs."""
    if mine["warm_start_params_sha256"] != theirs["warm_start_params_sha256"]:
        return "the warm start's parameters differ (before the first GRPO step)"
    a, b = mine["step_params_fingerprint"], theirs["step_params_fingerprint"]
    for step, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"GRPO step {step}'s parameters differ ({x} here, {y} documented)"
    if len(a) != len(b):
        return f"{len(a)} GRPO steps here, {len(b)} documented"
    if mine["params_sha256"] != theirs["params_sha256"]:
        return f"the final params_sha256 differs ({mine['params_sha256']})"
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", type=Path, help="compare this finished run (no re-run)")
    ap.add_argument("--record", type=Path, help="write the documented digests from this run")
    ap.add_argument("--out", type=Path, default=Path("runs/reproduce_main_job"),
                    help="where the re-run goes when --run-dir is not given "
                         "(default: %(default)s)")
    ap.add_argument("--expected", type=Path, default=EXPECTED,
                    help="the recorded digests to compare with (default: %(default)s)")
    args = ap.parse_args(argv)
    if args.record:
        args.expected.write_text(json.dumps(digests(args.record), indent=2) + "\n")
        print(f"wrote {args.expected}")
        return 0
    run_dir = args.run_dir
    if run_dir is None:
        run_dir = args.out
        if run_dir.exists():
            sys.exit(f"{run_dir} exists: remove it or pass --out DIR")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
        subprocess.run([sys.executable, "-m", "looprl.cli", "train", str(ROOT / CONFIG),
                        f"out_dir={run_dir}", "progress_bar=False"], check=True, env=env)
    try:
        mine = digests(run_dir)
    except RunDirError as e:
        print(f"main_job.py: error: {e}", file=sys.stderr)
        return 2
    theirs = json.loads(args.expected.read_text())
    diff = first_difference(mine, theirs)
    other = config_differences(run_dir) if diff else []
    if other:
        diff += (f"; the run's config.json differs from {CONFIG} in {len(other)} key(s): "
                 + ", ".join(other[:6]))
    print("reproduced" if diff is None else f"not reproduced: {diff}")
    print(f"params_sha256 {mine['params_sha256']}; held-out accuracy "
          f"{mine['eval_accuracy_before']:.3f} -> {mine['eval_accuracy_after']:.3f}")
    return 0 if diff is None else 1


if __name__ == "__main__":
    sys.exit(main())
