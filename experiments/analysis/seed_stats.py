"""Seed-level statistics of `experiments/mismatch_replication.py` from the committed files alone
(`collect_replication.py` writes them): every number of its table, byte for byte.

The unit of replication is the seed: each seed has its own warm start and runs every arm, so a
contrast A - B gives one paired difference per seed, d_s = acc_A(s) - acc_B(s) (points, each
accuracy over all held-out problems). Over the n seeds:

  mean, CI95   the t-interval mean +- t(0.975, n - 1) sd / sqrt(n), sd with n - 1
  t p          the two-sided one-sample t-test of mean 0 (df = n - 1)
  d_z          mean / sd, the paired effect size (Cohen's d_z)
  sign-flip p  the exact randomisation test: under no effect each d_s is as likely -d_s, so
               p = #{signs e in {+1, -1}^n : |sum e_s d_s| >= |sum d_s|} / 2^n (two-sided)
  Holm p       Holm's step-down adjustment of the sign-flip p over the contrasts of one table
  detectable   the gap (points) a two-sided t-test at alpha 0.05 finds with 80 % power at this
               contrast's sd: d_z* sd, d_z* from the noncentral t with df = n - 1

Accuracy is at each arm's training q (q = 0.6 for `hybrid`, `stock`, `full_depth`; q = 1 for
`control`); a second table compares every arm at q = 1. No bootstrap over seeds: with a handful
of seeds its percentile interval is the seed range.

    python experiments/analysis/seed_stats.py     # -> experiments/figures/mismatch_replication/
"""
from __future__ import annotations

import argparse
import csv
import gzip
import io
import itertools
import json
import math
import sys
from pathlib import Path

import numpy as np
from scipy import optimize, stats

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data" / "mismatch_replication"
OUT = ROOT / "figures" / "mismatch_replication" / "seed_stats.md"
ARMS = ("hybrid", "stock", "full_depth", "control")
TRAIN_Q = {"hybrid": "0.6", "stock": "0.6", "full_depth": "0.6", "control": "1"}
# (label, arm A, q of A, arm B, q of B): the difference A - B; "warm_start" is the seed's warm start
CONTRASTS = (
    ("hybrid - warm start", "hybrid", "train", "warm_start", "0.6"),
    ("stock - hybrid", "stock", "train", "hybrid", "train"),
    ("full_depth - hybrid", "full_depth", "train", "hybrid", "train"),
    ("control - hybrid", "control", "train", "hybrid", "train"),
    ("full_depth - control", "full_depth", "train", "control", "train"),
)
ALPHA = 0.05
POWER = 0.80


