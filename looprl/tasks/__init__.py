"""Tasks with verifiable rewards: procedural arithmetic (reasoning-gym) and GSM8K.

`get_task(name, **config)` builds one (`arithmetic`, `gsm8k`); see `looprl.tasks.base`.
"""
from looprl.tasks.base import (EVAL, TRAIN, Problem, ProblemIterator, Task, get_task, register_task,
                               task_names)

__all__ = ["EVAL", "TRAIN", "Problem", "ProblemIterator", "Task", "get_task", "register_task",
           "task_names"]
