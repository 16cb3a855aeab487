"""Experiments with `VARIANTS`: each variant a full run into `out_dir/<name>`, optionally from one
shared warm start, with `variants.json` and side-by-side plots."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from looprl.config import ExperimentConfig, apply_overrides, resolve_key
from looprl.errors import ConfigError
from looprl.programs import release_programs_near_map_limit
from looprl.train.plots import plot_runs
from looprl.train.resume import finished_summary
from looprl.train.run import train

HEADLINE_KEYS = ("eval_accuracy_before", "eval_accuracy_after", "eval_problems", "grpo_steps",
             "wall_s")


def train_variants(cfg: ExperimentConfig, variants: dict[str, list[str]], overrides: list[str],
                   *, shared_warm_start: bool = False, quiet: bool = False) -> dict[str, Any]:
    """Run each variant (`cfg` + its overrides + the command line's `overrides`, which win) into
    `out_dir/<name>`, one after another; with `shared_warm_start`, first a warm-start-only run
    (`grpo_steps=0`) into `out_dir/warm_start_run` whose checkpoint every variant starts from.
    Writes `out_dir/variants.json` (each variant's overrides and summary headline) and the
    side-by-side plots into `out_dir/plots`; returns the variants.json dict. A variant stopped
    by SIGTERM or a first Ctrl-C in its GRPO loop (checkpointed, resumable on its own) ends the
    sweep: the result then carries `preempted` (that variant's name and preemption record) and
    no variants.json is written.

    With `run.resume` equal to `out_dir` the sweep continues in place (`check_sweep_resume`): a
    finished warm start or variant is kept, a started one resumes from its newest checkpoint
    (bit for bit, as a single run does), the others run. The command line's overrides must be
    the first run's (each run checks its config against its `config.json`).

    Raises:
      ConfigError: a fresh sweep into a non-empty `out_dir`; `run.resume` not `out_dir`, or no
        such directory.
    """
    t0 = time.time()
    parent = Path(cfg.run.out_dir)
    resuming = cfg.run.resume is not None
    if resuming:
        check_sweep_resume(cfg, parent)
        cfg = cfg.replace(run=cfg.run.replace(resume=None))
        overrides = [o for o in overrides if not _is_resume(o)]
    elif parent.exists() and (not parent.is_dir() or any(parent.iterdir())):
        raise ConfigError(f"config key 'run.out_dir': {str(parent)!r} is not empty; a fresh run "
                          f"needs an empty or new directory (resume={parent} continues a sweep "
                          f"stopped there)")
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, flush=True))
    common: list[str] = []
    result: dict[str, Any] = {"variants": {}, "shared_warm_start": None}
    if shared_warm_start:
        ws_dir = parent / "warm_start_run"
        say(f"== shared warm start -> {ws_dir}")
        ws_cfg = cfg.replace(run=cfg.run.replace(out_dir=str(ws_dir), grpo_steps=0,
                                                 stop_after=None))
        # a finished warm-start run has no training checkpoint: its end is step 0 of 0
        ws_summary = finished_summary(ws_dir, 0, 0) if resuming else None
        if ws_summary is None:
            ws_summary = train(_resume_if_started(ws_cfg, ws_dir, resuming), quiet=quiet)
        common = [f"model.checkpoint={ws_dir / 'warm_start'}", "warm_start.enabled=false"]
        result["shared_warm_start"] = {"dir": str(ws_dir), **{k: ws_summary[k] for k in
                                                               HEADLINE_KEYS}}
    for name, over in variants.items():
        vdir = parent / name
        vcfg = apply_overrides(cfg, common + list(over) + list(overrides)
                               + [f"run.out_dir={vdir}"])
        say(f"== variant {name}: {' '.join(over)}")
        summary = train(_resume_if_started(vcfg, vdir, resuming), quiet=quiet)
        if "preempted_at_step" in summary:  # SIGTERM / Ctrl-C in its GRPO loop: stop the sweep
            result["preempted"] = {"variant": name, **summary}
            return result
        result["variants"][name] = {"overrides": list(over), "dir": str(vdir),
                                    **{k: summary[k] for k in HEADLINE_KEYS}}
        release_programs_near_map_limit()
    result["wall_s"] = time.time() - t0
    (parent / "variants.json").write_text(json.dumps(result, indent=2) + "\n")
    try:
        plot_runs([parent / n for n in variants], parent / "plots")
    except ImportError as e:  # matplotlib missing: the runs themselves are complete
        say(f"plots skipped: {e}")
    return result


def check_sweep_resume(cfg: ExperimentConfig, parent: Path) -> None:
    """Raise ConfigError unless `run.resume` names `out_dir` and that directory exists."""
    if Path(cfg.run.resume).resolve() != parent.resolve():
        raise ConfigError(f"config key 'run.resume': a sweep continues in place, so resume must "
                          f"be out_dir {str(parent)!r}, found {cfg.run.resume!r}")
    if not parent.is_dir():
        raise ConfigError(f"config key 'run.resume': {str(parent)!r} is not a directory; "
                          f"nothing to continue")


def _is_resume(override: str) -> bool:
    return resolve_key(ExperimentConfig, override.partition("=")[0].strip()) == ("run", "resume")


def _resume_if_started(run_cfg: ExperimentConfig, run_dir: Path,
                       resuming: bool) -> ExperimentConfig:
    """`run_cfg` resuming `run_dir` in place when a resumed sweep had started it (its
    `config.json` is written), else `run_cfg` as a fresh run."""
    if resuming and (run_dir / "config.json").is_file():
        return run_cfg.replace(run=run_cfg.run.replace(resume=str(run_dir)))
    return run_cfg
