"""What `looprl train` shows while it runs: progress bars (tqdm, on stderr, as GRPO's) for the
warm start and the evaluations, and their figures as short rounded lines."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from looprl.rl.evaluation import evaluate


def progress_bar(show: bool, total: int, desc: str, unit: str):
    """A tqdm bar on stderr (GRPO's kind), or None when bars are off."""
    if not show:
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit=unit, leave=False, file=sys.stderr)


def evaluate_and_say(label: str, show_bar: bool, say, *args, ctrl_c=None,
                     **kwargs) -> dict[str, Any]:
    """`evaluate(*args, **kwargs)` with a progress bar over the problems, then one line of
    rounded figures. `ctrl_c` (a `looprl.train.interrupts.CtrlC`): checked after every batch."""
    problems = args[5]
    bar = progress_bar(show_bar, len(problems), label, "problem")
    progress = ctrl_c.tick(bar) if ctrl_c is not None else None if bar is None else bar.update
    try:
        result = evaluate(*args, **kwargs, progress=progress)
    finally:
        if bar is not None:
            bar.close()
    terms = result.get("by_terms")
    shown = "" if not terms else " (by terms: " + ", ".join(
        f"{k}: {v:.3f}" for k, v in terms.items()) + ")"
    say(f"{label}: accuracy {result['accuracy']:.3f}, mean exit loop "
        f"{result['mean_exit_loop']:.2f}, {result['problems']} problems{shown}")
    return result


def warm_start_line(d: dict[str, Any]) -> str:
    """One rounded line of a warm-start evaluation point."""
    return (f"warm start step {d['step']}: loss {d['loss']:.3f}, last-loop CE "
            f"{d['ce_last_loop']:.3f}, held-out accuracy {d['accuracy']:.3f}")


def warm_start_logger(bar, say):
    """The warm start's `log` callback: each stage-I evaluation point as a line, above the bar
    (and in its postfix), or through `say` without one."""
    def log(d: dict[str, Any]) -> None:
        if "accuracy" in d:
            if bar is not None:
                bar.set_postfix(loss=f"{d['loss']:.3f}", acc=f"{d['accuracy']:.3f}")
                bar.write(warm_start_line(d), file=sys.stderr)
            else:
                say(warm_start_line(d))
    return log


def warm_start_bar_cut(bar, gate_steps: int):
    """The warm start's `stage1_done(n)` callback: the bar's total (stage I's maximum +
    `gate_steps` until then) cut to the n stage-I steps that ran + `gate_steps`, so a stage I
    that stopped at its plateau does not leave a bar that looks aborted (e.g. at 900 / 4100)."""
    def cut(n: int) -> None:
        if bar is not None:
            bar.total = n + gate_steps
            bar.refresh()
    return cut


def replay_exact_steps(metrics_path: Path, n_steps: int) -> int:
    """How many of the GRPO steps 0..n_steps-1 in metrics.jsonl replayed the sampler's
    log-probs bit for bit (`replay_exact_fraction` 1.0)."""
    if not metrics_path.exists():
        return 0
    rows = [json.loads(x) for x in metrics_path.read_text().splitlines() if x.strip()]
    return sum(1 for r in rows if r["step"] < n_steps and r.get("replay_exact_fraction") == 1.0)


def warn_inexact(m: dict[str, Any], bar) -> None:
    """The console line for a GRPO step whose replay was not bit-exact (stderr, also when
    quiet: it is a failure of the bit claim, not progress)."""
    line = (f"looprl train: warning: GRPO step {m['step']}: replay_exact_fraction "
            f"{m['replay_exact_fraction']:.4f} < 1 (ratio {m['ratio_min']:.4f}.."
            f"{m['ratio_max']:.4f}, replay_impl {m['replay_impl']}): the learner does not "
            f"reproduce the sampler's log-probs; check this backend with `looprl verify`")
    if bar is not None:
        bar.write(line, file=sys.stderr)
    else:
        print(line, file=sys.stderr, flush=True)


def replay_record(metrics_path: Path) -> dict[str, Any]:
    """{"replay_steps", "replay_exact_fraction_min" (None without steps),
    "inexact_replay_steps"} over every row of metrics.jsonl (a resumed run's too)."""
    fracs = []
    if metrics_path.exists():
        for line in metrics_path.read_text().splitlines():
            try:
                fracs.append(float(json.loads(line)["replay_exact_fraction"]))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                continue
    return {"replay_steps": len(fracs),
            "replay_exact_fraction_min": min(fracs) if fracs else None,
            "inexact_replay_steps": sum(f < 1.0 for f in fracs)}
