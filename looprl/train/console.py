"""What `looprl train` shows while it runs: progress bars on stderr (tqdm on a terminal, plain
lines otherwise) for the warm start, GRPO and the evaluations, their figures as short rounded
lines, and the warnings of an inexact replay or a run that learned nothing."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from looprl.rl.evaluation import evaluate


class LineProgress:
    """A progress bar as plain lines on stderr, for a stderr that is not a terminal (a log
    file): `desc: n/total unit` at every tenth of `total` and at `close()`, with the postfix;
    no carriage returns. The part of tqdm's interface looprl uses."""

    def __init__(self, total: int, desc: str, unit: str, initial: int = 0):
        self.total, self.desc, self.unit, self.n = total, desc, unit, initial
        self._postfix = ""
        self._shown = initial

    def _line(self) -> None:
        print(f"{self.desc}: {self.n}/{self.total} {self.unit}{self._postfix}", file=sys.stderr,
              flush=True)
        self._shown = self.n

    def update(self, n: int = 1) -> None:
        self.n += n
        step = max(1, (self.total or 0) // 10)
        if self.n // step > self._shown // step:
            self._line()

    def set_postfix(self, **kw) -> None:
        self._postfix = " (" + ", ".join(f"{k}={v}" for k, v in kw.items()) + ")"

    def write(self, line: str, file=None) -> None:
        print(line, file=file or sys.stderr, flush=True)

    def refresh(self) -> None:
        pass

    def close(self) -> None:
        if self.n != self._shown:
            self._line()


def progress_bar(show: bool, total: int, desc: str, unit: str, initial: int = 0,
                 leave: bool = False):
    """A tqdm bar on stderr when stderr is a terminal, else a `LineProgress` (plain lines);
    None when bars are off."""
    if not show:
        return None
    if not sys.stderr.isatty():
        return LineProgress(total, desc, unit, initial)
    from tqdm import tqdm
    return tqdm(total=total, initial=initial, desc=desc, unit=unit, leave=leave, file=sys.stderr)


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


def steps_with_zero_grad(metrics_path: Path, n_steps: int) -> int:
    """How many of the GRPO steps 0..n_steps-1 in metrics.jsonl had gradient norm 0 (every
    group's rewards equal: nothing to learn from)."""
    n = 0
    if metrics_path.exists():
        for line in metrics_path.read_text().splitlines():
            try:
                r = json.loads(line)
                n += r["step"] < n_steps and float(r["grad_norm"]) == 0.0
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                continue
    return n


def no_learning_line(params_changed: bool, zero_grad: int | None, n_steps: int) -> str | None:
    """The console's warning for a run that learned nothing: parameters equal to the
    reference policy's, or every GRPO step with gradient norm 0; None otherwise."""
    if n_steps == 0:
        return None
    if zero_grad == n_steps:
        why = (f"every one of the {n_steps} GRPO steps had gradient norm 0 (each group's rewards "
               f"were equal: nothing to learn from)")
    elif not params_changed:
        why = f"{zero_grad} of {n_steps} GRPO steps had gradient norm 0"
    else:
        return None
    changed = "changed" if params_changed else "did not change (params_sha256 equals the " \
        "reference policy's)"
    return f"the run learned nothing: {why}; the parameters {changed}"


def warn_no_learning(params_changed: bool, zero_grad: int | None, n_steps: int) -> None:
    """Print `no_learning_line` on stderr when there is one."""
    line = no_learning_line(params_changed, zero_grad, n_steps)
    if line:
        print(f"looprl train: warning: {line}", file=sys.stderr, flush=True)


def warn_inexact(m: dict[str, Any], bar) -> None:
    """The console line for a GRPO step whose replay was not bit-exact (stderr, also when
    quiet: it is a failure of the bit claim, not progress)."""
    lo, hi = m.get('ratio_min'), m.get('ratio_max')  # None on a skipped (no-signal) step
    ratio = "n/a" if lo is None or hi is None else f"{lo:.4f}..{hi:.4f}"
    line = (f"looprl train: warning: GRPO step {m['step']}: replay_exact_fraction "
            f"{m['replay_exact_fraction']:.4f} < 1 (ratio {ratio}, "
            f"replay_impl {m['replay_impl']}): the learner does not "
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
