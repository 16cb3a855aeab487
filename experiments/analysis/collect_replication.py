"""Evaluate one seed of `experiments/mismatch_replication.py` per problem and copy the files to
commit into the repository, so `seed_stats.py` recomputes every figure from them.

For the seed's warm start and each arm's final checkpoint it runs `looprl eval` once (greedy,
every held-out problem, q = 0.6 and q = 1, the study's `copy` KV and bf16) into
SEED_DIR/evals/<name>, and checks the accuracy at the run's own q against the run's
`summary.json` (`eval_accuracy_before` for the warm start, `eval_accuracy_after` for an arm),
bit for bit; a mismatch stops the script before it writes anything. Then it writes, into
OUT/seed<S>/:

  warm_start_problems.csv.gz   one row per (problem, q): id, q, correct (0/1), tokens,
  <arm>_problems.csv.gz        mean_exit_loop (6 decimals), truncated (0/1)
  <arm>_metrics.jsonl.gz       the run's metrics.jsonl, one object per GRPO step
  <arm>_summary.json           the run's summary.json

Gzip files carry no name and no time stamp, so the same run gives the same bytes.

    python experiments/analysis/collect_replication.py runs/replication/seed0 --seed 0
"""
from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
from pathlib import Path

ARMS = ("hybrid", "stock", "full_depth", "control")
THRESHOLDS = ("0.6", "1")
OUT = Path(__file__).resolve().parents[1] / "data" / "mismatch_replication"
HEADER = "id,q,correct,tokens,mean_exit_loop,truncated"
STEPS = 300  # the study's GRPO steps; a shorter run (the pilot) needs --steps


def gzip_bytes(data: bytes) -> bytes:
    """`data` gzipped with no file name and mtime 0 (the same input, the same bytes)."""
    return gzip.compress(data, compresslevel=9, mtime=0)


def run_eval(checkpoint: Path, out: Path) -> list[dict]:
    """`looprl eval` of `checkpoint` at q = 0.6 and 1 with `copy` KV into `out` (once; a
    finished `out` is read again); returns problems.jsonl's objects."""
    if not (out / "results.json").exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "looprl.cli", "eval", "--checkpoint", str(checkpoint),
               "--out", str(out), "--exit-threshold", ",".join(THRESHOLDS),
               "--kv-policy", "copy", "--compute-dtype", "bfloat16", "--json"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return [json.loads(x) for x in (out / "problems.jsonl").read_text().splitlines() if x]


def outcome_csv(rows: list[dict]) -> str:
    """The compact per-problem table (`HEADER`), problem-major, q in `THRESHOLDS` order."""
    lines = [HEADER]
    for r in rows:
        for q in THRESHOLDS:
            o = r["by_threshold"][q]
            lines.append(f"{r['id']},{q},{int(o['correct'])},{o['tokens']},"
                         f"{o['mean_exit_loop']:.6f},{int(o['truncated'])}")
    return "\n".join(lines) + "\n"


def accuracy(rows: list[dict], q: str) -> float:
    """Greedy accuracy at threshold `q` (text key of problems.jsonl)."""
    return sum(bool(r["by_threshold"][q]["correct"]) for r in rows) / len(rows)


def collect(seed_dir: Path, seed: int, out_root: Path, steps: int = STEPS) -> Path:
    """Evaluate and check the seed's warm start and four arms; write OUT/seed<S>. Raises
    SystemExit naming the run when a run is missing, ran another seed or another number of GRPO
    steps than `steps`, or its re-evaluation is not the run's own accuracy."""
    files: dict[str, bytes] = {}
    summaries = {}
    for arm in ARMS:
        s_path = seed_dir / arm / "summary.json"
        if not s_path.exists():
            raise SystemExit(f"{seed_dir / arm}: no summary.json (run or resume the seed first)")
        summaries[arm] = json.loads(s_path.read_text())
        run_seed = json.loads((seed_dir / arm / "config.json").read_text())["run"]["seed"]
        if run_seed != seed:
            raise SystemExit(f"{seed_dir / arm}: ran with seed {run_seed}, not --seed {seed}")
        if summaries[arm]["grpo_steps"] != steps or not summaries[arm]["complete"]:
            raise SystemExit(f"{seed_dir / arm}: {summaries[arm]['grpo_steps']} GRPO steps, not "
                             f"--steps {steps} (resume a stopped run)")
    ws_rows = run_eval(seed_dir / "warm_start_run" / "warm_start",
                       seed_dir / "evals" / "warm_start")
    files["warm_start_problems.csv.gz"] = gzip_bytes(outcome_csv(ws_rows).encode())
    for arm in ARMS:
        s = summaries[arm]
        q = "1" if arm == "control" else "0.6"
        rows = run_eval(seed_dir / arm / "checkpoint", seed_dir / "evals" / arm)
        for name, want, got in (("eval_accuracy_before", s["eval_accuracy_before"],
                                 accuracy(ws_rows, q)),
                                ("eval_accuracy_after", s["eval_accuracy_after"],
                                 accuracy(rows, q))):
            if got != want:
                raise SystemExit(f"{seed_dir / arm}: re-evaluated accuracy at q = {q} is {got!r},"
                                 f" the run's {name} {want!r}; these are not the run's outcomes")
        files[f"{arm}_problems.csv.gz"] = gzip_bytes(outcome_csv(rows).encode())
        files[f"{arm}_metrics.jsonl.gz"] = gzip_bytes((seed_dir / arm / "metrics.jsonl")
                                                      .read_bytes())
        files[f"{arm}_summary.json"] = (seed_dir / arm / "summary.json").read_bytes()
    out = out_root / f"seed{seed}"
    out.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (out / name).write_bytes(data)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("seed_dir", type=Path, help="the seed's out_dir (runs/replication/seedS)")
    ap.add_argument("--seed", type=int, required=True, help="the seed's number (run.seed)")
    ap.add_argument("--out", type=Path, default=OUT, help=f"default {OUT}")
    ap.add_argument("--steps", type=int, default=STEPS, help=f"GRPO steps each arm ran "
                    f"(default {STEPS}, the study's)")
    a = ap.parse_args(argv)
    if not a.seed_dir.is_dir():
        raise SystemExit(f"{a.seed_dir}: no such seed directory")
    out = collect(a.seed_dir, a.seed, a.out, a.steps)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
