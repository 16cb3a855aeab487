"""`looprl train CONFIG [key=value ...]`: warm start, evaluation, GRPO, evaluation
(docs/DESIGN.md §6).

The run directory (`run.out_dir`): config.json, warm_start_curve.json, warm_start/ (or
reference.json naming a given checkpoint), eval_before.json, metrics.jsonl, tb/, checkpoints/,
checkpoint/, summary.json, and failure.json / preempted.json when a step failed or a signal
stopped the run (each file described in docs/GUIDE.md, "What a run leaves").

A fresh run into a non-empty out_dir is a ConfigError. `resume=RUN_DIR` continues from the
newest complete training checkpoint with the same bits as an uninterrupted run (a finished run
is left unchanged); the printed resume command is `looprl train RUN_DIR/config.json
resume=RUN_DIR`. `stop_after=k` stops after GRPO step k with a checkpoint. SIGTERM and a first
Ctrl-C finish the current step and checkpoint (exit 143 / 130); a second Ctrl-C aborts. A run
stopped before its first training checkpoint resumes by running its start again.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from looprl.config import ExperimentConfig, load_json, save_json
from looprl.determinism import environment
from looprl.distributed.mesh import to_host
from looprl.distributed.multihost import is_main_process, sync
from looprl.errors import CheckpointError, ConfigError, LooprlError, TrainingError
from looprl.io.checkpoint import load_model_checkpoint, params_sha256, save_model_checkpoint
from looprl.io.hf import check_not_run_directory
from looprl.kernels import kernel_version
from looprl.model.config import from_model_section, shape_note
from looprl.model.looped import init_params
from looprl.rl.evaluation import evaluate
from looprl.rl.learner import GRPOLearner
from looprl.train.resume import (REFERENCE_FILE, without_run_control, check_resume_config,
                                 finished_summary, prepare_out_dir, resume_command,
                                 checkpoint_candidates, load_reference, load_resume_point,
                                 restore_training_checkpoint, resume_candidates,
                                 save_training_checkpoint)
from looprl.train.console import (evaluate_and_say, progress_bar, replay_exact_steps, replay_record,
                                  steps_with_zero_grad, warm_start_bar_cut, warm_start_logger,
                                  warn_inexact, warn_no_learning)
from looprl.train.interrupts import CtrlC, DeferredSignals
from looprl.train.setup import build_tasks, checkpoint_task_meta, run_tokenizer
from looprl.train.warm_start import warm_start

EVAL_BEFORE_FILE = "eval_before.json"


def _eval_params(learner: GRPOLearner):
    """The parameters evaluation samples with: the learner's own device arrays on one device
    (a host round trip would copy the tree twice), whole host arrays on a mesh (evaluation
    runs the one-device program)."""
    return learner.params if learner.mesh is None else jax.tree.map(to_host, learner.params)


@dataclasses.dataclass
class _Start:
    """What GRPO starts from: the reference policy, its tokenizer, the warm-start report and
    the evaluation before GRPO."""
    params: Any
    model_cfg: Any
    tokenizer: Any
    warm_start_report: dict[str, Any]
    before: dict[str, Any]
    before_q1: dict[str, Any] | None
    params_sha256: str  # of `params`: a run whose final parameters have it learned nothing


def _fresh_start(exp_cfg: ExperimentConfig, out: Path, warm_task, eval_set, main: bool,
                 say, ckpt_meta: dict[str, Any], bars: bool, ctrl_c: CtrlC) -> _Start:
    """A new run: load or initialise the model, warm-start it, record the reference policy
    (`warm_start/` or `reference.json`) and evaluate it before GRPO. A Ctrl-C is checked
    after every warm-start step and evaluation batch (`ctrl_c`)."""
    ckpt_tokenizer = None
    if exp_cfg.model.checkpoint:
        check_not_run_directory(exp_cfg.model.checkpoint)
        params, model_cfg, ckpt_tokenizer, _ = load_model_checkpoint(
            Path(exp_cfg.model.checkpoint).resolve())
        say(f"loaded {exp_cfg.model.checkpoint}")
        note = shape_note(exp_cfg.model, model_cfg)
        if note and main:
            print(f"looprl train: {note}", file=sys.stderr, flush=True)
    else:
        model_cfg = from_model_section(exp_cfg.model)
        params = init_params(model_cfg, exp_cfg.run.seed)
    tokenizer = run_tokenizer(warm_task, ckpt_tokenizer, exp_cfg.model.checkpoint)
    if model_cfg.vocab_size < tokenizer.vocab_size:
        raise ConfigError(f"model vocab {model_cfg.vocab_size} < tokenizer vocab "
                          f"{tokenizer.vocab_size}")

    ws = exp_cfg.warm_start
    report: dict[str, Any] = {"enabled": ws.enabled}
    if ws.enabled:
        plateau_set = eval_set[:ws.eval_problems]

        def eval_fn(p):
            return evaluate(model_cfg, p, warm_task, tokenizer, exp_cfg, plateau_set)["accuracy"]

        bar = progress_bar(bars, ws.max_steps + ws.gate_steps, "warm start", "step")
        params, report = warm_start(
            model_cfg, params, warm_task, tokenizer, steps=ws.max_steps, batch_size=ws.batch_size,
            learning_rate=ws.learning_rate, seed=exp_cfg.run.seed, gate_steps=ws.gate_steps,
            gate_learning_rate=ws.gate_learning_rate, entropy_beta=ws.entropy_beta,
            eval_fn=eval_fn, eval_every=ws.eval_every_steps, log=warm_start_logger(bar, say),
            plateau_last_fraction=ws.plateau_last_fraction,
            plateau_min_gain=ws.plateau_min_gain, plateau_min_evals=ws.plateau_min_evals,
            progress=ctrl_c.tick(bar), stage1_done=warm_start_bar_cut(bar, ws.gate_steps))
        if bar is not None:
            bar.close()
        say(f"warm start: {report.get('stage1_steps')} stage-I steps (loss "
            f"{report.get('stage1_final_loss', float('nan')):.3f}), {report.get('stage2_steps')} "
            f"gate steps{', plateaued' if report.get('plateaued') else ''}")
    if main:
        (out / "warm_start_curve.json").write_text(json.dumps(report, indent=2) + "\n")
    params = jax.tree.map(np.asarray, params)
    ref_sha = params_sha256(params)
    if ws.enabled or not exp_cfg.model.checkpoint:
        save_model_checkpoint(out / "warm_start", params, model_cfg, tokenizer.to_json(),
                              extra_meta={"stage": "warm_start", "params_sha256": ref_sha,
                                          **ckpt_meta})
    elif main:  # the reference policy is the given checkpoint: point at it, do not copy GBs
        (out / REFERENCE_FILE).write_text(json.dumps(
            {"checkpoint": str(Path(exp_cfg.model.checkpoint).resolve()),
             "params_sha256": ref_sha}, indent=2) + "\n")

    ctrl_c.check()
    before = evaluate_and_say("eval before GRPO", bars, say, model_cfg, params, warm_task,
                              tokenizer, exp_cfg, eval_set, ctrl_c=ctrl_c)
    before_q1 = None
    if exp_cfg.rollout.exit_threshold < 1.0:
        before_q1 = evaluate_and_say("eval before GRPO at q=1.0", bars, say, model_cfg, params,
                                     warm_task, tokenizer, exp_cfg, eval_set, exit_threshold=1.0,
                                     ctrl_c=ctrl_c)
    if main:
        (out / EVAL_BEFORE_FILE).write_text(json.dumps(
            {"eval_before": before, "eval_before_q1": before_q1}, indent=2) + "\n")
    return _Start(params, model_cfg, tokenizer, report, before, before_q1, ref_sha)


def _resumed_start(out: Path, warm_task) -> _Start:
    """A resumed run: the reference params, warm-start report and first evaluation are on
    disk."""
    params, model_cfg, ckpt_tokenizer, ref_dir, ref_sha = load_reference(out)
    tokenizer = run_tokenizer(warm_task, ckpt_tokenizer, str(ref_dir))
    report = json.loads((out / "warm_start_curve.json").read_text())
    saved_eval = json.loads((out / EVAL_BEFORE_FILE).read_text())
    return _Start(params, model_cfg, tokenizer, report, saved_eval["eval_before"],
                  saved_eval["eval_before_q1"], ref_sha)


def _restore(learner, resume_from: list[tuple[int, Path]], out: Path, say):
    """(next GRPO step, (step, checkpoint) resumed from or None): the newest training checkpoint
    that restores; damaged data falls back to an older one. Raises CheckpointError when every
    one is damaged."""
    for step_k, ckpt in resume_from:  # newest first
        try:
            start = restore_training_checkpoint(ckpt, learner)
        except CheckpointError as e:
            say(f"skipping {ckpt.name}: {e}")
            continue
        say(f"resumed from {ckpt} (GRPO step {start})")
        return start, (step_k, ckpt)
    if resume_from:
        raise CheckpointError(f"{out}: every training checkpoint under checkpoints/ is damaged "
                              f"({', '.join(c.name for _, c in resume_from)}); see the messages "
                              f"above")
    return 0, None


def _grpo_loop(exp_cfg: ExperimentConfig, out: Path, learner, model_cfg, tok_json: str, start: int,
               n_steps: int, resumed: bool, main: bool, quiet: bool,
               ckpt_meta: dict[str, Any], ctrl_c: CtrlC, eval_fn=None) -> dict[str, Any] | None:
    """GRPO steps `start..n_steps-1`: metrics rows, TensorBoard, progress bar, checkpoints.
    With `eval.eval_every_steps` = k > 0, a step whose count of done steps is a multiple of k
    also carries `eval_accuracy` (held-out, greedy: `eval_fn(params)`). After step 0,
    `mismatch_step0.npy` holds that step's per-token |learner - sampler| log-prob differences
    (fp32 nats, the emitting tokens in row order). Returns the preemption record when SIGTERM
    or a first Ctrl-C stopped the loop (after the step it arrived in, the last one included),
    else None. A Ctrl-C dropped before the loop's own handler took
    over (`ctrl_c.pending`) raises KeyboardInterrupt before the first step."""
    metrics_path = out / "metrics.jsonl" if main else Path(os.devnull)
    if resumed and main:  # drop rows of steps after the checkpoint (rerun)
        _truncate_jsonl(metrics_path, start, inclusive=False)
        _truncate_jsonl(out / "checkpoints" / "index.jsonl", start, inclusive=True)
    writer = None
    if exp_cfg.run.tensorboard and main:
        from tensorboardX import SummaryWriter
        writer = SummaryWriter(str(out / "tb"), purge_step=start if start else None)
    bar = progress_bar(exp_cfg.run.progress_bar and not quiet and main, n_steps, "GRPO", "step",
                       initial=start, leave=True)
    preempted = None
    try:
        with metrics_path.open("a" if resumed else "w") as f, DeferredSignals() as sigterm:
            ctrl_c.check()  # from here on SIGINT goes to `sigterm`
            for step in range(start, n_steps):
                try:
                    m = learner.step(step)
                except TrainingError as e:
                    if main:
                        (out / "failure.json").write_text(json.dumps(
                            {"step": step, "error": str(e)}, indent=2) + "\n")
                    raise
                every = exp_cfg.eval.eval_every_steps
                if eval_fn is not None and every and (step + 1) % every == 0:
                    m["eval_accuracy"] = eval_fn(_eval_params(learner))
                if step == 0 and main and learner.last_token_abs_delta is not None:
                    np.save(out / "mismatch_step0.npy", learner.last_token_abs_delta)
                f.write(json.dumps(m) + "\n")
                f.flush()
                exact = m["replay_exact_fraction"]  # None on steps without a replay check
                if main and exact is not None and exact < 1.0:
                    warn_inexact(m, bar)
                if writer is not None:
                    for k, v in m.items():
                        if k != "step" and isinstance(v, (int, float)) and np.isfinite(v):
                            writer.add_scalar(k, v, step)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(reward=f"{m['reward_mean']:.3f}",
                                    exact="-" if exact is None else f"{exact:.2f}",
                                    exit=f"{m['mean_exit_loop']:.2f}")
                done = step + 1
                if (done % exp_cfg.run.checkpoint_every_steps == 0 or done == n_steps
                        or sigterm.received):
                    path, _ = save_training_checkpoint(out, done, learner, model_cfg, tok_json,
                                                       exp_cfg, extra_meta=ckpt_meta)
                if sigterm.received:  # also after the last step: the run stops here
                    preempted = {"preempted_at_step": done, "checkpoint": str(path),
                                 "signal": signal.Signals(sigterm.received).name,
                                 "exit_status": 128 + sigterm.received,
                                 "resume": resume_command(out)}
                    if main:
                        (out / "preempted.json").write_text(json.dumps(preempted, indent=2)
                                                            + "\n")
                    break
    finally:
        if bar is not None:
            bar.close()
        if writer is not None:
            writer.close()
    return preempted


def train(exp_cfg: ExperimentConfig, *, quiet: bool = False,
          t_start: float | None = None) -> dict[str, Any]:
    """Run the whole experiment; returns the summary dict (also written to summary.json).
    `t_start`: when the command started (`time.time()`), for `wall_s`; default now.
    Raises: KeyboardInterrupt on a Ctrl-C outside the GRPO steps (`looprl.train.interrupts`),
    ConfigError / CheckpointError / TrainingError as their messages say."""
    with CtrlC() as ctrl_c:
        summary = _train(exp_cfg, quiet, t_start, ctrl_c)
        ctrl_c.check()  # one dropped after the last check: stop here (the outputs are complete)
        return summary


def _train(exp_cfg: ExperimentConfig, quiet: bool, t_start: float | None,
           ctrl_c: CtrlC) -> dict[str, Any]:
    t_start = time.time() if t_start is None else t_start
    out = prepare_out_dir(exp_cfg)
    main = is_main_process()  # only process 0 writes logs, metrics and reports
    say = (lambda *a: None) if quiet or not main else (lambda *a: print(*a, flush=True))
    resume_from: list[tuple[int, Path]] = []  # complete training checkpoints, newest first
    if exp_cfg.run.resume is not None and not checkpoint_candidates(out):
        _restart_interrupted_start(out, exp_cfg, main, say)
    elif exp_cfg.run.resume is not None:
        resume_from = resume_candidates(out, say)
        exp_cfg = load_resume_point(resume_from[0][1], exp_cfg, say)
        run = exp_cfg.run
        n_end = run.grpo_steps if run.stop_after is None else min(run.grpo_steps, run.stop_after)
        finished = finished_summary(out, resume_from[0][0], n_end)
        if finished is not None:  # nothing to run: the record stays as it is
            if main:
                print(f"looprl train: {out} finished at GRPO step {n_end} (summary.json); "
                      f"nothing to run and nothing changed (a larger grpo_steps continues it)",
                      file=sys.stderr, flush=True)
            return {**finished, "already_finished": True}
    sync("looprl-out-dir")  # every process checked out_dir before process 0 writes into it
    if not resume_from and main:
        save_json(without_run_control(exp_cfg), out / "config.json")
    try:
        warm_task, rl_task = build_tasks(exp_cfg)
        eval_set = warm_task.eval_problems(exp_cfg.eval.eval_problems)
        ckpt_meta = checkpoint_task_meta(exp_cfg, warm_task, len(eval_set))
        begin = (_resumed_start(out, warm_task) if resume_from
                 else _fresh_start(exp_cfg, out, warm_task, eval_set, main, say, ckpt_meta,
                                   bars=exp_cfg.run.progress_bar and not quiet and main,
                                   ctrl_c=ctrl_c))
    except LooprlError:  # a failed start leaves out_dir as it found it: empty, re-runnable
        if not resume_from and main:
            _remove_start_outputs(out, ("config.json",) + _START_OUTPUTS)
        raise
    ctrl_c.check()
    model_cfg, tokenizer, before = begin.model_cfg, begin.tokenizer, begin.before
    ref_sha = begin.params_sha256

    learner = GRPOLearner(exp_cfg, model_cfg, begin.params, rl_task, tokenizer)
    begin.params = None  # the learner holds its own copy and the reference: free the host tree
    start, resume_at = _restore(learner, resume_from, out, say)
    run = exp_cfg.run
    n_steps = run.grpo_steps if run.stop_after is None else min(run.grpo_steps, run.stop_after)
    if n_steps < start:
        raise ConfigError(f"config keys 'run.grpo_steps'/'run.stop_after': the run resumes at "
                          f"GRPO step {start}, past the requested end {n_steps}")
    if resume_at is not None:
        if main:
            # only once the resumption is known to be valid
            save_json(without_run_control(exp_cfg), out / "config.json")
        if start == n_steps:
            say(f"nothing to run: the run is at GRPO step {start}, the requested end "
                f"(run.grpo_steps={run.grpo_steps}, run.stop_after={run.stop_after}); "
                f"pass stop_after=none or a larger grpo_steps to continue")
    tok_json = tokenizer.to_json()
    preempted = _grpo_loop(exp_cfg, out, learner, model_cfg, tok_json, start, n_steps,
                           resume_at is not None, main, quiet, ckpt_meta, ctrl_c,
                           eval_fn=lambda p: evaluate(model_cfg, p, warm_task, tokenizer, exp_cfg,
                                                      eval_set)["accuracy"])
    if preempted is not None:
        say(f"{preempted['signal']}: stopped after GRPO step {preempted['preempted_at_step']}, "
            f"checkpoint {preempted['checkpoint']}; continue with: {resume_command(out)}")
        return preempted
    if main:
        (out / "preempted.json").unlink(missing_ok=True)
    if n_steps == start == 0 and exp_cfg.run.stop_after == 0:  # warm start only, resumable
        save_training_checkpoint(out, 0, learner, model_cfg, tok_json, exp_cfg,
                                 extra_meta=ckpt_meta)
    params = jax.tree.map(to_host, learner.params)
    # no GRPO step: the parameters are the warm-started ones, whose evaluation is `before`
    after = before if n_steps == 0 else evaluate_and_say(
        "eval after GRPO", exp_cfg.run.progress_bar and not quiet and main, say, model_cfg,
        _eval_params(learner), warm_task, tokenizer, exp_cfg, eval_set, ctrl_c=ctrl_c)
    replay = replay_record(out / "metrics.jsonl") if main else {}
    if replay.get("inexact_replay_steps"):
        print(f"looprl train: warning: {replay['inexact_replay_steps']} of "
              f"{replay['replay_steps']} GRPO steps replayed inexactly (replay_exact_fraction "
              f"min {replay['replay_exact_fraction_min']:.4f}); see `looprl verify`",
              file=sys.stderr, flush=True)
    elif replay.get("replay_steps"):
        say(f"replay exact at all {replay['replay_steps']} GRPO steps")
    save_model_checkpoint(out / "checkpoint", params, model_cfg, tok_json,
                          extra_meta={"stage": "grpo", "grpo_steps": n_steps, **ckpt_meta},
                          overwrite=True)
    final_sha = params_sha256(params)
    zero_grad = steps_with_zero_grad(out / "metrics.jsonl", n_steps) if main else None
    if main and n_steps > 0:
        warn_no_learning(final_sha != ref_sha, zero_grad, n_steps)
    report = begin.warm_start_report
    summary = {"eval_accuracy_before": before["accuracy"],
               "eval_accuracy_after": after["accuracy"],
               "eval_problems": len(eval_set), "grpo_steps": n_steps,
               "resumed_from_step": None if resume_at is None else start,
               "complete": n_steps == exp_cfg.run.grpo_steps, "stop_after": exp_cfg.run.stop_after,
               "params_sha256": final_sha, "params_changed": final_sha != ref_sha,
               "steps_with_zero_grad": zero_grad,
               "replay_exact_steps": replay_exact_steps(out / "metrics.jsonl", n_steps)
               if main else None,
               "wall_s": time.time() - t_start,
               "eval_before": before, "eval_after": after, "eval_before_q1": begin.before_q1,
               "exit_threshold": exp_cfg.rollout.exit_threshold,
               "warm_start_steps": report.get("stage1_steps"),
               "warm_start_plateaued": report.get("plateaued"),
               "seed": exp_cfg.run.seed,
               "replay_exact_fraction_min": replay.get("replay_exact_fraction_min"),
               "inexact_replay_steps": replay.get("inexact_replay_steps"),
               "model_config": model_cfg.to_dict(), "num_params": model_cfg.num_params,
               "environment": {**environment(), "kernel_version": kernel_version()}}
    if not summary["complete"] and exp_cfg.run.stop_after is not None:  # the output's last line
        summary["stopped"] = (f"stopped after GRPO step {n_steps} of {exp_cfg.run.grpo_steps} "
                              f"(stop_after); continue with: {resume_command(out)}")
    if main:
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


# what a run writes before its first training checkpoint (removed when it is started again)
_START_OUTPUTS = ("warm_start", REFERENCE_FILE, "warm_start_curve.json", EVAL_BEFORE_FILE,
                  "metrics.jsonl", "tb", "checkpoints", "preempted.json", "failure.json")


def _restart_interrupted_start(out: Path, exp_cfg: ExperimentConfig, main: bool, say) -> None:
    """`resume=` of a run stopped before its first training checkpoint: check the config
    against the run's `config.json` (as a resume would), then remove the partial outputs so the
    start (warm start, evaluation before GRPO) runs again from its beginning. Raises
    ConfigError when the config differs in more than run-control keys."""
    if (out / "summary.json").exists():
        raise ConfigError(f"config key 'run.resume': {str(out)!r} finished (summary.json) "
                          f"without a GRPO training checkpoint (run.grpo_steps=0), so there is "
                          f"nothing to resume")
    check_resume_config(load_json(out / "config.json"), exp_cfg, str(out / "config.json"))
    say(f"resume: {out} stopped before its first training checkpoint; running its start (warm "
        f"start, evaluation before GRPO) again from the beginning")
    if main:
        _remove_start_outputs(out, _START_OUTPUTS)


def _remove_start_outputs(out: Path, names) -> None:
    for name in names:
        p = out / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()


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
