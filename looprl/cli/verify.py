"""`looprl verify`: run the reproducibility matrix (`looprl.verify.matrix`) or re-verify a saved
rollout, and write the report (`looprl.verify.report`)."""
from __future__ import annotations

import dataclasses
import math
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from looprl import determinism
from looprl.config import load_experiment
from looprl.errors import ConfigError, SamplingError, create_dir
from looprl.io.checkpoint import load_model_checkpoint
from looprl.io.params_npz import load_rollout_params, save_params_npz
from looprl.model.config import OuroConfig, from_model_section, preset
from looprl.model.looped import device_params, init_params
from looprl.sampling.schedule import RolloutBatch
from looprl.tasks.arithmetic import ArithmeticTask
from looprl.tokenizer import tokenizer_from_json
from looprl.train.warm_start import warm_start
from looprl.verify.device import carry as device_carry
from looprl.verify.device import run as device_run
from looprl.verify.matrix import VerifyOptions, run_matrix, task_prompts, verify_rollout
from looprl.verify.compare import compare_lines, read_report
from looprl.verify.report import report_environment, summarize, write_report


def verify_model_config(config: str | None, vocab_size: int) -> OuroConfig:
    """The model of the warm-started cells: `--config`'s model section
    (`from_model_section`, the function `looprl train` uses), else the `tiny` preset; the
    vocabulary sized to the task tokenizer."""
    if config:
        return from_model_section(load_experiment(config).model, vocab_size=vocab_size)
    return preset("tiny", vocab_size=vocab_size)


def _load_weights(args, opts: VerifyOptions, log):
    """(cfg, weight_sets, prompts, setup) from --checkpoint / --config / defaults."""
    setup: dict[str, Any] = {}
    task = ArithmeticTask(seed=0)
    tokenizer = task.tokenizer()
    if args.checkpoint:
        params, cfg, tok_json, meta = load_model_checkpoint(args.checkpoint)
        params = device_params(jax.tree.map(np.asarray, params))
        if tok_json:
            tokenizer = tokenizer_from_json(tok_json)
        setup.update(checkpoint=str(args.checkpoint), checkpoint_meta_keys=sorted(meta))
        weight_sets = {"random": init_params(cfg, opts.seed), "trained": params}
        setup["trained_weights"] = f"checkpoint {args.checkpoint}"
    else:
        cfg = verify_model_config(args.config, tokenizer.vocab_size)
        if args.config:
            setup["config"] = str(args.config)
        params0 = init_params(cfg, opts.seed)
        t0 = time.time()
        trained, ws = warm_start(cfg, params0, task, tokenizer, steps=opts.warm_start_steps,
                                 batch_size=opts.warm_start_batch_size,
                                 learning_rate=opts.warm_start_learning_rate, seed=opts.seed,
                                 gate_steps=opts.warm_start_gate_steps)
        log(f"  warm start: {time.time() - t0:.1f}s, stage-I loss {ws['stage1_final_loss']:.4f}")
        weight_sets = {"random": params0, "trained": trained}
        setup.update(trained_weights="looprl.train.warm_start (arithmetic chain_sum task)",
                     warm_start_stage1_steps=ws["stage1_steps"],
                     warm_start_stage1_final_loss=ws["stage1_final_loss"],
                     warm_start_stage2_steps=ws["stage2_steps"],
                     warm_start_stage2_final_loss=ws["stage2_final_loss"],
                     warm_start_batch_size=ws["batch_size"],
                     warm_start_learning_rate=ws["learning_rate"])
    prompts = task_prompts(task, tokenizer, max(opts.n_prompts, *opts.small_batches))
    setup.update(model={k: v for k, v in cfg.to_dict().items()}, num_params=cfg.num_params,
                 prompt_lengths=[len(p) for p in prompts], **dataclasses.asdict(opts))
    return cfg, weight_sets, prompts, setup


def is_cell_detail(msg: str) -> bool:
    """A line about one cell or one rollout step (indented by 4), shown only with `-v`; notes
    are always shown."""
    return msg.startswith("    ") and not msg.lstrip().startswith("note:")


