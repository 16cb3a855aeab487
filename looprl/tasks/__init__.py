"""Tasks with verifiable rewards: procedural arithmetic (reasoning-gym), GSM8K and JSONL math.

`get_task(name, **config)` builds one from the registry (`task_names()`); see `looprl.tasks.base`.
"""
from looprl.tasks.base import (EVAL, TRAIN, Problem, ProblemIterator, Task, get_task, register_task,
                               run_tasks, task_class, task_names)

__all__ = ["EVAL", "TRAIN", "Problem", "ProblemIterator", "Task", "get_task", "register_task",
           "run_tasks", "task_class", "task_names"]
