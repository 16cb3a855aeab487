"""Comparison of variant groups across seeds (`looprl plot --compare SEED_DIR ...`): the figures
and the table of the mismatch study (experiments/mismatch_study.py).

Each SEED_DIR is the `out_dir` of one seed of an experiment with `VARIANTS`: it holds one run
directory per variant (`SEED_DIR/<variant>/metrics.jsonl`, `summary.json`,
`mismatch_step0.npy`). Variants of the same name across seeds form a group; variant names
`<kv>_<dtype>_<learner>` (e.g. `deferred_fp32_full_depth_tis`) are split into a setting
(`deferred_fp32`) and a learner, other names (`hybrid`, `cispo_full_depth`) are learners of one
setting `all`, and each setting gets its own figure with one curve per learner: the mean over
seeds with the min-max band behind it.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from looprl.errors import ConfigError, create_dir
from looprl.sampling.kv_policies import KV_POLICIES
from looprl.train.plots import read_metrics

CURVES = (("eval_accuracy", "held-out accuracy (greedy, fraction)"),
          ("reward_mean", "rollout reward (mean, fraction correct)"),
          ("mismatch_k3_kl", "KL(sampler || learner), k3 estimate (nats/token)"),
          ("mismatch_abs_mean", "mean |learner - sampler| log-prob (nats)"),
          ("mismatch_abs_max", "max |learner - sampler| log-prob (nats)"))
COLLAPSE_WINDOW = 10  # steps of the moving mean of the reward
COLLAPSE_FRACTION = 0.5  # of the reward's peak moving mean


def load_groups(seed_dirs: list[str | Path]) -> dict[str, list[dict[str, Any]]]:
    """{variant: [one record per seed: {"seed_dir", "rows" (metrics.jsonl), "summary",
    "delta0" (step-0 |delta logprob| array or None)}]}, variants in first-seen order. Raises
    ConfigError when a directory holds no variant runs."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for sd in map(Path, seed_dirs):
        runs = sorted(d for d in sd.iterdir() if (d / "metrics.jsonl").is_file()) \
            if sd.is_dir() else []
        if not runs:
            raise ConfigError(f"{sd}: no variant run directories (*/metrics.jsonl) to compare")
        for d in runs:
            rows = read_metrics(d)
            if not rows:  # the shared warm start's run (no GRPO step)
                continue
            summary = json.loads((d / "summary.json").read_text()) \
                if (d / "summary.json").is_file() else {}
            delta = np.load(d / "mismatch_step0.npy") if (d / "mismatch_step0.npy").is_file() \
                else None
            groups.setdefault(d.name, []).append({"seed_dir": str(sd), "rows": rows,
                                                  "summary": summary, "delta0": delta})
    return groups


SETTING_KV = KV_POLICIES  # a variant name may start with a KV policy
SETTING_DTYPE = ("fp32", "bf16")


def split_name(variant: str) -> tuple[str, str]:
    """`deferred_fp32_full_depth_tis` -> (`deferred_fp32`, `full_depth_tis`); a name that does
    not start with `<kv>_<dtype>_` is a learner of the setting `all` (`hybrid` -> (`all`,
    `hybrid`))."""
    parts = variant.split("_")
    if len(parts) > 2 and parts[0] in SETTING_KV and parts[1] in SETTING_DTYPE:
        return "_".join(parts[:2]), "_".join(parts[2:])
    return "all", variant


