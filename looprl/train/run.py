"""`looprl train CONFIG [key=value ...]`: warm start, evaluation, GRPO, evaluation (DESIGN.md §6).

The run directory (`run.out_dir`) receives:
  config.json            the resolved experiment config
  warm_start_curve.json  the warm start's report (stage-I curve with held-out accuracy, stage II)
  warm_start/            looprl checkpoint of the warm-started params (the GRPO reference)
  metrics.jsonl          one object per GRPO step (`looprl.rl.trainer.GRPOLearner.step`)
  tb/                    TensorBoard events (tensorboardX) of the same scalars
  checkpoint/            final looprl checkpoint (params + model_config.json + tokenizer.json)
  summary.json           eval_accuracy_before/after, eval_problems, grpo_steps,
                         resumed_from_step, params_sha256, wall_s, ...
  failure.json           only when a step failed (non-finite loss/gradient): the diagnostic

A fresh run into a non-empty out_dir is a ConfigError. `resume=RUN_DIR` is reserved for exact
resume (issue 6) and is refused until then.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from looprl.config import (ExperimentConfig, apply_overrides, load_experiment_module,
                           save_json)
from looprl.errors import ConfigError, TrainingError


def build_tasks(cfg: ExperimentConfig):
    """(warm-start task, GRPO task) sharing one held-out set (same seed and eval knobs).

    `task.name` `arithmetic` (tiny models; its own character tokenizer) or `gsm8k` (real Ouro
    models: one task for both roles, the tokenizer from `model.checkpoint`, no warm start).
    Raises ConfigError for an unknown task, a GSM8K run without `model.checkpoint` or with
    `warm_start.enabled`, or bad task knobs.
    """
    from looprl.tasks import get_task

    t = cfg.task
    if t.name == "gsm8k":
        if not cfg.model.checkpoint:
            raise ConfigError("config key 'model.checkpoint': task 'gsm8k' has no tokenizer of its "
                              "own, so it needs a converted Ouro checkpoint (looprl convert --hf "
                              "DIR --out CKPT), e.g. model.checkpoint=/path/to/ouro-1.4b-looprl")
        if cfg.warm_start.enabled:
            raise ConfigError("config key 'warm_start.enabled': the supervised warm start is for "
                              "tiny models; task 'gsm8k' starts from model.checkpoint, set "
                              "warm_start.enabled=false")
        task = get_task("gsm8k", data_dir=t.data_dir, source=t.source, seed=t.data_seed,
                        prompt_style=t.prompt_style or "chatml")
        return task, task
    if t.name != "arithmetic":
        raise ConfigError(f"config key 'task.name': expected 'arithmetic' or 'gsm8k', found "
                          f"{t.name!r}")
    if len(t.train_datasets) != 1 or t.eval_datasets != t.train_datasets:
        raise ConfigError(f"config key 'task.train_datasets': the arithmetic task takes one "
                          f"dataset (the same for eval_datasets), found {t.train_datasets} / "
                          f"{t.eval_datasets}")
    common = dict(seed=t.data_seed, dataset=t.train_datasets[0], eval_terms=t.eval_terms,
                  eval_digits=t.eval_digits, eval_size=t.eval_size,
                  solution_style=t.solution_style, spaces=t.spaces)
    if t.prompt_style is not None:
        common["prompt_style"] = t.prompt_style
    warm = get_task("arithmetic", train_terms=t.train_terms, train_digits=t.train_digits,
                    **common)
    rl = get_task("arithmetic", train_terms=t.rl_terms or t.eval_terms,
                  train_digits=t.rl_digits or t.eval_digits, **common)
    return warm, rl


def run_tokenizer(task, checkpoint_tokenizer_json: str | None, checkpoint: str | None):
    """The run's tokenizer: the task's own (tiny tasks), else the model checkpoint's
    `tokenizer.json`. Raises CheckpointError when neither exists."""
    from looprl.errors import CheckpointError
    from looprl.tokenizer import tokenizer_from_json

    tokenizer = task.tokenizer()
    if tokenizer is not None:
        return tokenizer
    if checkpoint_tokenizer_json is None:
        raise CheckpointError(f"{checkpoint}: task {task.name!r} uses the model's tokenizer, but "
                              f"the checkpoint has no tokenizer.json (convert with --tokenizer)")
    return tokenizer_from_json(checkpoint_tokenizer_json)


def model_config(cfg: ExperimentConfig):
    from looprl.model.config import preset

    m = cfg.model
    over = {k: getattr(m, k) for k in ("hidden_size", "num_layers", "num_heads",
                                       "intermediate_size", "total_ut_steps")
            if getattr(m, k) is not None}
    if "num_heads" in over:
        over["num_kv_heads"] = over["num_heads"]
    if "hidden_size" in over or "num_heads" in over:
        base = preset(m.preset)
        over["head_dim"] = over.get("hidden_size", base.hidden_size) // over.get(
            "num_heads", base.num_heads)
    return preset(m.preset, **over)


def _prepare_out_dir(cfg: ExperimentConfig) -> Path:
    out = Path(cfg.run.out_dir)
    if cfg.run.resume is not None:
        raise ConfigError(f"config key 'run.resume': resuming ({cfg.run.resume!r}) needs training "
                          f"checkpoints, which are not implemented yet (issue 6)")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"config key 'run.out_dir': {str(out)!r} is not empty; a fresh run "
                          f"needs an empty or new directory (or resume={str(out)!r})")
    out.mkdir(parents=True, exist_ok=True)
    return out.resolve()   # absolute: orbax refuses relative checkpoint paths


def train(cfg: ExperimentConfig, *, quiet: bool = False) -> dict[str, Any]:
    """Run the whole experiment; returns the summary dict (also written to summary.json)."""
    import jax

    from looprl.model.looped import init_params
    from looprl.rl.trainer import GRPOLearner, evaluate
    from looprl.train.checkpoint import (load_model_checkpoint, params_sha256,
                                         save_model_checkpoint)
    from looprl.train.warm_start import warm_start

    t_start = time.time()
    out = _prepare_out_dir(cfg)
    save_json(cfg, out / "config.json")
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, flush=True))
    warm_task, rl_task = build_tasks(cfg)
    eval_set = warm_task.eval_problems(cfg.eval.eval_problems)

    ckpt_tokenizer = None
    if cfg.model.checkpoint:
        params, mcfg, ckpt_tokenizer, _ = load_model_checkpoint(
            Path(cfg.model.checkpoint).resolve())
        say(f"loaded {cfg.model.checkpoint}")
    else:
        mcfg = model_config(cfg)
        params = init_params(mcfg, cfg.run.seed)
    tokenizer = run_tokenizer(warm_task, ckpt_tokenizer, cfg.model.checkpoint)
    if mcfg.vocab_size < tokenizer.vocab_size:
        raise ConfigError(f"model vocab {mcfg.vocab_size} < tokenizer vocab "
                          f"{tokenizer.vocab_size}")

    ws = cfg.warm_start
    report: dict[str, Any] = {"enabled": ws.enabled}
    if ws.enabled:
        plateau_set = eval_set[:ws.eval_problems]

        def eval_fn(p):
            return evaluate(mcfg, p, warm_task, tokenizer, cfg, plateau_set)["accuracy"]

        def log(d):
            if "accuracy" in d:
                say(f"warm start {d}")

        params, report = warm_start(
            mcfg, params, warm_task, tokenizer, steps=ws.max_steps, batch_size=ws.batch_size,
            learning_rate=ws.learning_rate, seed=cfg.run.seed, gate_steps=ws.gate_steps,
            gate_learning_rate=ws.gate_learning_rate, entropy_beta=ws.entropy_beta,
            eval_fn=eval_fn, eval_every=ws.eval_every_steps, log=log,
            plateau_last_fraction=ws.plateau_last_fraction, plateau_min_gain=ws.plateau_min_gain,
            plateau_min_evals=ws.plateau_min_evals)
    (out / "warm_start_curve.json").write_text(json.dumps(report, indent=2) + "\n")
    params = jax.tree.map(np.asarray, params)
    save_model_checkpoint(out / "warm_start", params, mcfg, tokenizer.to_json(),
                          extra_meta={"stage": "warm_start"})

    before = evaluate(mcfg, params, warm_task, tokenizer, cfg, eval_set)
    say(f"eval before GRPO: {before}")
    before_q1 = None
    if cfg.rollout.exit_threshold < 1.0:
        before_q1 = evaluate(mcfg, params, warm_task, tokenizer, cfg, eval_set, exit_threshold=1.0)
        say(f"eval before GRPO at q=1.0: {before_q1}")

    learner = GRPOLearner(cfg, mcfg, params, rl_task, tokenizer)
    n_steps = cfg.run.grpo_steps if cfg.run.stop_after is None else min(cfg.run.grpo_steps,
                                                                         cfg.run.stop_after)
    writer = None
    if cfg.run.tensorboard:
        from tensorboardX import SummaryWriter
        writer = SummaryWriter(str(out / "tb"))
    bar = None
    if cfg.run.progress_bar and not quiet:
        from tqdm import tqdm
        bar = tqdm(total=n_steps, desc="GRPO", unit="step")
    metrics_path = out / "metrics.jsonl"
    try:
        with metrics_path.open("w") as f:
            for step in range(n_steps):
                try:
                    m = learner.step(step)
                except TrainingError as e:
                    (out / "failure.json").write_text(json.dumps(
                        {"step": step, "error": str(e)}, indent=2) + "\n")
                    raise
                f.write(json.dumps(m) + "\n")
                f.flush()
                if writer is not None:
                    for k, v in m.items():
                        if k != "step" and isinstance(v, (int, float)) and np.isfinite(v):
                            writer.add_scalar(k, v, step)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(reward=f"{m['reward_mean']:.3f}",
                                    exact=f"{m['replay_exact_fraction']:.2f}",
                                    exit=f"{m['mean_exit_loop']:.2f}")
    finally:
        if bar is not None:
            bar.close()
        if writer is not None:
            writer.close()

    params = jax.tree.map(np.asarray, learner.params)
    # no GRPO step: the parameters are the warm-started ones, whose evaluation is `before`
    after = before if n_steps == 0 else evaluate(mcfg, params, warm_task, tokenizer, cfg,
                                                 eval_set)
    say(f"eval after GRPO: {after}")
    save_model_checkpoint(out / "checkpoint", params, mcfg, tokenizer.to_json(),
                          extra_meta={"stage": "grpo", "grpo_steps": n_steps})
    summary = {"eval_accuracy_before": before["accuracy"],
               "eval_accuracy_after": after["accuracy"],
               "eval_problems": len(eval_set), "grpo_steps": n_steps,
               "resumed_from_step": None, "params_sha256": params_sha256(params),
               "wall_s": time.time() - t_start,
               "eval_before": before, "eval_after": after, "eval_before_q1": before_q1,
               "exit_threshold": cfg.rollout.exit_threshold,
               "warm_start_steps": report.get("stage1_steps"),
               "warm_start_plateaued": report.get("plateaued"),
               "seed": cfg.run.seed}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


_HEADLINE = ("eval_accuracy_before", "eval_accuracy_after", "eval_problems", "grpo_steps",
             "wall_s")


def train_variants(cfg: ExperimentConfig, variants: dict[str, list[str]], overrides: list[str],
                   *, shared_warm_start: bool = False, quiet: bool = False) -> dict[str, Any]:
    """Run each variant (`cfg` + its overrides + the command line's `overrides`, which win) into
    `out_dir/<name>`, one after another; with `shared_warm_start`, first a warm-start-only run
    (`grpo_steps=0`) into `out_dir/warm_start_run` whose checkpoint every variant starts from.
    Writes `out_dir/variants.json` (each variant's overrides and summary headline) and the
    side-by-side plots into `out_dir/plots`; returns the variants.json dict."""
    t0 = time.time()
    parent = Path(cfg.run.out_dir)
    if cfg.run.resume is not None:
        raise ConfigError("config key 'run.resume': resuming a multi-variant experiment is not "
                          "supported; resume one variant's directory with its own config.json")
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
                                                               _HEADLINE}}
    for name, over in variants.items():
        vcfg = apply_overrides(cfg, common + list(over) + list(overrides)
                               + [f"run.out_dir={parent / name}"])
        say(f"== variant {name}: {' '.join(over)}")
        summary = train(vcfg, quiet=quiet)
        result["variants"][name] = {"overrides": list(over), "dir": str(parent / name),
                                    **{k: summary[k] for k in _HEADLINE}}
    result["wall_s"] = time.time() - t0
    (parent / "variants.json").write_text(json.dumps(result, indent=2) + "\n")
    try:
        from looprl.train.plots import plot_runs
        plot_runs([parent / n for n in variants], parent / "plots")
    except ImportError as e:  # matplotlib missing: the runs themselves are complete
        say(f"plots skipped: {e}")
    return result


def run_train(args) -> int:
    """CLI entry: `looprl train CONFIG [key=value ...]`; an experiment file with `VARIANTS`
    runs every variant (`train_variants`)."""
    base, variants, shared = load_experiment_module(args.config)
    cfg = apply_overrides(base, args.overrides)
    if variants:
        result = train_variants(cfg, variants, list(args.overrides), shared_warm_start=shared)
        print(json.dumps({n: {k: v[k] for k in _HEADLINE}
                          for n, v in result["variants"].items()}))
        return 0
    summary = train(cfg)
    print(json.dumps({k: summary[k] for k in _HEADLINE}))
    return 0
