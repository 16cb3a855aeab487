"""`looprl plot RUN_DIR...`: PNG curves of runs' metrics (`looprl.train.plots`)."""
from __future__ import annotations

from pathlib import Path

from looprl.train.plots import plot_runs


def run(args) -> int:
    out = args.out or str(Path(args.run_dirs[0]) / "plots")
    for p in plot_runs(args.run_dirs, out):
        print(p)
    return 0
