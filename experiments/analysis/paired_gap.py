"""Paired comparison of each learner's final held-out accuracy against a baseline learner, over
the seeds of a multi-variant experiment, for a paper reader who asks "is the difference real?".

Each variant's final checkpoint is evaluated again with `looprl eval` (its recorded task and
settings), which gives per-problem outcomes; the script checks that the re-evaluation's accuracy
equals the run's `eval_accuracy_after` bit for bit (else it stops). For each learner L and the
baseline B, with d[s, i] = correct_L[s, i] - correct_B[s, i] on held-out problem i of seed s:

  gap       mean over seeds and problems of d (points)
  per seed  the mean of d in each seed
  CI95      a hierarchical paired bootstrap (seeds drawn with replacement, then problems within
            each drawn seed), percentile interval, `--bootstrap` draws, fixed seed 0
  sign p    the exact two-sided sign-flip test over the per-seed gaps (2^S flips; with S = 3 its
            smallest attainable p is 0.25, so 3 seeds alone cannot reject)
  verdict   "no difference detected" when the CI holds 0, else which learner is higher

    python experiments/analysis/paired_gap.py runs/horizon/seed0 runs/horizon/seed1 \
        runs/horizon/seed2 --baseline hybrid --out experiments/figures/horizon/paired_gap.md
"""
from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np


def variant_dirs(seed_dir: Path) -> dict[str, Path]:
    """Variant name -> run directory: the subdirectories holding a summary.json with GRPO steps."""
    out = {}
    for d in sorted(p for p in seed_dir.iterdir() if p.is_dir()):
        s = d / "summary.json"
        if s.exists() and json.loads(s.read_text()).get("grpo_steps", 0) > 0:
            out[d.name] = d
    return out


def per_problem(run: Path, cache: Path) -> np.ndarray:
    """int8 [N]: 1 where the final checkpoint's greedy answer to held-out problem i is correct.
    Runs `looprl eval` into `cache` once; raises SystemExit if its accuracy is not the run's."""
    probs = cache / "problems.jsonl"
    if not probs.exists():
        cache.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "looprl.cli", "eval", "--checkpoint", str(run / "checkpoint"),
               "--out", str(cache), "--json"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    rows = [json.loads(x) for x in probs.read_text().splitlines() if x.strip()]
    by_q = [r["by_threshold"] for r in rows]
    (q,) = {tuple(b) for b in by_q}  # one threshold: the run's own
    correct = np.array([b[q[0]]["correct"] for b in by_q], np.int8)
    want = json.loads((run / "summary.json").read_text())["eval_accuracy_after"]
    if float(correct.mean()) != want:
        raise SystemExit(f"{run}: re-evaluated accuracy {correct.mean()!r} != the run's "
                         f"eval_accuracy_after {want!r}; the comparison would be of other runs")
    return correct


def paired_stats(d_SxN: np.ndarray, draws: int, rng: np.random.Generator) -> dict:
    """Gap statistics of paired differences d [S, N] (one row per seed)."""
    S, N = d_SxN.shape
    per_seed = d_SxN.mean(axis=1)
    boot = np.empty(draws)
    for k in range(draws):
        seeds = rng.integers(0, S, S)
        boot[k] = np.mean([d_SxN[s, rng.integers(0, N, N)].mean() for s in seeds])
    lo, hi = np.percentile(boot, [2.5, 97.5])
    obs = abs(per_seed.mean())
    flips = [abs(np.mean(per_seed * np.array(sg))) for sg in itertools.product((1, -1), repeat=S)]
    p = float(np.mean([f >= obs - 1e-12 for f in flips]))
    return {"gap": float(d_SxN.mean()), "per_seed": per_seed.tolist(), "ci": (lo, hi), "p": p}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("seed_dirs", nargs="+", type=Path)
    ap.add_argument("--baseline", default="hybrid")
    ap.add_argument("--bootstrap", type=int, default=10_000)
    ap.add_argument("--evals", type=Path, default=None, help="cache of re-evaluations "
                    "(default: SEED_DIR/../paired_evals)")
    ap.add_argument("--out", type=Path, default=None, help="markdown table (default: stdout)")
    a = ap.parse_args(argv)
    correct: dict[str, list[np.ndarray]] = {}
    for sd in a.seed_dirs:
        cache = a.evals or sd.parent / "paired_evals"
        for name, run in variant_dirs(sd).items():
            correct.setdefault(name, []).append(per_problem(run, cache / sd.name / name))
    if a.baseline not in correct:
        raise SystemExit(f"--baseline {a.baseline!r}: no such variant (found {sorted(correct)})")
    S = len(a.seed_dirs)
    base = np.stack(correct[a.baseline])
    lines = [f"Paired against `{a.baseline}`: {S} seeds x {base.shape[1]} held-out problems; "
             f"gap in points; CI95 hierarchical bootstrap ({a.bootstrap} draws); sign p exact "
             f"over seeds.", "",
             "| learner | final acc. mean (min-max) | gap | per seed | CI95 | sign p | verdict |",
             "|---|---|---|---|---|---|---|"]
    rng = np.random.default_rng(0)
    for name in sorted(correct):
        c = np.stack(correct[name])
        if len(c) != S:
            raise SystemExit(f"variant {name!r}: {len(c)} of {S} seeds have a finished run")
        acc = c.mean(axis=1)
        row = f"| {name} | {acc.mean():.3f} ({acc.min():.3f}-{acc.max():.3f}) |"
        if name == a.baseline:
            lines.append(row + " - | - | - | - | baseline |")
            continue
        st = paired_stats(c.astype(np.float64) - base, a.bootstrap, rng)
        lo, hi = st["ci"]
        verdict = ("no difference detected" if lo <= 0 <= hi else
                   f"{name} higher" if lo > 0 else f"{a.baseline} higher")
        seeds = " / ".join(f"{100 * g:+.1f}" for g in st["per_seed"])
        lines.append(row + f" {100 * st['gap']:+.1f} | {seeds} | [{100 * lo:+.1f}, {100 * hi:+.1f}]"
                           f" | {st['p']:.2f} | {verdict} |")
    text = "\n".join(lines) + "\n"
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