def curve(record: dict[str, Any], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of one run: the step count done after each row (step + 1), with
    `eval_accuracy` starting from the warm start's accuracy at 0 and ending at the final
    evaluation."""
    rows = record["rows"]
    xs = [r["step"] + 1 for r in rows if r.get(key) is not None]
    ys = [r[key] for r in rows if r.get(key) is not None]
    s = record["summary"]
    if key == "eval_accuracy" and "eval_accuracy_before" in s:
        xs, ys = [0] + xs, [s["eval_accuracy_before"]] + ys
        if s.get("grpo_steps") and (not xs or xs[-1] != s["grpo_steps"]):
            xs, ys = xs + [s["grpo_steps"]], ys + [s["eval_accuracy_after"]]
    return np.asarray(xs, float), np.asarray(ys, float)


def collapse_step(record: dict[str, Any]) -> int | None:
    """The first GRPO step (1-based count) where the `COLLAPSE_WINDOW`-step moving mean of the
    reward falls below `COLLAPSE_FRACTION` of its running peak, or where held-out accuracy
    falls below the warm start's; None if neither happens."""
    rewards = [r["reward_mean"] for r in record["rows"]]
    peak = -np.inf
    for i in range(COLLAPSE_WINDOW, len(rewards) + 1):
        m = float(np.mean(rewards[i - COLLAPSE_WINDOW:i]))
        peak = max(peak, m)
        if peak > 0 and m < COLLAPSE_FRACTION * peak:
            return i
    before = record["summary"].get("eval_accuracy_before")
    if before is not None:
        xs, ys = curve(record, "eval_accuracy")
        for x, y in zip(xs[1:], ys[1:]):
            if y < before:
                return int(x)
    return None


def plot_comparison(seed_dirs: list[str | Path], out_dir: str | Path,
                    title: str | None = None) -> list[Path]:
    """One PNG of curves per setting (`compare_<setting>.png`: held-out accuracy, reward,
    mismatch KL and |delta logprob| against step, mean over seeds with the min-max band) and one
    of step-0 |delta logprob| histograms (`compare_<setting>_delta0.png`, log axes, exact zeros
    in their own bar), plus `comparison.md` (`comparison_table`). Returns the paths written."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = load_groups(seed_dirs)
    out = create_dir(out_dir, "plot output directory")
    title = title or Path(seed_dirs[0]).resolve().parent.name
    settings: dict[str, list[str]] = {}
    for v in groups:
        settings.setdefault(split_name(v)[0], []).append(v)
    written = []
    for setting, variants in settings.items():
        fig, axes = plt.subplots(1, len(CURVES), figsize=(5.2 * len(CURVES), 4))
        for ax, (key, label) in zip(axes, CURVES):
            for v in variants:
                curves = [curve(rec, key) for rec in groups[v]]
                curves = [c for c in curves if len(c[0])]
                if not curves:
                    continue
                n = min(len(c[0]) for c in curves)
                xs = curves[0][0][:n]
                ys = np.stack([c[1][:n] for c in curves])
                line, = ax.plot(xs, ys.mean(0), label=split_name(v)[1],
                                marker="o" if n < 8 else None, ms=3)
                ax.fill_between(xs, ys.min(0), ys.max(0), color=line.get_color(), alpha=0.15)
            ax.set_xlabel("GRPO step")
            ax.set_ylabel(label)
            if key.startswith("mismatch"):
                ax.set_yscale("symlog", linthresh=1e-8)
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=8, title=f"learner (mean, min-max over "
                                         f"{len(groups[variants[0]])} seeds)")
        fig.suptitle(f"{title}: {setting}")
        fig.tight_layout()
        path = out / f"compare_{setting}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
        written.append(_delta_histogram(plt, groups, variants, out, f"{title}: {setting}",
                                        setting))
    table = out / "comparison.md"
    table.write_text(comparison_table(groups) + "\n")
    written.append(table)
    return written


def _delta_histogram(plt, groups, variants, out: Path, title: str, setting: str) -> Path:
    bins = np.logspace(-10, 1, 45)
    fig, ax = plt.subplots(figsize=(7, 4))
    for v in variants:
        deltas = [rec["delta0"] for rec in groups[v] if rec["delta0"] is not None]
        if not deltas:
            continue
        d = np.concatenate(deltas).astype(np.float64)
        zeros = int(np.sum(d == 0.0))
        ax.hist(d[d > 0], bins=bins, histtype="step", lw=1.5,
                label=f"{split_name(v)[1]} (exact: {zeros}/{d.size})")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("|learner - sampler| log-prob at step 0 (nats; exact zeros in the legend)")
    ax.set_ylabel("tokens (all seeds)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = out / f"compare_{setting}_delta0.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _fmt_range(vals: list[float], fmt: str = "{:.3f}") -> str:
    if not vals:
        return "-"
    return (fmt + " ({}-{})").format(np.mean(vals), fmt.format(min(vals)),
                                      fmt.format(max(vals)))


def comparison_table(groups: dict[str, list[dict[str, Any]]]) -> str:
    """Markdown: per variant the final held-out accuracy (mean, min-max over seeds), the first
    step of collapse per seed (`collapse_step`), the mismatch (mean |delta logprob| and k3 KL
    at step 0 and at the last step, seed means; the largest |delta logprob| of any step and
    seed), and the median seconds per step."""
    lines = ["| variant | seeds | held-out acc. before | after: mean (min-max) | collapse step "
             "| mean abs dlogp step 0 / end | max abs dlogp | k3 KL step 0 / end | s/step |",
             "|---|---|---|---|---|---|---|---|---|"]
    for v, recs in groups.items():
        before = [r["summary"].get("eval_accuracy_before") for r in recs]
        after = [r["summary"]["eval_accuracy_after"] for r in recs if "eval_accuracy_after"
                 in r["summary"]]
        coll = [collapse_step(r) for r in recs]
        first = [r["rows"][0] for r in recs if r["rows"]]
        last = [r["rows"][-1] for r in recs if r["rows"]]

        def m(rows, k):
            vals = [x.get(k) for x in rows if x.get(k) is not None]
            return float(np.mean(vals)) if vals else float("nan")

        secs = [x["rollout_s"] + x["learner_s"] for r in recs for x in r["rows"][1:]]
        peaks = [x["mismatch_abs_max"] for r in recs for x in r["rows"]
                 if x.get("mismatch_abs_max") is not None]
        lines.append(
            f"| {v} | {len(recs)} | {_fmt_range([b for b in before if b is not None])} | "
            f"{_fmt_range(after)} | {', '.join('none' if c is None else str(c) for c in coll)} "
            f"| {m(first, 'mismatch_abs_mean'):.2e} / {m(last, 'mismatch_abs_mean'):.2e} | "
            f"{max(peaks) if peaks else float('nan'):.2e} | "
            f"{m(first, 'mismatch_k3_kl'):.1e} / {m(last, 'mismatch_k3_kl'):.1e} | "
            f"{np.median(secs) if secs else float('nan'):.2f} |")
    return "\n".join(lines)