def verdict_rows(cells: list[dict]) -> list[tuple[str, ...]]:
    """One row per (weights, dtype, KV policy): replay cells exact / all, stock negative
    controls mismatching / all, the largest stock |delta logprob|, and PASS/FAIL (every replay
    and stock cell `passed`: exact, resp. mismatching within 1e-4 in fp32, sizes met)."""
    groups: dict[tuple, list[dict]] = {}
    for c in cells:
        groups.setdefault((c["weights"], c["dtype"], c["kv_policy"]), []).append(c)
    rows = []
    for (weights, dtype, policy), cs in groups.items():
        replay = [c for c in cs if c["method"] == "replay"]
        stock = [c for c in cs if c["method"] == "stock"]
        exact = sum(c["exact_fraction"] == 1.0 for c in replay)
        mism = sum(c["exact_fraction"] < 1.0 for c in stock)
        worst = max((c["max_abs_diff"] for c in stock), default=0.0)
        ok = all(c.get("passed", True) is not False for c in replay + stock)
        rows.append((weights, dtype, policy, f"{exact}/{len(replay)}", f"{mism}/{len(stock)}",
                     f"{worst:.1e}", "PASS" if ok else "FAIL"))
    return rows


def check_finite_cells(cells: list[dict]) -> None:
    """Raise SamplingError naming the first cell and figure that is NaN or infinite (a model
    computing non-finite log-probs; the report would otherwise hold NaN, which is not JSON)."""
    for c in cells:
        for k, v in c.items():
            if isinstance(v, float) and not math.isfinite(v):
                raise SamplingError(f"cell {c.get('weights')}/{c.get('dtype')}/"
                                    f"{c.get('kv_policy')}/{c.get('batching')}/{c.get('params')}"
                                    f"/{c.get('method')}: {k} is {v} (non-finite log-probs)")


def print_verdict_table(cells: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="looprl verify: verdict per weights, dtype and KV policy")
    for col in ("weights", "dtype", "kv policy", "replay exact", "controls mismatching",
                "stock max |d logprob|", "verdict"):
        table.add_column(col)
    for row in verdict_rows(cells):
        table.add_row(*row)
    Console(file=sys.stderr, width=110).print(table)


