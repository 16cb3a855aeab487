"""`looprl train CONFIG [key=value ...]`: one run (`looprl.train.run.train`), or every variant of
an experiment file with `VARIANTS` (`looprl.train.variants`)."""
from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

from looprl.config import (apply_overrides, config_key_lines, load_experiment_module, load_json,
                           resolve_key)
from looprl.distributed.multihost import init_distributed, is_main_process
from looprl.train.console import no_learning_line
from looprl.train.resume import resume_command
from looprl.train.run import train
from looprl.train.variants import HEADLINE_KEYS, train_variants


def run(args) -> int:
    """CLI entry: `looprl train CONFIG [key=value ...]`; an experiment file with `VARIANTS`
    runs every variant (`train_variants`; `resume=OUT_DIR` continues such a sweep in place).
    CONFIG may also be a run directory's `config.json`.
    With `resume=` and no `out_dir=`, out_dir is the resumed directory. With `--coordinator` /
    `--distributed` (or the LOOPRL_* environment) the process first joins the others
    (`looprl.distributed.multihost`). Returns the exit status: 0, or 143 (128 + SIGTERM) / 130
    (128 + SIGINT) when SIGTERM / Ctrl-C stopped the run (after a checkpoint during GRPO)."""
    init_distributed(getattr(args, "coordinator", None), getattr(args, "num_processes", None),
                     getattr(args, "process_id", None), getattr(args, "distributed", False))
    if str(args.config).endswith(".json"):  # a run directory's config.json
        base, variants, shared = load_json(args.config), None, False
    else:
        base, variants, shared = load_experiment_module(args.config)
    cfg = apply_overrides(base, args.overrides)
    if getattr(args, "list_keys", False):
        print("\n".join(config_key_lines(cfg)))
        return 0
    if cfg.run.resume is not None and not any(
            resolve_key(type(cfg), o.partition("=")[0].strip()) == ("run", "out_dir")
            for o in args.overrides):
        cfg = apply_overrides(cfg, [f"run.out_dir={cfg.run.resume}"])  # continue in place
    if variants:
        result = train_variants(cfg, variants, list(args.overrides), shared_warm_start=shared)
        if "preempted" in result:  # one variant stopped by SIGTERM / Ctrl-C: the sweep stopped
            print(json.dumps(result["preempted"]))
            return result["preempted"].get("exit_status", 128 + signal.SIGTERM)
        print(json.dumps({n: {k: v[k] for k in HEADLINE_KEYS}
                          for n, v in result["variants"].items()}))
        return 0
    try:
        summary = train(cfg, t_start=getattr(args, "t_start", None))
    except KeyboardInterrupt:  # Ctrl-C outside the GRPO loop (warm start, evaluations)
        out = Path(cfg.run.out_dir)
        how = (resume_command(out) if (out / "config.json").is_file()
               else f"looprl train {args.config} (nothing of the run was written yet)")
        print(f"\nlooprl train: interrupted (Ctrl-C); the checkpoints written so far are "
              f"complete; continue with: {how}", file=sys.stderr, flush=True)
        return 128 + signal.SIGINT
    if "preempted_at_step" in summary:
        if is_main_process():
            print(json.dumps(summary))
        return summary.get("exit_status", 128 + signal.SIGTERM)
    if is_main_process():
        if "stopped" not in summary:  # a stopped run's table would read as a finished one's
            print_summary_table(summary, cfg.run.out_dir)
        print(json.dumps({k: summary[k] for k in HEADLINE_KEYS}))
        if "stopped" in summary:
            print(summary["stopped"], flush=True)
    return 0


def print_summary_table(summary: dict, out_dir: str) -> None:
    """The end of `looprl train`: accuracy before/after GRPO, replay exactness, wall time and
    where the outputs are, as one short rich table."""
    from rich.console import Console
    from rich.table import Table

    exact = summary.get("replay_exact_steps")
    table = Table(title=f"looprl train: {out_dir}", show_header=False)
    table.add_column("what")
    table.add_column("value")
    table.add_row("held-out accuracy", f"{summary['eval_accuracy_before']:.3f} before GRPO -> "
                  f"{summary['eval_accuracy_after']:.3f} after "
                  f"({summary['eval_problems']} problems)")
    if exact is not None:
        table.add_row("replay exact", f"{exact}/{summary['grpo_steps']} GRPO steps bit for bit")
    else:
        table.add_row("GRPO steps", str(summary["grpo_steps"]))
    nothing = no_learning_line(summary.get("params_changed", True),
                               summary.get("steps_with_zero_grad"), summary["grpo_steps"])
    if nothing:
        table.add_row("learning", nothing)
    if summary.get("already_finished"):
        table.add_row("resume", "the run had finished: nothing ran, nothing changed")
    table.add_row("wall time", f"{summary['wall_s']:.0f} s")
    table.add_row("outputs", f"{out_dir}/summary.json, metrics.jsonl, checkpoint/ "
                  f"(plots: looprl plot {out_dir})")
    Console(width=100).print(table)