def t_interval(d: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    """The two-sided t-interval of the mean of `d` [n] (df = n - 1). Raises ValueError for n < 2."""
    n = len(d)
    if n < 2:
        raise ValueError(f"t-interval: needs at least 2 values, found {n}")
    half = stats.t.ppf(0.5 + level / 2, n - 1) * d.std(ddof=1) / math.sqrt(n)
    return float(d.mean() - half), float(d.mean() + half)


def t_test_p(d: np.ndarray) -> float:
    """Two-sided p of the one-sample t-test of mean 0 (df = n - 1); 1.0 when every d is 0."""
    sd = d.std(ddof=1)
    if sd == 0:
        return 1.0 if d.mean() == 0 else 0.0
    t = d.mean() / (sd / math.sqrt(len(d)))
    return float(2 * stats.t.sf(abs(t), len(d) - 1))


def effect_size_dz(d: np.ndarray) -> float:
    """Cohen's d_z: mean / sd (ddof 1) of the paired differences; nan when sd is 0."""
    sd = d.std(ddof=1)
    return float(d.mean() / sd) if sd > 0 else float("nan")


def sign_flip_p(d_int: np.ndarray) -> float:
    """The exact two-sided sign-flip p over all 2^n sign patterns of integer differences `d_int`
    (counts of problems, so every comparison is exact): the fraction of patterns whose
    |signed sum| reaches the observed |sum|."""
    d_int = np.asarray(d_int, np.int64)
    signs = np.array(list(itertools.product((1, -1), repeat=len(d_int))), np.int64)
    return float(np.mean(np.abs(signs @ d_int) >= abs(int(d_int.sum()))))


def holm(p: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the input's order: sorted ascending, the k-th
    smallest (k from 0) gets max over j <= k of min(1, (m - j) p_(j))."""
    order = sorted(range(len(p)), key=lambda i: (p[i], i))
    out = [0.0] * len(p)
    running = 0.0
    for k, i in enumerate(order):
        running = max(running, min(1.0, (len(p) - k) * p[i]))
        out[i] = running
    return out


def t_power(dz: float, n: int, alpha: float = ALPHA) -> float:
    """Power of the two-sided one-sample t-test at level `alpha` with n values and true effect
    d_z: P(|T| > t_crit), T noncentral t with df = n - 1 and noncentrality d_z sqrt(n)."""
    crit = stats.t.ppf(1 - alpha / 2, n - 1)
    nc = dz * math.sqrt(n)
    upper, lower = stats.nct.sf(crit, n - 1, nc), stats.nct.cdf(-crit, n - 1, nc)
    # scipy's nct returns nan far in a tail (nc >> crit): there the tail is 1 or 0
    upper = 1.0 if math.isnan(upper) else float(upper)
    return upper + (0.0 if math.isnan(lower) else float(lower))


def detectable_dz(n: int, alpha: float = ALPHA, power: float = POWER) -> float:
    """The smallest d_z > 0 the two-sided t-test with n values detects with `power`."""
    hi = 4.0
    while t_power(hi, n, alpha) < power:  # widen the bracket (n = 2 needs d_z near 20)
        hi *= 2
    return float(optimize.brentq(lambda dz: t_power(dz, n, alpha) - power, 1e-6, hi,
                                 xtol=1e-10))


def read_outcomes(path: Path) -> dict[str, np.ndarray]:
    """{q: int8 [problems] correct, "ids": [problem id]} from a `*_problems.csv.gz`, problems in
    file order. Raises
    SystemExit naming the file when a q's problem ids differ from the first q's."""
    with gzip.open(path, "rt") as f:
        rows = list(csv.DictReader(io.StringIO(f.read())))
    by_q: dict[str, list[tuple[str, int]]] = {}
    for r in rows:
        by_q.setdefault(r["q"], []).append((r["id"], int(r["correct"])))
    ids = [i for i, _ in next(iter(by_q.values()))]
    for q, v in by_q.items():
        if [i for i, _ in v] != ids:
            raise SystemExit(f"{path}: q = {q} lists other problems than the first q")
    return {q: np.array([c for _, c in v], np.int8) for q, v in by_q.items()} | {"ids": ids}


def read_metrics(path: Path) -> list[dict]:
    """The GRPO steps of a `*_metrics.jsonl.gz`."""
    with gzip.open(path, "rt") as f:
        return [json.loads(x) for x in f.read().splitlines() if x.strip()]


def load(data: Path) -> dict[int, dict]:
    """{seed: {"warm_start": outcomes, arm: {"outcomes", "metrics", "summary"}}} for every
    `seed<S>/` under `data`. Raises SystemExit for a missing file or problem sets that differ."""
    seeds = sorted(int(p.name[4:]) for p in data.glob("seed*") if p.name[4:].isdigit())
    if len(seeds) < 2:
        raise SystemExit(f"{data}: {len(seeds)} seed<S>/ directories; the statistics over seeds "
                         f"need at least 2 (run collect_replication.py for each seed)")
    out: dict[int, dict] = {}
    ids = None
    for s in seeds:
        d = data / f"seed{s}"
        need = ["warm_start_problems.csv.gz"] + [f"{a}_{k}" for a in ARMS for k in
                                                 ("problems.csv.gz", "metrics.jsonl.gz",
                                                  "summary.json")]
        missing = [n for n in need if not (d / n).exists()]
        if missing:
            raise SystemExit(f"{d}: missing {', '.join(missing)}")
        rec = {"warm_start": read_outcomes(d / "warm_start_problems.csv.gz")}
        for a in ARMS:
            rec[a] = {"outcomes": read_outcomes(d / f"{a}_problems.csv.gz"),
                      "metrics": read_metrics(d / f"{a}_metrics.jsonl.gz"),
                      "summary": json.loads((d / f"{a}_summary.json").read_text())}
        for o in [rec["warm_start"]] + [rec[a]["outcomes"] for a in ARMS]:
            if ids is None:
                ids = o["ids"]
            if o["ids"] != ids:
                raise SystemExit(f"{d}: a file lists other held-out problems than seed{seeds[0]}")
        out[s] = rec
    return out


def correct_counts(rec: dict, arm: str, q: str) -> np.ndarray:
    """int [problems] outcomes of `arm` ("warm_start" or an arm) at q ("train": the arm's)."""
    if arm == "warm_start":
        return rec["warm_start"][q]
    return rec[arm]["outcomes"][TRAIN_Q[arm] if q == "train" else q]


def contrast_rows(data: dict[int, dict], contrasts) -> list[dict]:
    """Each contrast's statistics (module docstring) over the seeds, in points."""
    rows = []
    for label, a, qa, b, qb in contrasts:
        diff = np.array([int(correct_counts(r, a, qa).sum()) - int(correct_counts(r, b, qb).sum())
                         for r in data.values()], np.int64)
        n_prob = len(next(iter(data.values()))["warm_start"]["ids"])
        d = 100.0 * diff / n_prob
        lo, hi = t_interval(d)
        sd = d.std(ddof=1)
        rows.append({"label": label, "per_seed": d, "mean": float(d.mean()), "ci": (lo, hi),
                     "t_p": t_test_p(d), "dz": effect_size_dz(d), "flip_p": sign_flip_p(diff),
                     "detectable": detectable_dz(len(d)) * sd})
    for r, h in zip(rows, holm([r["flip_p"] for r in rows])):
        r["holm_p"] = h
    return rows


def fmt(x: float, nd: int = 1, sign: bool = True) -> str:
    """`x` with `nd` decimals (a sign when `sign`), "nan" for nan; -0.0 prints as 0."""
    if math.isnan(x):
        return "nan"
    x = 0.0 if round(x, nd) == 0 else x
    return f"{x:+.{nd}f}" if sign else f"{x:.{nd}f}"


def contrast_table(rows: list[dict], n: int) -> list[str]:
    """Markdown lines of one contrast table."""
    lines = ["| contrast | seeds | per seed (points) | mean | CI95 (t, df = "
             f"{n - 1}) | t p | d_z | sign-flip p | Holm p | detectable at 80 % |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        per = " / ".join(fmt(x) for x in r["per_seed"])
        lines.append(f"| {r['label']} | {n} | {per} | {fmt(r['mean'])} | [{fmt(r['ci'][0])}, "
                     f"{fmt(r['ci'][1])}] | {r['t_p']:.4f} | {fmt(r['dz'], 2)} | "
                     f"{r['flip_p']:.4f} | {r['holm_p']:.4f} | {fmt(r['detectable'], 1, False)} |")
    return lines


def arm_rows(data: dict[int, dict]) -> list[str]:
    """Markdown lines: per arm its accuracy per seed and the mismatch figures of metrics.jsonl
    (mean over seeds of the first and last step's values; max over every step and seed);
    s/step is the mean rollout + learner seconds over the steps after the first (it compiles)."""
    seeds = list(data)
    lines = ["| arm | seeds | training q | acc. at training q, per seed | mean | acc. at q = 1, "
             "mean | mean abs dlogp step 0 / end | k3 KL step 0 / end | max abs dlogp | "
             "replay exact steps | s/step |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    ws = [float(data[s]["warm_start"]["0.6"].mean()) for s in seeds]
    ws1 = [float(data[s]["warm_start"]["1"].mean()) for s in seeds]
    lines.append(f"| warm start | {len(seeds)} | 0.6 | {' / '.join(f'{x:.3f}' for x in ws)} | "
                 f"{np.mean(ws):.3f} | {np.mean(ws1):.3f} | - | - | - | - | - |")
    for a in ARMS:
        acc = [float(correct_counts(data[s], a, "train").mean()) for s in seeds]
        acc1 = [float(correct_counts(data[s], a, "1").mean()) for s in seeds]
        ms = [data[s][a]["metrics"] for s in seeds]

        def first_last(key):
            vals = [(m[0].get(key), m[-1].get(key)) for m in ms]
            if any(v is None for pair in vals for v in pair):
                return "n/a"
            return f"{np.mean([v[0] for v in vals]):.2e} / {np.mean([v[1] for v in vals]):.2e}"

        mx = [r.get("mismatch_abs_max") for m in ms for r in m]
        mx_s = "n/a" if any(v is None for v in mx) else f"{max(mx):.2e}"
        exact = sum(int(data[s][a]["summary"].get("replay_exact_steps") or 0) for s in seeds)
        steps = sum(len(m) for m in ms)
        sps = np.mean([r["rollout_s"] + r["learner_s"] for m in ms for r in m[1:]])
        lines.append(f"| {a} | {len(seeds)} | {TRAIN_Q[a]} | {' / '.join(f'{x:.3f}' for x in acc)}"
                     f" | {np.mean(acc):.3f} | {np.mean(acc1):.3f} | "
                     f"{first_last('mismatch_abs_mean')} | {first_last('mismatch_k3_kl')} | "
                     f"{mx_s} | {exact}/{steps} | {sps:.2f} |")
    return lines


def shown(path: Path) -> str:
    """`path` relative to the repository root when it lies inside it (the text must not depend
    on where the repository is checked out), else as given."""
    try:
        return str(path.resolve().relative_to(ROOT.parent))
    except ValueError:
        return str(path)


def report(data: dict[int, dict], source: Path = DATA) -> str:
    """The whole markdown text (deterministic: fixed formats, seeds and contrasts in order)."""
    n = len(data)
    n_prob = len(next(iter(data.values()))["warm_start"]["ids"])
    at_q1 = tuple((lab, a, "1", b, "1") for lab, a, _, b, _ in CONTRASTS)
    m = len(CONTRASTS)
    lines = [f"# mismatch_replication: {n} seeds x {n_prob} held-out problems", "",
             "Generated by `python experiments/analysis/seed_stats.py` from "
             f"`{shown(source)}/`. Seeds: "
             + ", ".join(str(s) for s in data) + ".", "", "## Arms", "", *arm_rows(data), "",
             "## Contrasts at each arm's training q", "",
             "Points (100 x accuracy difference). Holm over the rows of the table; "
             "'detectable at 80 %' is the gap a two-sided t-test at alpha 0.05 finds with 80 % "
             "power at the contrast's sd.", "", *contrast_table(contrast_rows(data, CONTRASTS), n),
             "", "## The same contrasts, every checkpoint at q = 1", "",
             *contrast_table(contrast_rows(data, at_q1), n), "", "## Power", "",
             f"With {n} seeds a two-sided one-sample t-test (df = {n - 1}) detects d_z >= "
             f"{detectable_dz(n):.2f} with 80 % power at alpha 0.05 (noncentral t), and "
             f"d_z >= {detectable_dz(n, ALPHA / m):.2f} at alpha 0.05 / {m}, Holm's first step. "
             f"The smallest sign-flip p over {n} seeds is 2 / 2^{n} = {2 / 2 ** n:.4f}.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=DATA, help=f"default {DATA}")
    ap.add_argument("--out", type=Path, default=OUT, help=f"default {OUT}")
    a = ap.parse_args(argv)
    text = report(load(a.data), a.data)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
