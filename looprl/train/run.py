"""`looprl train CONFIG [key=value ...]`: warm start, evaluation, GRPO, evaluation (DESIGN.md §6).

The run directory (`run.out_dir`) receives:
  config.json            the resolved experiment config
  warm_start_curve.json  the warm start's report (stage-I curve with held-out accuracy, stage II)
  warm_start/            looprl checkpoint of the warm-started params (the GRPO reference);
                         with the warm start off and `model.checkpoint` given, instead
  reference.json         {"checkpoint": that directory, "params_sha256"} (no multi-GB copy;
                         a resume checks the SHA-256)
  eval_before.json       the held-out evaluation of the warm-started model (reused on resume)
  metrics.jsonl          one object per GRPO step (`looprl.rl.trainer.GRPOLearner.step`)
  tb/                    TensorBoard events (tensorboardX) of the same scalars
  checkpoints/           training checkpoints `step_{N:08d}/` every `run.checkpoint_every_steps`
                         steps, at the last step run and on SIGTERM; the newest
                         `run.keep_checkpoints` are kept; `index.jsonl` lists step and
                         params_sha256 of each (`looprl.train.resume`)
  checkpoint/            final looprl checkpoint (params + model_config.json + tokenizer.json)
  summary.json           eval_accuracy_before/after, eval_problems, grpo_steps,
                         resumed_from_step, params_sha256, wall_s, ...
  failure.json           only when a step failed (non-finite loss/gradient): the diagnostic
  preempted.json         only when SIGTERM stopped the run: the step and checkpoint to resume

A fresh run into a non-empty out_dir is a ConfigError. `resume=RUN_DIR` (out_dir = RUN_DIR, set
from it when not given on the command line) continues from the newest complete training
checkpoint, skipping the warm start and the evaluation before GRPO, and gives the same
parameters, batches and samples as an uninterrupted run. `stop_after=k` stops once k GRPO steps
(counted from the start of the run) are done, with a checkpoint at step k. SIGTERM during GRPO
finishes the current step, saves a checkpoint and returns `{"preempted_at_step": k, ...}`
(exit status 143 from the CLI).
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from looprl.config import (ExperimentConfig, apply_overrides, load_experiment_module,
                           load_json, resolve_key, save_json)
from looprl.errors import CheckpointError, ConfigError, TrainingError

EVAL_BEFORE_FILE = "eval_before.json"
REFERENCE_FILE = "reference.json"


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
        if task.resolved_dir is not None and not (task.resolved_dir / task.train_file).is_file():
            raise ConfigError(f"config key 'task.data_dir': no {task.train_file!r} in "
                              f"{task.resolved_dir} (GRPO trains on it)")
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
        run_dir = Path(cfg.run.resume)
        if out.resolve() != run_dir.resolve():
            raise ConfigError(f"config key 'run.out_dir': a resumed run continues in place, so "
                              f"out_dir must be the resumed directory {cfg.run.resume!r}, found "
                              f"{cfg.run.out_dir!r}")
        if not (run_dir / "config.json").is_file():
            raise ConfigError(f"config key 'run.resume': {cfg.run.resume!r} is not a run "
                              f"directory (no config.json)")
        if not ((run_dir / "warm_start").is_dir() or (run_dir / REFERENCE_FILE).is_file()):
            raise ConfigError(f"config key 'run.resume': {cfg.run.resume!r} was interrupted "
                              f"before its warm start finished (no warm_start/ or "
                              f"{REFERENCE_FILE}), so there is nothing to resume; remove it or "
                              f"start again with another out_dir")
        return run_dir.resolve()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"config key 'run.out_dir': {str(out)!r} is not empty; a fresh run "
                          f"needs an empty or new directory (or resume={str(out)!r})")
    out.mkdir(parents=True, exist_ok=True)
    return out.resolve()   # absolute: orbax refuses relative checkpoint paths


def _load_reference(out: Path):
    """The reference (pre-GRPO) policy of a run being resumed: its `warm_start/` checkpoint, or
    the model checkpoint `reference.json` points at (runs without a warm start), checked
    against the SHA-256 recorded when the run started. Returns (params, cfg, tokenizer_json,
    dir). Raises CheckpointError if that checkpoint is gone or changed."""
    from looprl.train.checkpoint import load_model_checkpoint, params_sha256

    if (out / "warm_start").is_dir():
        params, mcfg, tok, meta = load_model_checkpoint(out / "warm_start")
        # runs that predate the recorded SHA-256 have nothing to compare against
        ref = {"checkpoint": str(out / "warm_start"), "params_sha256": meta.get("params_sha256")}
    else:
        ref = json.loads((out / REFERENCE_FILE).read_text())
        params, mcfg, tok, _ = load_model_checkpoint(ref["checkpoint"])
    recorded = ref["params_sha256"]
    sha = None if recorded is None else params_sha256(params)
    if sha != recorded:
        raise CheckpointError(f"{ref['checkpoint']}: the run's reference checkpoint changed since "
                              f"the run started (params_sha256 {sha[:12]}..., recorded "
                              f"{recorded[:12]}... at the start)")
    return params, mcfg, tok, Path(ref["checkpoint"])


def _resume_candidates(out: Path, say) -> list[tuple[int, Path]]:
    """The complete training checkpoints of run `out`, newest first, after saying which step
    directories are unusable and why. Raises CheckpointError when there is none."""
    from looprl.train.resume import checkpoint_candidates

    cands = checkpoint_candidates(out)
    for _, d, problem in cands:
        if problem is not None:
            say(f"skipping {d.name}: {problem}")
    good = [(s, d) for s, d, problem in reversed(cands) if problem is None]
    if good:
        return good
    if cands:
        raise CheckpointError(f"{out}: no usable training checkpoint: "
                              + "; ".join(f"{d.name}: {p}" for _, d, p in cands))
    raise CheckpointError(f"{out}: no training checkpoint under checkpoints/: the run was "
                          f"interrupted before its first one (during the warm start or the "
                          f"evaluation before GRPO), so there is nothing to resume; remove "
                          f"{out} or start again with another out_dir")


def train(cfg: ExperimentConfig, *, quiet: bool = False,
          t_start: float | None = None) -> dict[str, Any]:
    """Run the whole experiment; returns the summary dict (also written to summary.json).
    `t_start`: when the command started (`time.time()`), for `wall_s`; default now."""
    import jax

    from looprl.model.looped import init_params
    from looprl.rl.trainer import GRPOLearner, evaluate
    from looprl.train.checkpoint import (load_model_checkpoint, params_sha256,
                                         save_model_checkpoint)
    from looprl.train.resume import (load_resume_point,
                                     restore_training_checkpoint, save_training_checkpoint)
    from looprl.train.warm_start import warm_start

    from looprl.distributed.multihost import is_main_process, sync

    t_start = time.time() if t_start is None else t_start
    out = _prepare_out_dir(cfg)
    main = is_main_process()  # only process 0 writes logs, metrics and reports (issue 7)
    say = (lambda *a: None) if quiet or not main else (lambda *a: print(*a, flush=True))
    resume_from: list[tuple[int, Path]] = []  # complete training checkpoints, newest first
    if cfg.run.resume is not None:
        resume_from = _resume_candidates(out, say)
        load_resume_point(resume_from[0][1], cfg)
    sync("looprl-out-dir")  # every process checked out_dir before process 0 writes into it
    if cfg.run.resume is None and main:
        save_json(cfg, out / "config.json")
    warm_task, rl_task = build_tasks(cfg)
    eval_set = warm_task.eval_problems(cfg.eval.eval_problems)

    if not resume_from:
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
                plateau_last_fraction=ws.plateau_last_fraction,
                plateau_min_gain=ws.plateau_min_gain, plateau_min_evals=ws.plateau_min_evals)
        if main:
            (out / "warm_start_curve.json").write_text(json.dumps(report, indent=2) + "\n")
        params = jax.tree.map(np.asarray, params)
        if ws.enabled or not cfg.model.checkpoint:
            save_model_checkpoint(out / "warm_start", params, mcfg, tokenizer.to_json(),
                                  extra_meta={"stage": "warm_start",
                                              "params_sha256": params_sha256(params)})
        elif main:  # the reference policy is the given checkpoint: point at it, do not copy GBs
            (out / REFERENCE_FILE).write_text(json.dumps(
                {"checkpoint": str(Path(cfg.model.checkpoint).resolve()),
                 "params_sha256": params_sha256(params)}, indent=2) + "\n")

        before = evaluate(mcfg, params, warm_task, tokenizer, cfg, eval_set)
        say(f"eval before GRPO: {before}")
        before_q1 = None
        if cfg.rollout.exit_threshold < 1.0:
            before_q1 = evaluate(mcfg, params, warm_task, tokenizer, cfg, eval_set,
                                 exit_threshold=1.0)
            say(f"eval before GRPO at q=1.0: {before_q1}")
        if main:
            (out / EVAL_BEFORE_FILE).write_text(json.dumps(
                {"eval_before": before, "eval_before_q1": before_q1}, indent=2) + "\n")
    else:  # resume: the reference params, warm-start report and first evaluation are on disk
        params, mcfg, ckpt_tokenizer, ref_dir = _load_reference(out)
        tokenizer = run_tokenizer(warm_task, ckpt_tokenizer, str(ref_dir))
        report = json.loads((out / "warm_start_curve.json").read_text())
        saved_eval = json.loads((out / EVAL_BEFORE_FILE).read_text())
        before, before_q1 = saved_eval["eval_before"], saved_eval["eval_before_q1"]

    learner = GRPOLearner(cfg, mcfg, params, rl_task, tokenizer)
    start = 0
    resume_at = None
    for step_k, ckpt in resume_from:  # newest first; damaged data falls back to an older one
        try:
            start = restore_training_checkpoint(ckpt, learner)
        except CheckpointError as e:
            say(f"skipping {ckpt.name}: {e}")
            continue
        resume_at = (step_k, ckpt)
        say(f"resumed from {ckpt} (GRPO step {start})")
        break
    if resume_from and resume_at is None:
        raise CheckpointError(f"{out}: every training checkpoint under checkpoints/ is damaged "
                              f"({', '.join(c.name for _, c in resume_from)}); see the messages "
                              f"above")
    n_steps = cfg.run.grpo_steps if cfg.run.stop_after is None else min(cfg.run.grpo_steps,
                                                                         cfg.run.stop_after)
    if n_steps < start:
        raise ConfigError(f"config keys 'run.grpo_steps'/'run.stop_after': the run resumes at "
                          f"GRPO step {start}, past the requested end {n_steps}")
    if resume_at is not None:
        if main:
            save_json(cfg, out / "config.json")  # only once the resumption is known to be valid
        if start == n_steps:
            say(f"nothing to run: the run is at GRPO step {start}, the requested end "
                f"(run.grpo_steps={cfg.run.grpo_steps}, run.stop_after={cfg.run.stop_after}); "
                f"pass stop_after=none or a larger grpo_steps to continue")
    metrics_path = out / "metrics.jsonl" if main else Path(os.devnull)
    if resume_at is not None and main:  # drop rows of steps after the checkpoint (rerun)
        _truncate_jsonl(metrics_path, start, inclusive=False)
        _truncate_jsonl(out / "checkpoints" / "index.jsonl", start, inclusive=True)
    writer = None
    if cfg.run.tensorboard and main:
        from tensorboardX import SummaryWriter
        writer = SummaryWriter(str(out / "tb"), purge_step=start if start else None)
    bar = None
    if cfg.run.progress_bar and not quiet and main:
        from tqdm import tqdm
        bar = tqdm(total=n_steps, initial=start, desc="GRPO", unit="step")
    tok_json = tokenizer.to_json()
    preempted = None
    try:
        with metrics_path.open("w" if resume_at is None else "a") as f, \
                _SigtermFlag() as sigterm:
            for step in range(start, n_steps):
                try:
                    m = learner.step(step)
                except TrainingError as e:
                    if main:
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
                done = step + 1
                if (done % cfg.run.checkpoint_every_steps == 0 or done == n_steps
                        or sigterm.received):
                    path, _ = save_training_checkpoint(out, done, learner, mcfg, tok_json, cfg)
                if sigterm.received and done < n_steps:
                    preempted = {"preempted_at_step": done, "checkpoint": str(path),
                                 "resume": f"looprl train CONFIG resume={out}"}
                    if main:
                        (out / "preempted.json").write_text(json.dumps(preempted, indent=2)
                                                            + "\n")
                    break
    finally:
        if bar is not None:
            bar.close()
        if writer is not None:
            writer.close()

    if preempted is not None:
        say(f"SIGTERM: stopped after GRPO step {preempted['preempted_at_step']}, checkpoint "
            f"{preempted['checkpoint']}; continue with resume={out}")
        return preempted
    if main:
        (out / "preempted.json").unlink(missing_ok=True)
    if n_steps == start == 0 and cfg.run.stop_after == 0:  # warm start only, resumable
        save_training_checkpoint(out, 0, learner, mcfg, tok_json, cfg)
    from looprl.distributed.mesh import to_host
    params = jax.tree.map(to_host, learner.params)
    # no GRPO step: the parameters are the warm-started ones, whose evaluation is `before`
    after = before if n_steps == 0 else evaluate(mcfg, params, warm_task, tokenizer, cfg,
                                                 eval_set)
    say(f"eval after GRPO: {after}")
    save_model_checkpoint(out / "checkpoint", params, mcfg, tok_json,
                          extra_meta={"stage": "grpo", "grpo_steps": n_steps}, overwrite=True)
    summary = {"eval_accuracy_before": before["accuracy"],
               "eval_accuracy_after": after["accuracy"],
               "eval_problems": len(eval_set), "grpo_steps": n_steps,
               "resumed_from_step": None if resume_at is None else start,
               "complete": n_steps == cfg.run.grpo_steps, "stop_after": cfg.run.stop_after,
               "params_sha256": params_sha256(params),
               "wall_s": time.time() - t_start,
               "eval_before": before, "eval_after": after, "eval_before_q1": before_q1,
               "exit_threshold": cfg.rollout.exit_threshold,
               "warm_start_steps": report.get("stage1_steps"),
               "warm_start_plateaued": report.get("plateaued"),
               "seed": cfg.run.seed}
    if main:
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _truncate_jsonl(path: Path, step: int, *, inclusive: bool) -> None:
    """Keep the rows of a JSON-lines file whose "step" is < `step` (<= with `inclusive`)."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            row_step = json.loads(line)["step"]
        except (json.JSONDecodeError, KeyError, TypeError):
            continue  # a row cut short by a kill or a full disk: its step is rerun anyway
        if row_step <= step if inclusive else row_step < step:
            keep.append(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(r + "\n" for r in keep))
    tmp.replace(path)


