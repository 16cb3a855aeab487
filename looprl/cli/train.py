"""`looprl train CONFIG [key=value ...]`: one run (`looprl.train.run.train`), or every variant of
an experiment file with `VARIANTS` (`looprl.train.variants`)."""
from __future__ import annotations

import json
import signal

from looprl.config import apply_overrides, load_experiment_module, load_json, resolve_key
from looprl.distributed.multihost import init_distributed, is_main_process
from looprl.train.run import train
from looprl.train.variants import HEADLINE_KEYS, train_variants


def run(args) -> int:
    """CLI entry: `looprl train CONFIG [key=value ...]`; an experiment file with `VARIANTS`
    runs every variant (`train_variants`). CONFIG may also be a run directory's `config.json`.
    With `resume=` and no `out_dir=`, out_dir is the resumed directory. With `--coordinator` /
    `--distributed` (or the LOOPRL_* environment) the process first joins the others
    (`looprl.distributed.multihost`). Returns the exit status: 0, or 143 (128 + SIGTERM) when
    SIGTERM stopped the run after a checkpoint."""
    init_distributed(getattr(args, "coordinator", None), getattr(args, "num_processes", None),
                     getattr(args, "process_id", None), getattr(args, "distributed", False))
    if str(args.config).endswith(".json"):  # a run directory's config.json
        base, variants, shared = load_json(args.config), None, False
    else:
        base, variants, shared = load_experiment_module(args.config)
    cfg = apply_overrides(base, args.overrides)
    if cfg.run.resume is not None and not any(
            resolve_key(type(cfg), o.partition("=")[0].strip()) == ("run", "out_dir")
            for o in args.overrides):
        cfg = apply_overrides(cfg, [f"run.out_dir={cfg.run.resume}"])  # continue in place
    if variants:
        result = train_variants(cfg, variants, list(args.overrides), shared_warm_start=shared)
        print(json.dumps({n: {k: v[k] for k in HEADLINE_KEYS}
                          for n, v in result["variants"].items()}))
        return 0
    summary = train(cfg, t_start=getattr(args, "t_start", None))
    if "preempted_at_step" in summary:
        if is_main_process():
            print(json.dumps(summary))
        return 128 + signal.SIGTERM
    if is_main_process():
        print(json.dumps({k: summary[k] for k in HEADLINE_KEYS}))
    return 0
