"""`looprl plot RUN_DIR...`: PNG curves of runs' metrics (`looprl.train.plots`)."""
from __future__ import annotations

from pathlib import Path

from looprl.train.compare import plot_comparison
from looprl.train.plots import plot_runs


def run(args) -> int:
    out = args.out or str(Path(args.run_dirs[0]) / "plots")
    make = plot_comparison if getattr(args, "compare", False) else plot_runs
    for p in make(args.run_dirs, out):
        print(p)
    return 0