class _SigtermFlag:
    """Context manager: while active (main thread only), SIGTERM sets `received` instead of
    killing the process, so the GRPO loop can finish its step and checkpoint; the previous
    handler is restored on exit."""

    def __enter__(self):
        self.received = None
        self._prev = None
        if threading.current_thread() is threading.main_thread():
            self._prev = signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum, frame):
        self.received = signum

    def __exit__(self, *exc):
        if self._prev is not None:
            signal.signal(signal.SIGTERM, self._prev)
        return False


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
    runs every variant (`train_variants`). CONFIG may also be a run directory's `config.json`.
    With `resume=` and no `out_dir=`, out_dir is the resumed directory. With `--coordinator` /
    `--distributed` (or the LOOPRL_* environment) the process first joins the others
    (`looprl.distributed.multihost`). Returns the exit status: 0, or 143 (128 + SIGTERM) when
    SIGTERM stopped the run after a checkpoint."""
    from looprl.distributed.multihost import init_distributed, is_main_process
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
        print(json.dumps({n: {k: v[k] for k in _HEADLINE}
                          for n, v in result["variants"].items()}))
        return 0
    summary = train(cfg, t_start=getattr(args, "t_start", None))
    if "preempted_at_step" in summary:
        if is_main_process():
            print(json.dumps(summary))
        return 128 + signal.SIGTERM
    if is_main_process():
        print(json.dumps({k: summary[k] for k in _HEADLINE}))
    return 0
