"""PNG plots of runs (`looprl plot RUN_DIR [RUN_DIR ...]`, `looprl.cli.plot`): reward, accuracy,
exit depth and mismatch.

Reads each run's `metrics.jsonl` (and `config.json`, `summary.json`, `warm_start_curve.json`
when present) and writes `reward.png`, `accuracy.png`, `exit_depth.png`, `mismatch.png`,
`optimization.png`, `timing.png` and `warm_start.png`, one curve per run (labelled by directory
name), so several runs plot side by side. Every figure is titled with the runs and their setting
(experiment name, q, KV policy, learner method, steps, seed). Curves are smoothed (a centred
running mean over about a tenth of the steps) with the raw values drawn faintly behind.
`accuracy.png` shows the held-out accuracy before and after GRPO (`summary.json`) as marked
points, and the rollout accuracy only where it differs from the reward (with 0/1 rewards they
are the same number, drawn once, in `reward.png`). The timing plot's y range leaves out the first
step, which includes the compilation; its value is written on the plot.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from looprl.errors import ConfigError, create_dir

PANELS = {
    "reward": [("reward_mean", "reward mean (= rollout accuracy with 0/1 rewards)")],
    "accuracy": [("accuracy", "accuracy")],
    "exit_depth": [("mean_exit_loop", "mean exit loop")],
    "mismatch": [("replay_exact_fraction", "replay exact fraction"),
                 ("stock_max_abs_diff", "stock max |delta logprob|")],
    "optimization": [("grad_norm", "grad norm"), ("clip_frac", "clip fraction"),
                     ("kl", "k3 KL to reference")],
    "timing": [("rollout_s", "rollout seconds / step"), ("learner_s", "learner seconds / step")],
}


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The rows of a run's `metrics.jsonl`. A last line cut short (a run killed mid-write) is
    skipped with a warning on stderr naming the file and line. Raises ConfigError for a missing
    file or a line before the last that is not JSON."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(f"{path}: no metrics.jsonl (not a run directory?)")
    lines = [(n, line) for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    rows = []
    for i, (n, line) in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i < len(lines) - 1:
                raise ConfigError(f"{path}:{n}: not JSON ({e.msg}); the file is damaged") from None
            print(f"looprl plot: warning: {path}:{n}: the last line is cut short (a run stopped "
                  f"mid-write?); plotting the {len(rows)} rows before it", file=sys.stderr)
    return rows


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except json.JSONDecodeError:
        return {}


def smooth(ys: list[float]) -> np.ndarray:
    """Centred running mean over w = max(1, n // 10) values (odd), shrinking at the ends."""
    y = np.asarray(ys, np.float64)
    w = max(1, len(y) // 10) | 1
    if w == 1:
        return y
    c = np.concatenate([[0.0], np.cumsum(y)])
    h = w // 2
    lo = np.clip(np.arange(len(y)) - h, 0, len(y))
    hi = np.clip(np.arange(len(y)) + h + 1, 0, len(y))
    return (c[hi] - c[lo]) / (hi - lo)


def setting_title(run_dirs) -> str:
    """`name: setting` of each run, from its config.json (the directory name alone without)."""
    parts = []
    for d in run_dirs:
        cfg = _read_json(Path(d) / "config.json")
        name = Path(d).name or str(d)
        if not cfg:
            parts.append(name)
            continue
        r, run = cfg.get("rollout", {}), cfg.get("run", {})
        parts.append(f"{name} ({cfg.get('name')}: q={r.get('exit_threshold')}, "
                     f"{r.get('kv_policy')}, {cfg.get('learner', {}).get('logprob_method')}, "
                     f"{run.get('grpo_steps')} GRPO steps, seed {run.get('seed')})")
    return "; ".join(parts)


def _curve(ax, xs, ys, label, color):
    ax.plot(xs, ys, color=color, alpha=0.25, linewidth=1)
    ax.plot(xs, smooth(ys), color=color, linewidth=2, label=label,
            marker="." if len(xs) < 30 else None)


def _accuracy_panel(ax, runs, summaries, colors):
    for (run, rows), color in zip(runs.items(), colors):
        xs = [r["step"] for r in rows if "accuracy" in r]
        ys = [r["accuracy"] for r in rows if "accuracy" in r]
        if xs and ys != [r["reward_mean"] for r in rows if "accuracy" in r]:
            _curve(ax, xs, ys, f"{run} rollout accuracy", color)
        s = summaries.get(run) or {}
        if "eval_accuracy_before" in s:
            last = s.get("grpo_steps") or (xs[-1] + 1 if xs else 1)
            ax.plot([0, last], [s["eval_accuracy_before"], s["eval_accuracy_after"]], color=color,
                    linestyle="--", marker="o", markersize=8,
                    label=f"{run} held-out: {s['eval_accuracy_before']:.3f} before -> "
                          f"{s['eval_accuracy_after']:.3f} after GRPO")
            for x, y, t, dx in ((0, s["eval_accuracy_before"], "before", 6),
                                (last, s["eval_accuracy_after"], "after", -70)):
                ax.annotate(f"{t} {y:.3f}", (x, y), textcoords="offset points", xytext=(dx, -4),
                            fontsize=8, color=color)
    ax.set_ylabel("accuracy")


def _timing_panel(ax, key, runs, colors):
    tops = []
    for (run, rows), color in zip(runs.items(), colors):
        pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        if not pts:
            continue
        xs, ys = zip(*pts)
        rest = ys[1:] or ys
        tops.append(max(rest))
        if len(ys) > 1 and ys[0] > 1.2 * max(rest):  # the first step compiled: mark it only
            _curve(ax, list(xs[1:]), list(ys[1:]), run, color)
            ax.plot([xs[0]], [max(rest) * 1.1], marker="^", color=color, linestyle="none")
            ax.annotate(f"step {xs[0]}: {ys[0]:.1f} s (compilation), off the scale",
                        (xs[0], max(rest) * 1.1), textcoords="offset points", xytext=(8, -4),
                        fontsize=8, color=color)
        else:
            _curve(ax, list(xs), list(ys), run, color)
    if tops:
        ax.set_ylim(0, max(tops) * 1.15)


def plot_runs(run_dirs: list[str | Path], out_dir: str | Path) -> list[Path]:
    """Write the PNGs for `run_dirs` into `out_dir`; returns their paths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {Path(d).name or str(d): read_metrics(d) for d in run_dirs}
    summaries = {Path(d).name or str(d): _read_json(Path(d) / "summary.json") for d in run_dirs}
    out = create_dir(out_dir, "plot output directory")  # after the runs read: none made for none
    colors = [f"C{i % 10}" for i in range(len(runs))]
    title = setting_title(run_dirs)
    written = []
    for name, keys in PANELS.items():
        fig, axes = plt.subplots(1, len(keys), figsize=(7 * len(keys), 4.5), squeeze=False)
        for ax, (key, label) in zip(axes[0], keys):
            if name == "accuracy":
                _accuracy_panel(ax, runs, summaries, colors)
            elif name == "timing":
                _timing_panel(ax, key, runs, colors)
                ax.set_ylabel(label)
            else:
                for (run, rows), color in zip(runs.items(), colors):
                    pts = [(r["step"], r[key]) for r in rows if key in r and r[key] is not None]
                    if pts:
                        xs, ys = zip(*pts)
                        _curve(ax, list(xs), list(ys), run, color)
                ax.set_ylabel(label)
            ax.set_xlabel("GRPO step")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle(title, fontsize=9)
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    any_curve = False
    for d in run_dirs:
        p = Path(d) / "warm_start_curve.json"
        curve = [c for c in _read_json(p).get("curve", []) if "accuracy" in c]
        if curve:
            any_curve = True
            ax.plot([c["step"] for c in curve], [c["accuracy"] for c in curve], marker=".",
                    label=Path(d).name)
    if any_curve:
        ax.set_xlabel("warm-start step")
        ax.set_ylabel("held-out accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.suptitle(title, fontsize=9)
        fig.tight_layout()
        fig.savefig(out / "warm_start.png", dpi=100)
        written.append(out / "warm_start.png")
    plt.close(fig)
    return written