def check_out_dir(out: Path) -> None:
    """Raises ConfigError when `out` is a file. A report already in `out` is replaced at the
    end (DESIGN.md §6: `looprl verify --quick --out DIR` needs no other flag), with a note on
    stderr now, so it is never replaced silently."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out: {str(out)!r} exists and is not a directory")
    if (out / "report.json").exists():
        print(f"looprl verify: note: {out / 'report.json'} exists and will be replaced when "
              f"this run finishes", file=sys.stderr)


def run_device(args) -> int:
    """`looprl verify --device OUT` (the check) or `--device --carry DIR` (what travels).
    Raises ConfigError for a missing OUT or DIR, or the check on a CPU without --dry-run."""
    if args.carry:
        return device_carry.build_and_print(Path(args.carry), args.python_version)
    if not args.device:
        raise ConfigError("looprl verify --device: name OUT, the folder for report.json "
                          "(or --carry DIR to build what travels to a device)")
    groups = tuple(g for g in args.groups.split(",") if g)
    return device_run.check(args.device, dry_run=args.dry_run, budget_scale=args.budget_scale,
                            groups=groups)


def run(args) -> int:
    """`looprl verify`: run the matrix (or re-verify `--rollout`), write the report, print the
    verdict line on stderr and stdout, return the exit status (0 only if every replay cell is
    exact and every negative control mismatches within 1e-4 in fp32, and every cell met its
    size requirements; when requirements are unmet the console and report.md say which).
    Raises ConfigError when `--out` is a file or `--config` is given with `--rollout`,
    ScheduleError for an unreadable rollout or one sampled with other parameters,
    CheckpointError for a bad `--checkpoint`."""
    determinism.configure_xla(pin_threads=True)  # one intra-op thread + looprl's required flags
    if getattr(args, "device", None) is not None:
        return run_device(args)
    compare = getattr(args, "compare", None) or []
    if len(compare) > 2 or (len(compare) == 2 and args.out):
        raise ConfigError("--compare takes NEW OLD (two report directories, no --out), or OLD "
                          "with --out NEW (verify, then compare)")
    if len(compare) == 2:
        return print_comparison(*compare)
    if not args.out:
        raise ConfigError("--out DIR is required (where the report goes), except with "
                          "--compare NEW OLD or --device OUT")
    if compare:
        read_report(compare[0], "--compare OLD")  # before the run, not after it

    t_start = time.time()
    env = report_environment()  # before the run writes into --out (a tracked report folder)
    out = Path(args.out)
    check_out_dir(out)
    if args.rollout and args.config:
        raise ConfigError("--config has no effect with --rollout (the rollout records its "
                          "schedule): pass --checkpoint CKPT, the parameters it was sampled with")
    make = VerifyOptions.quick if args.quick else VerifyOptions.full
    opts = make(replay_impl=args.replay_impl)
    notes: list[str] = []

    def log(msg):
        if is_cell_detail(msg) and not getattr(args, "verbose", False):
            return
        print(msg, file=sys.stderr, flush=True)

    if args.rollout:
        rb = RolloutBatch.load(args.rollout)
        create_dir(out, "--out")
        if args.checkpoint:
            params, cfg, _, _ = load_model_checkpoint(args.checkpoint)
            params = jax.tree.map(np.asarray, params)
        else:
            params, cfg = load_rollout_params(Path(args.rollout))
        params = device_params(params)  # on the device once, for every cell's calls
        cells = verify_rollout(cfg, params, rb, opts, weights="checkpoint", log=log, notes=notes)
        setup = {"rollout": str(args.rollout), "checkpoint": args.checkpoint,
                 "schedule": rb.schedule.to_dict(), "replay_impl": opts.replay_impl,
                 "min_tokens": opts.min_tokens,
                 "min_early_exit_fraction": opts.min_early_exit_fraction}
    else:
        cfg, weight_sets, prompts, setup = _load_weights(args, opts, log)
        rdir = create_dir(out / "rollouts", "--out")
        for name, p in weight_sets.items():
            save_params_npz(rdir / f"{name}_params.npz", p, cfg)
        cells = run_matrix(cfg, weight_sets, prompts, opts, log=log, rollout_dir=rdir,
                           notes=notes)
    check_finite_cells(cells)
    summary = summarize(cells)
    report = {"format_version": 1, "command": "looprl verify " + " ".join(sys.argv[2:])
              if sys.argv[1:2] == ["verify"] else "looprl verify",
              "env": env, "setup": setup, "summary": summary, "cells": cells,
              "negative_control": [c for c in cells if c["method"] == "stock"],
              "notes": notes, "wall_s": round(time.time() - t_start, 1)}
    write_report(out, report)
    print_verdict_table(cells)
    if not summary["requirements_met"]:
        log("looprl verify: FAIL: requirements not met: "
            + "; ".join(summary["requirements_unmet"])
            + " (cells of such a rollout fail whatever their bits; see report.md)")
    verdict = (f"looprl verify: {'PASS' if summary['passed'] else 'FAIL'} "
               f"({summary['replay_exact_cells']}/{summary['replay_cells']} replay cells exact, "
               f"{summary['negative_control_mismatching']}/{summary['negative_control_cells']} "
               f"negative controls mismatching) in {report['wall_s']}s -> "
               f"{out / 'report.json'}")
    log(verdict)
    print(verdict, flush=True)  # stdout too: the verdict of a run whose stderr is a log file
    if compare:
        return print_comparison(out, compare[0]) or (0 if summary["passed"] else 1)
    return 0 if summary["passed"] else 1


def print_comparison(new, old) -> int:
    """`--compare`: print `same cells, same bits` or the first difference; 0 when the same."""
    same, lines = compare_lines(new, old)
    print("\n".join(lines), flush=True)
    return 0 if same else 1
