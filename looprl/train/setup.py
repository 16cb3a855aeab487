"""What a run is set up from: the tasks an experiment config names and the run's tokenizer.

The model config an experiment describes is `looprl.model.config.from_model_section`.
"""
from __future__ import annotations

from typing import Any

from looprl.config import ExperimentConfig
from looprl.errors import CheckpointError, ConfigError
from looprl.rl.rollout import sampling_config
from looprl.tasks import get_task
from looprl.tokenizer import tokenizer_from_json


def build_tasks(exp_cfg: ExperimentConfig):
    """(warm-start task, GRPO task) sharing one held-out set (same seed and eval knobs).

    `task.name` `arithmetic` (tiny models; its own character tokenizer) or `gsm8k` (real Ouro
    models: one task for both roles, the tokenizer from `model.checkpoint`, no warm start).
    Raises ConfigError for an unknown task, a GSM8K run without `model.checkpoint` or with
    `warm_start.enabled`, or bad task knobs.
    """
    t = exp_cfg.task
    if t.name == "gsm8k":
        if not exp_cfg.model.checkpoint:
            raise ConfigError("config key 'model.checkpoint': task 'gsm8k' has no tokenizer of its "
                              "own, so it needs a converted Ouro checkpoint (looprl convert --hf "
                              "DIR --out CKPT), e.g. model.checkpoint=/path/to/ouro-1.4b-looprl")
        if exp_cfg.warm_start.enabled:
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
    tokenizer = task.tokenizer()
    if tokenizer is not None:
        return tokenizer
    if checkpoint_tokenizer_json is None:
        raise CheckpointError(f"{checkpoint}: task {task.name!r} uses the model's tokenizer, but "
                              f"the checkpoint has no tokenizer.json (convert with --tokenizer)")
    return tokenizer_from_json(checkpoint_tokenizer_json)


def checkpoint_task_meta(exp_cfg: ExperimentConfig, task, eval_problems: int) -> dict[str, Any]:
    """What a run's checkpoints record so that `looprl generate` and `looprl eval` default to
    the run's framing and evaluation: `task` ({"name", "config"}: `get_task(name, **config)`
    rebuilds the evaluated task), `prompt_style`, `stop_ids`, and `eval` (the held-out
    evaluation's problem count, batch size, seed and greedy `SamplingConfig` fields)."""
    scfg = sampling_config(exp_cfg, greedy=True)
    return {"task": {"name": task.name, "config": task.config()},
            "prompt_style": task.prompt_style, "stop_ids": list(scfg.stop_ids),
            "eval": {"problems": eval_problems, "batch_size": exp_cfg.eval.eval_batch_size,
                     "seed": exp_cfg.run.seed, "max_new_tokens": scfg.max_new_tokens,
                     "exit_threshold": scfg.exit_threshold, "fixed_depth": scfg.fixed_depth,
                     "kv_policy": scfg.kv_policy,
                     "deferred_max_pending": scfg.deferred_max_pending,
                     "compute_dtype": scfg.compute_dtype,
                     "prompt_len_multiple": scfg.prompt_len_multiple, "kernels": scfg.kernels}}
