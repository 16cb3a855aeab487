"""Experiments with `VARIANTS`: each variant a full run into `out_dir/<name>`, optionally from one
shared warm start, with `variants.json` and side-by-side plots."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from looprl.config import ExperimentConfig, apply_overrides
from looprl.errors import ConfigError
from looprl.programs import release_programs_near_map_limit
from looprl.train.plots import plot_runs
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
    no variants.json is written."""
    t0 = time.time()
    parent = Path(cfg.run.out_dir)
    if cfg.run.resume is not None:
        raise ConfigError("config key 'run.resume': resuming a multi-variant experiment is not "
                          "supported; resume one variant's directory with its own config.json: "
                          "looprl train RUN_DIR/NAME/config.json resume=RUN_DIR/NAME")
    if parent.exists() and (not parent.is_dir() or any(parent.iterdir())):
        raise ConfigError(f"config key 'run.out_dir': {str(parent)!r} is not empty; a fresh run "
                          f"needs an empty or new directory")
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, flush=True))
    common: list[str] = []
    result: dict[str, Any] = {"variants": {}, "shared_warm_start": None}
    if shared_warm_start:
        ws_dir = parent / "warm_start_run"
        say(f"== shared warm start -> {ws_dir}")
        ws_cfg = cfg.replace(run=cfg.run.replace(out_dir=str(ws_dir), grpo_steps=0,
                                                 stop_after=None))
        ws_summary = train(ws_cfg, quiet=quiet)
        common = [f"model.checkpoint={ws_dir / 'warm_start'}", "warm_start.enabled=false"]
        result["shared_warm_start"] = {"dir": str(ws_dir), **{k: ws_summary[k] for k in
                                                               HEADLINE_KEYS}}
    for name, over in variants.items():
        vcfg = apply_overrides(cfg, common + list(over) + list(overrides)
                               + [f"run.out_dir={parent / name}"])
        say(f"== variant {name}: {' '.join(over)}")
        summary = train(vcfg, quiet=quiet)
        if "preempted_at_step" in summary:  # SIGTERM / Ctrl-C in its GRPO loop: stop the sweep
            result["preempted"] = {"variant": name, **summary}
            return result
        result["variants"][name] = {"overrides": list(over), "dir": str(parent / name),
                                    **{k: summary[k] for k in HEADLINE_KEYS}}
        release_programs_near_map_limit()
    result["wall_s"] = time.time() - t0
    (parent / "variants.json").write_text(json.dumps(result, indent=2) + "\n")
    try:
        plot_runs([parent / n for n in variants], parent / "plots")
    except ImportError as e:  # matplotlib missing: the runs themselves are complete
        say(f"plots skipped: {e}")
    return result
