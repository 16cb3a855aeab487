"""What `looprl train` shows while it runs: progress bars (tqdm, on stderr, as GRPO's) for the
warm start and the evaluations, and their figures as short rounded lines."""
from __future__ import annotations

import sys
from typing import Any

from looprl.rl.evaluation import evaluate


def progress_bar(show: bool, total: int, desc: str, unit: str):
    """A tqdm bar on stderr (GRPO's kind), or None when bars are off."""
    if not show:
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit=unit, leave=False, file=sys.stderr)


def evaluate_and_say(label: str, show_bar: bool, say, *args, **kwargs) -> dict[str, Any]:
    """`evaluate(*args, **kwargs)` with a progress bar over the problems, then one line of
    rounded figures."""
    problems = args[5]
    bar = progress_bar(show_bar, len(problems), label, "problem")
    try:
        result = evaluate(*args, **kwargs, progress=None if bar is None else bar.update)
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
