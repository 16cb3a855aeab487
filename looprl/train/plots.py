"""PNG plots of runs (`looprl plot RUN_DIR [RUN_DIR ...]`, `looprl.cli.plot`) of reward, accuracy, exit depth and mismatch.

Reads each run's `metrics.jsonl` (and `warm_start_curve.json` when present) and writes
`reward.png`, `accuracy.png`, `exit_depth.png`, `mismatch.png`, `optimization.png`,
`timing.png` and `warm_start.png`, one
curve per run (labelled by directory name), so several runs plot side by side.
"""
from __future__ import annotations

import json
from pathlib import Path

from looprl.errors import ConfigError

PANELS = {
    "reward": [("reward_mean", "reward mean")],
    "accuracy": [("accuracy", "rollout accuracy")],
    "exit_depth": [("mean_exit_loop", "mean exit loop")],
    "mismatch": [("replay_exact_fraction", "replay exact fraction"),
                 ("stock_max_abs_diff", "stock max |delta logprob|")],
    "optimization": [("grad_norm", "grad norm"), ("clip_frac", "clip fraction"),
                     ("kl", "k3 KL to reference")],
    "timing": [("rollout_s", "rollout seconds / step"), ("learner_s", "learner seconds / step")],
}


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(f"{path}: no metrics.jsonl (not a run directory?)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_runs(run_dirs: list[str | Path], out_dir: str | Path) -> list[Path]:
    """Write the PNGs for `run_dirs` into `out_dir`; returns their paths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    runs = {Path(d).name or str(d): read_metrics(d) for d in run_dirs}
    written = []
    for name, keys in PANELS.items():
        fig, axes = plt.subplots(1, len(keys), figsize=(6 * len(keys), 4), squeeze=False)
        for ax, (key, label) in zip(axes[0], keys):
            for run, rows in runs.items():
                xs = [r["step"] for r in rows if key in r]
                ys = [r[key] for r in rows if key in r]
                ax.plot(xs, ys, label=run, marker="." if len(xs) < 30 else None)
            ax.set_xlabel("GRPO step")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    fig, ax = plt.subplots(figsize=(6, 4))
    any_curve = False
    for d in run_dirs:
        p = Path(d) / "warm_start_curve.json"
        if p.is_file():
            curve = [c for c in json.loads(p.read_text()).get("curve", []) if "accuracy" in c]
            if curve:
                any_curve = True
                ax.plot([c["step"] for c in curve], [c["accuracy"] for c in curve], marker=".",
                        label=Path(d).name)
    if any_curve:
        ax.set_xlabel("warm-start step")
        ax.set_ylabel("held-out accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "warm_start.png", dpi=100)
        written.append(out / "warm_start.png")
    plt.close(fig)
    return written


