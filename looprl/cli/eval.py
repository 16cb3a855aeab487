"""`looprl eval`: pass@1 (or mean@N and pass@k) of a checkpoint on a task's held-out set, at one or
more exit thresholds.

Each setting comes from its flag, else from what the checkpoint records (a run's checkpoints
record the evaluated task with its config, the prompt style, the stop ids and the evaluation's
settings: `looprl.train.setup.checkpoint_task_meta`), else from `DEFAULTS`; so
`looprl eval --checkpoint RUN/checkpoint --out DIR` reproduces the run's `eval_accuracy_after`.
A checkpoint without that record (a converted model, an HF directory) needs `--task`.

The task comes from the registry (`looprl.tasks`); the first `--limit` problems of its held-out
set are decoded (greedy unless `--temperature` > 0; `--num-samples N` completions each) up to
`<|im_end|>` or `--max-new-tokens`; with N > 1 each q reports mean@N and the unbiased pass@k for
k = 1, 2, 4, ..., N (`looprl.rl.evaluation.pass_at_k`, arXiv 2107.03374). Per q (the Q-exit
rule, docs/DESIGN.md §1) the command prints one table row (`--json`: results.json's object
instead) and writes DIR/results.json, DIR/problems.jsonl and, with several q,
DIR/accuracy_vs_depth.png (`write_results`). Errors (CheckpointError, ConfigError, TaskError
naming `file:line`) are printed by `looprl.cli` as one line with exit status 2.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from looprl.determinism import environment
from looprl.errors import CheckpointError, ConfigError, SamplingError, create_dir
from looprl.io.checkpoint import META_FILE, read_checkpoint_meta
from looprl.io.hf import check_not_run_directory, hf_usage_settings
from looprl.rl.evaluation import evaluate_problems as generate_and_grade
from looprl.rl.evaluation import pass_at_k_summary
from looprl.sampling.resident import load_for_sampling
from looprl.sampling.sampler import SamplingConfig
from looprl.tasks import get_task, task_class, task_names
from looprl.tasks.grading import extract_answer
from looprl.tokenizer import tokenizer_from_json
from looprl.train.console import progress_bar


def parse_thresholds(text: str) -> list[float]:
    """`"0.5,0.9,1"` -> [0.5, 0.9, 1.0]. Raises ConfigError for a value that is not a float in
    (0, 1], an empty list or a repeated value."""
    out = []
    for part in text.split(","):
        part = part.strip()
        try:
            q = float(part)
        except ValueError:
            raise ConfigError(f"--exit-threshold: expected floats in (0, 1] separated by commas, "
                              f"found {part!r} in {text!r}") from None
        if not 0.0 < q <= 1.0:
            raise ConfigError(f"--exit-threshold: q must lie in (0, 1], found {q} in {text!r}")
        out.append(q)
    if not out:
        raise ConfigError(f"--exit-threshold: no threshold in {text!r}")
    if len(set(out)) != len(out):
        raise ConfigError(f"--exit-threshold: repeated threshold in {text!r}")
    return out


DEFAULTS = {"max_new_tokens": 512, "batch_size": 32, "kv_policy": "dense",
            "compute_dtype": "float32",
            # prompts are left-padded to a multiple of this, so most batches share one compiled
            # shape; greedy tokens and exit loops do not depend on it (fp32 log-probs may move in
            # the last bits: attention sums over a longer cache; tests/cli/test_eval_cli.py)
            "prompt_len_multiple": 64, "seed": 0}
DATA_FLAGS = {"data_dir": "--data-dir", "source": "--source"}  # a task's `data_options`


def recorded_meta(checkpoint: str) -> dict[str, Any]:
    """`looprl_meta.json` of a looprl checkpoint (read without loading the weights); for an HF
    directory the settings its `config.json` keeps (`hf_usage_settings`), else {}. Raises CheckpointError for a path that is no directory at all."""
    path = Path(checkpoint).expanduser()
    if not path.is_dir():
        raise CheckpointError(f"--checkpoint {checkpoint}: not a checkpoint directory (does "
                              f"not exist or is a file); pass a looprl checkpoint or an HF "
                              f"directory")
    if not (path / META_FILE).exists():
        return hf_usage_settings(path)  # what `looprl convert --to-hf` kept, or {}
    return read_checkpoint_meta(path)


def check_task_name(name: str) -> str:
    """`name` if the registry knows it. Raises ConfigError naming `--task` and the choices."""
    if name not in task_names():
        raise ConfigError(f"--task: expected one of {task_names()}, found {name!r}")
    return name


def _data_kwargs(args, name: str, task_kwargs: dict[str, Any]) -> None:
    """Set the task's data options (`Task.data_options`) from --data-dir / --source, else the
    recorded config, else the task's defaults. Raises ConfigError for a data flag the task
    does not take."""
    options = task_class(name).data_options
    for key, flag in DATA_FLAGS.items():
        given = getattr(args, key)
        if key in options:
            task_kwargs[key] = given or task_kwargs.get(key) or options[key]
        elif given is not None:
            readers = [n for n in task_names() if key in task_class(n).data_options]
            raise ConfigError(f"{flag}: only the {' and '.join(readers)} "
                              f"task{'s read' if len(readers) > 1 else ' reads'} {key}, "
                              f"found --task {name}")


def resolve_settings(args, meta: dict[str, Any]) -> dict[str, Any]:
    """The evaluation's task name, task kwargs and settings: each flag given wins, else the
    value the checkpoint records (`meta["task"]`, `meta["eval"]`; the task's config and the
    evaluation settings only when the task is the recorded one), else `DEFAULTS`. Raises
    ConfigError for no task at all, an unknown task, or a data flag the task does not take."""
    rec_task = meta.get("task") or {}
    name = args.task or rec_task.get("name")
    if name is None:
        raise ConfigError(f"--task: {args.checkpoint} records no task (not a run's checkpoint, "
                          f"or one from an older looprl); pass --task, one of {task_names()}")
    check_task_name(name)
    same = rec_task.get("name") == name
    task_kwargs = dict(rec_task.get("config") or {}) if same else {}
    if meta.get("stage") and not same:
        print(f"looprl eval: warning: {args.checkpoint} records no {name!r} task config; using "
              f"the task's defaults", file=sys.stderr, flush=True)
    _data_kwargs(args, name, task_kwargs)
    if args.prompt_style:
        task_kwargs["prompt_style"] = args.prompt_style
    rec_eval = dict(meta.get("eval") or {}) if same else {}
    settings = {k: getattr(args, k) if getattr(args, k) is not None else rec_eval.get(k, v)
                for k, v in DEFAULTS.items()}
    settings["exit_threshold"] = (args.exit_threshold if args.exit_threshold is not None
                                  else f"{rec_eval.get('exit_threshold', 1.0)!r}")
    settings["limit"] = args.limit if args.limit is not None else rec_eval.get("problems")
    for k in ("fixed_depth", "deferred_max_pending"):
        settings[k] = rec_eval.get(k)
    settings["kernels"] = rec_eval.get("kernels", "invariant")
    settings["stop_ids"] = meta.get("stop_ids")
    return {"task": name, "task_kwargs": task_kwargs, **settings}


def _check_args(args) -> None:
    for flag, value in (("--limit", args.limit), ("--batch-size", args.batch_size),
                        ("--max-new-tokens", args.max_new_tokens),
                        ("--prompt-len-multiple", args.prompt_len_multiple)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag}: expected a positive int, found {value}")
    if args.temperature < 0:
        raise ConfigError(f"--temperature: expected >= 0 (0 = greedy), found {args.temperature}")
    if args.num_samples < 1:
        raise ConfigError(f"--num-samples: expected a positive int, found {args.num_samples}")
    if args.num_samples > 1 and args.temperature == 0:
        raise ConfigError(f"--num-samples {args.num_samples}: greedy decoding gives one completion "
                          f"{args.num_samples} times; set --temperature > 0")
    if args.task is not None:
        check_task_name(args.task)
    if args.exit_threshold is not None:
        parse_thresholds(args.exit_threshold)
    if not Path(args.checkpoint).expanduser().exists():
        raise CheckpointError(f"{args.checkpoint}: no such checkpoint directory")
    check_not_run_directory(Path(args.checkpoint).expanduser())  # RUN given for RUN/checkpoint
    out = Path(args.out).expanduser()
    for d in (out, *out.parents):  # the directory, or the first of its parents that exists
        if d.exists():
            if not d.is_dir():
                raise ConfigError(f"--out: {str(d)!r} is a file, not a directory (--out "
                                  f"{str(args.out)!r}); choose a directory")
            break
    if (out / "results.json").exists():
        raise ConfigError(f"--out: {str(out)!r} already holds results.json; choose a new directory")


def _load(checkpoint: str, dtype: str):
    """(params, OuroConfig, TextTokenizer, fp32 master fingerprint) of a looprl checkpoint or HF
    directory, the weights on the device in the compute `dtype` (`load_for_sampling`)."""
    path = Path(checkpoint).expanduser()
    if not path.exists():
        raise CheckpointError(f"{checkpoint}: no such checkpoint directory")
    # on the device once, for every batch; orbax wants absolute paths
    params, cfg, tok_json, _, fingerprint = load_for_sampling(str(path.resolve()), dtype)
    if tok_json is None:
        raise CheckpointError(f"{checkpoint}: the checkpoint has no tokenizer.json (convert it "
                              f"with `looprl convert --hf DIR --out CKPT --tokenizer FILE`)")
    tok = tokenizer_from_json(tok_json)
    if tok.vocab_size > cfg.vocab_size:
        raise CheckpointError(f"{checkpoint}: tokenizer.json has {tok.vocab_size} ids, the model's "
                              f"vocabulary only {cfg.vocab_size}")
    return params, cfg, tok, fingerprint


def evaluate_problems(model_cfg, params, task, tokenizer, problems, scfg, *, batch_size: int,
                      seed: int = 0, progress=None, master_fingerprint: str | None = None,
                      num_samples: int = 1) -> list[dict[str, Any]]:
    """`looprl.rl.evaluation.evaluate_problems` (`num_samples` completions per problem, graded;
    problem i's sample s is row i * num_samples + s), each row with `extracted`, the final answer
    `looprl.tasks.grading.extract_answer` finds (or None), after its completion; the task's raw
    reward is left out (`correct` says it)."""
    return [{"completion": r["completion"], "extracted": extract_answer(r["completion"]),
             **{k: r[k] for k in ("correct", "tokens", "truncated", "exit_loops",
                                  "kv_cache_bytes")}}
            for r in generate_and_grade(model_cfg, params, task, tokenizer, problems, scfg,
                                        batch_size=batch_size, seed=seed, progress=progress,
                                        master_fingerprint=master_fingerprint,
                                        num_samples=num_samples)]


def summarize(q: float, rows: list[dict[str, Any]], wall_s: float,
              num_samples: int = 1) -> dict[str, Any]:
    """One threshold's summary over `rows` (`num_samples` consecutive rows per problem):
    pass_at_1 (the fraction of correct completions: mean@N, which is the unbiased pass@1),
    correct (completions), problems, num_samples, pass_at_k (`pass_at_k_summary`: mean@N,
    pass@1, 2, 4, ..., N), the token-weighted mean exit loop, token counts, and the largest
    batch's KV cache bytes."""
    exits = [k for r in rows for k in r["exit_loops"]]
    correct = sum(r["correct"] for r in rows)
    n = num_samples
    per_problem = [sum(r["correct"] for r in rows[i:i + n]) for i in range(0, len(rows), n)]
    return {"exit_threshold": q, "pass_at_1": correct / len(rows), "correct": correct,
            "problems": len(per_problem), "num_samples": n,
            "pass_at_k": pass_at_k_summary(per_problem, n),
            "mean_exit_loop": float(np.mean(exits)) if exits else 0.0,
            "tokens": len(exits), "truncated": sum(r["truncated"] for r in rows),
            "wall_s": wall_s, "kv_cache_bytes": max(r["kv_cache_bytes"] for r in rows)}


def plot_accuracy_vs_depth(summaries: list[dict[str, Any]], total_loops: int, path: Path) -> Path:
    """Write pass@1 against mean exit loop (one labelled point per q) to `path` (PNG)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = sorted(summaries, key=lambda s: s["mean_exit_loop"])
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([s["mean_exit_loop"] for s in pts], [s["pass_at_1"] for s in pts], marker="o")
    for s in pts:
        ax.annotate(f"q={s['exit_threshold']:g}", (s["mean_exit_loop"], s["pass_at_1"]),
                    textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel(f"mean exit loop (of T = {total_loops})")
    ax.set_ylabel("pass@1")
    ax.set_xlim(0.9, total_loops + 0.1)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _print_table(summaries, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    extra = [k for k in summaries[0]["pass_at_k"] if k != "pass@1"]  # mean@N, pass@2, ...
    extra = extra if summaries[0]["num_samples"] > 1 else []
    for col in ("q", "pass@1", *extra, "correct", "mean exit loop", "tokens", "truncated",
                "wall s"):
        table.add_column(col, justify="right")
    for s in summaries:
        table.add_row(f"{s['exit_threshold']:g}", f"{s['pass_at_1']:.4f}",
                      *(f"{s['pass_at_k'][k]:.4f}" for k in extra),
                      f"{s['correct']}/{s['problems'] * s['num_samples']}",
                      f"{s['mean_exit_loop']:.3f}", str(s["tokens"]), str(s["truncated"]),
                      f"{s['wall_s']:.1f}")
    Console(width=120).print(table)


def write_results(out: Path, args, st: dict[str, Any], task, total_loops: int, problems,
                  per_q: dict[float, list[dict[str, Any]]], summaries: list[dict[str, Any]]
                  ) -> dict[str, Any]:
    """Write the evaluation's files into `out` and return results.json's object:

      results.json          {"checkpoint", "task", "settings" (with "data_dir": the absolute data
                            directory read, None for none; "task_config" keeps --data-dir as
                            typed), "thresholds" (`summarize` per q), "env"}
      problems.jsonl        one object per problem: id, question, gold, and "by_threshold" (key:
                            q as text): completion, extracted, correct, tokens, truncated,
                            mean_exit_loop; with --num-samples N > 1: {"num_correct", "samples":
                            N such objects}
      accuracy_vs_depth.png pass@1 against mean exit loop, one point per q (with several q)
    """
    with (out / "problems.jsonl").open("w") as f:
        for i, p in enumerate(problems):
            by_q = {}
            n = args.num_samples
            for q, rows in per_q.items():
                samples = [{"completion": r["completion"], "extracted": r["extracted"],
                            "correct": r["correct"], "tokens": r["tokens"],
                            "truncated": r["truncated"],
                            "mean_exit_loop": (float(np.mean(r["exit_loops"]))
                                               if r["exit_loops"] else 0.0)}
                           for r in rows[i * n:(i + 1) * n]]
                by_q[f"{q:g}"] = samples[0] if n == 1 else {
                    "num_correct": sum(s["correct"] for s in samples), "samples": samples}
            f.write(json.dumps({"id": p.id, "question": p.prompt, "gold": p.answer,
                                "by_threshold": by_q}) + "\n")
    settings = {"limit": st["limit"], "problems": len(problems), "kv_policy": st["kv_policy"],
                "compute_dtype": st["compute_dtype"], "max_new_tokens": st["max_new_tokens"],
                "batch_size": st["batch_size"], "temperature": args.temperature,
                "num_samples": args.num_samples,
                "prompt_len_multiple": st["prompt_len_multiple"],
                "seed": st["seed"], "total_ut_steps": total_loops,
                "data_dir": (None if getattr(task, "resolved_dir", None) is None
                             else str(task.resolved_dir)),
                "task_config": task.config()}
    results = {"checkpoint": str(args.checkpoint), "task": st["task"], "settings": settings,
               "thresholds": summaries, "env": environment()}
    (out / "results.json").write_text(json.dumps(results, indent=2, allow_nan=False) + "\n")
    if len(summaries) > 1:
        plot_accuracy_vs_depth(summaries, total_loops, out / "accuracy_vs_depth.png")
    return results


def check_prompt_lengths(task, tok, problems, max_new_tokens: int, cfg, checkpoint) -> None:
    """Raise SamplingError when the longest prompt's tokens plus `max_new_tokens` exceed the
    model's positions (`max_position_embeddings`), naming the problem, as `looprl generate`
    checks its prompt."""
    n, problem = max((len(tok.encode(task.format_prompt(p))), p.id) for p in problems)
    if n + max_new_tokens > cfg.max_position_embeddings:
        raise SamplingError(f"problem {problem}'s prompt has {n} tokens and --max-new-tokens is "
                            f"{max_new_tokens}: {n + max_new_tokens} positions, more than the "
                            f"{cfg.max_position_embeddings} of {checkpoint}'s model "
                            f"(max_position_embeddings); pass --max-new-tokens "
                            f"{max(cfg.max_position_embeddings - n, 1)} or less")


def run(args) -> int:
    """CLI entry (`looprl eval`); see the module docstring."""
    _check_args(args)
    st = resolve_settings(args, recorded_meta(args.checkpoint))
    thresholds = parse_thresholds(st["exit_threshold"])
    task = get_task(st["task"], **st["task_kwargs"])
    held_out = task.eval_problems()
    problems = held_out[:st["limit"]] if st["limit"] else held_out
    params, cfg, tok, fingerprint = _load(args.checkpoint, st["compute_dtype"])
    check_prompt_lengths(task, tok, problems, st["max_new_tokens"], cfg, args.checkpoint)
    out = Path(args.out).expanduser()
    create_dir(out, "--out")

    per_q: dict[float, list[dict[str, Any]]] = {}
    summaries = []
    for q in thresholds:
        scfg = SamplingConfig(max_new_tokens=st["max_new_tokens"], temperature=args.temperature,
                              exit_threshold=q, fixed_depth=st["fixed_depth"],
                              kv_policy=st["kv_policy"],
                              deferred_max_pending=st["deferred_max_pending"],
                              compute_dtype=st["compute_dtype"],
                              stop_ids=tuple(st["stop_ids"] or (tok.end_of_turn_id,)),
                              prompt_len_multiple=st["prompt_len_multiple"],
                              kernels=st["kernels"])
        bar = progress_bar(True, len(problems), f"eval q={q:g}", "problem", leave=True)
        t0 = time.time()
        try:
            rows = evaluate_problems(cfg, params, task, tok, problems, scfg,
                                     batch_size=st["batch_size"], seed=st["seed"],
                                     progress=args.ctrl_c.tick(bar),
                                     master_fingerprint=fingerprint,
                                     num_samples=args.num_samples)
        finally:
            bar.close()
        per_q[q] = rows
        summaries.append(summarize(q, rows, time.time() - t0, args.num_samples))

    results = write_results(out, args, st, task, cfg.total_ut_steps, problems, per_q, summaries)
    if args.json:
        print(json.dumps(results, allow_nan=False))
        return 0
    samples = f", {args.num_samples} samples each" if args.num_samples > 1 else ""
    _print_table(summaries, f"{st['task']}: {len(problems)} held-out problems{samples}, "
                            f"{args.checkpoint}")
    print(f"wrote {out / 'results.json'} and {out / 'problems.jsonl'}")
    return 0
