"""What a run is set up from: the tasks an experiment config names and the run's tokenizer.

The model config an experiment describes is `looprl.model.config.from_model_section`.
"""
from __future__ import annotations

from typing import Any

from looprl.config import ExperimentConfig
from looprl.errors import CheckpointError
from looprl.rl.rollout import sampling_config
from looprl.tasks import Task, run_tasks
from looprl.tokenizer import tokenizer_from_json


def build_tasks(exp_cfg: ExperimentConfig) -> tuple[Task, Task]:
    """(warm-start task, GRPO task) sharing one held-out set: the task registered as
    `task.name` maps the `task` section (`looprl.tasks.run_tasks`).

    Raises ConfigError for an unknown task or a task section that task rejects."""
    return run_tasks(exp_cfg.task, checkpoint=exp_cfg.model.checkpoint,
                     warm_start=exp_cfg.warm_start.enabled)


def run_tokenizer(task: Task, checkpoint_tokenizer_json: str | None, checkpoint: str | None):
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
